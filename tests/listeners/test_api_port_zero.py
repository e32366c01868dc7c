"""`listenerd --api-port 0` means "any free port", as for inbounds; it must not fall back to the
configured/default [api].port (8470), which a second node on the host may already hold."""

from __future__ import annotations

import re
import urllib.request

from include.app.lab.listenerd import Daemon
from include.app.lab.postgres_server import wait_for


def test_api_port_zero_binds_a_free_port_not_the_default(tmp_path, sqlite_config_fresh):
    d = Daemon(tmp_path / "node", sqlite_config_fresh, node_id="node-a:1:aa", api_port=0).start(wait=False)
    try:
        found: list[int] = []

        def bound() -> bool:
            m = re.search(r"API listening on port (\d+)", d.output())
            if m:
                found.append(int(m.group(1)))
            return bool(m) or d.proc.poll() is not None

        wait_for(bound, timeout=30, what="listenerd API bound")
        assert found, d.output()
        port = found[0]
        assert port not in (0, 8470)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        d.stop()
