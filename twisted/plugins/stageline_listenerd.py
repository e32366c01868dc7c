"""twistd plugin: `twistd -n stageline-listenerd --service-config stageline.toml --config ./config`.

It points at `listeners.daemon`, the one entry point (`makeService`), which `listenerd` runs too."""
from __future__ import annotations

from twisted.application.service import ServiceMaker

listenerd = ServiceMaker("Stageline listenerd", "listeners.daemon", "Leader-gated HL7 listener daemon",
                         "stageline-listenerd")
