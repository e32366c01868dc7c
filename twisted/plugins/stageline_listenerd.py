"""twistd plugin: `twistd -n stageline-listenerd --service-config stageline.toml --config ./config`."""
from __future__ import annotations

from twisted.application.service import ServiceMaker

listenerd = ServiceMaker("Stageline listenerd", "listeners.tap", "Leader-gated HL7 listener daemon",
                         "stageline-listenerd")
