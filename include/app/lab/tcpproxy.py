"""A TCP proxy that can cut and restore the path between a node and its database.

`cut()` makes the network silently drop everything (open connections stop forwarding, new
connections are accepted but never forwarded) — the way a partition looks to a client, unlike a
refused connection. `restore()` closes the stuck connections and forwards normally again.
"""

from __future__ import annotations

import socket
import threading

from include.app.lab.postgres_server import free_port


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, listen_port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = listen_port or free_port()
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._server.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, name="tcpproxy", daemon=True)

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def cut(self) -> None:
        self._cut.set()

    def restore(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)
        self._cut.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._server.close()
        self.restore()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self._conns.append(client)
            if self._cut.is_set():
                continue  # accepted, never answered: a black hole
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            src.settimeout(0.2)
        except OSError:  # `restore()` closed it before this thread ran
            _close(dst)
            return
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self._cut.is_set():
                continue  # swallowed: the partition
            try:
                dst.sendall(data)
            except OSError:
                break
        _close(dst)
        _close(src)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass
