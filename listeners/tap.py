"""twistd entry (`twisted/plugins/stageline_listenerd.py` points here)."""
from __future__ import annotations

from twisted.python import usage

from include import config as cfgmod


class Options(usage.Options):
    optParameters = [
        ["service-config", None, None, "stageline.toml ([store], [cluster])"],
        ["config", None, "config", "config dir holding connections.toml"],
    ]


def makeService(options: Options):
    from listeners.node import ListenerNode

    node = ListenerNode(cfgmod.load(options["service-config"]), options["config"])
    node.install_signal_handlers()
    return node
