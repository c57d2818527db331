"""A TCP proxy the chaos tests control: it forwards one listening port to one upstream address
until it is cut, then drops every open connection and refuses new ones until it is healed.

Threaded on purpose (not asyncio): the tests drive it from plain synchronous code, and each
connection's two pumps are independent blocking loops. A cut closes both sockets of every open
connection (the client sees its connection reset, like a link going down), and while cut a new
connection is accepted and closed at once, so a client retrying its connect keeps failing until
``heal``.
"""

from __future__ import annotations

import socket
import threading

BUFFER = 65536


class TcpProxy:
    """``127.0.0.1:<port>`` -> ``upstream``; ``cut()`` / ``heal()`` switch the link off and on."""

    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self.accepted = 0  # connections forwarded (tests check a healed client reconnected)
        self.refused = 0  # connections closed at once while cut
        threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True).start()

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Drop every open connection; refuse new ones until ``heal``."""
        with self._lock:
            self._cut = True
            sockets, self._open = self._open, set()
        for sock in sockets:
            _close(sock)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refuse = self._cut
            if refuse:
                self.refused += 1
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._cut:  # cut while connecting
                    _close(client)
                    _close(upstream)
                    continue
                self._open |= {client, upstream}
                self.accepted += 1
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        """Copy bytes one way until either side closes; then close both (the other pump ends)."""
        try:
            while data := source.recv(BUFFER):
                target.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {source, target}
            _close(source)
            _close(target)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
