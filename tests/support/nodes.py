"""The listenerd node most cluster tests start: one MLLP inbound, `adt-in`, on a given port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from include.app.lab.listenerd import Daemon


def mllp_node(path: Path, store_config: Any, *, node_id: str, port: int, **kwargs: Any) -> Daemon:
    """A started listenerd (`Daemon`) whose one inbound is MLLP `adt-in` on 127.0.0.1:`port`."""
    inbound = [{"name": "adt-in", "kind": "mllp", "host": "127.0.0.1", "port": port}]
    return Daemon(path, store_config, node_id=node_id, inbound=inbound, **kwargs).start()
