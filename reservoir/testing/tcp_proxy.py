"""A TCP proxy on loopback that stands between clients and a broker, to break the path on
purpose: cut every connection, stall them (bytes stop flowing, sockets stay open, as in a
network partition), refuse new ones (the broker looks down), and restore.

It listens on and connects to loopback addresses only: it is test tooling for faults on
this machine, never a relay to anywhere else. One thread runs a selector over the
listening socket and every connection's two sockets.
"""

from __future__ import annotations

import contextlib
import ipaddress
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field

__all__ = ["TcpProxy"]

_CHUNK = 64 * 1024


def _loopback(host: str) -> str:
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot resolve {host!r}: {error}") from None
    if not address.is_loopback:
        raise ValueError(f"the proxy only talks to loopback addresses, not {host!r}")
    return str(address)


@dataclass(eq=False)
class _Pair:
    client: socket.socket
    upstream: socket.socket
    #: bytes read from one side and not yet written to the other
    pending: dict[socket.socket, bytearray] = field(default_factory=dict)

    def other(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream_host:upstream_port`` until :meth:`close`."""

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1", port: int = 0):
        self._upstream = (_loopback(upstream_host), upstream_port)
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._pairs: dict[socket.socket, _Pair] = {}
        self._stalled = False
        self._refusing = False
        self._closed = False
        #: connections accepted, and connections cut, since the start
        self.accepted = 0
        self.cut_count = 0
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name=f"tcp-proxy-{self.port}")
        self._thread.daemon = True
        self._thread.start()

    # -- faults ------------------------------------------------------------------------

    def cut(self) -> int:
        """Close every open connection at once (clients see the broker hang up). Returns
        how many were cut."""
        with self._lock:
            pairs = set(self._pairs.values())
            for pair in pairs:
                self._drop(pair)
            self.cut_count += len(pairs)
        self._wake()
        return len(pairs)

    def stall(self) -> None:
        """Stop moving bytes both ways; connections stay open (heartbeats stop too)."""
        with self._lock:
            self._stalled = True
        self._wake()

    def refuse(self) -> None:
        """Close new connections as soon as they arrive (the broker looks down)."""
        with self._lock:
            self._refusing = True

    def restore(self) -> None:
        """Forward again and accept again."""
        with self._lock:
            self._stalled = False
            self._refusing = False
        self._wake()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(set(self._pairs.values()))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        for pair in set(self._pairs.values()):
            self._drop(pair)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the loop ----------------------------------------------------------------------

    def _wake(self) -> None:
        # closed, or the wake buffer is full (then a wake is pending anyway)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._update_interest()
            for key, events in self._selector.select(timeout=1.0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._wake_r:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                elif sock is self._listener:
                    self._accept()
                else:
                    with self._lock:
                        pair = self._pairs.get(sock)
                        if pair is not None:
                            self._pump(pair, sock, events)

    def _update_interest(self) -> None:
        for sock, pair in self._pairs.items():
            events = 0
            if not self._stalled:
                # Read from a side only when what it sent before has been passed on.
                if not pair.pending.get(pair.other(sock)):
                    events |= selectors.EVENT_READ
                if pair.pending.get(sock):
                    events |= selectors.EVENT_WRITE
            registered = self._selector.get_map().get(sock)
            if not events:
                if registered is not None:
                    self._selector.unregister(sock)
            elif registered is None:
                self._selector.register(sock, events)
            elif registered.events != events:
                self._selector.modify(sock, events)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        with self._lock:
            refusing = self._refusing or self._closed
        if refusing:
            client.close()
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, upstream)
        with self._lock:
            self._pairs[client] = pair
            self._pairs[upstream] = pair
            self.accepted += 1

    def _pump(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        if self._stalled:
            return
        try:
            if events & selectors.EVENT_READ:
                data = sock.recv(_CHUNK)
                if not data:
                    self._drop(pair)
                    return
                pair.pending.setdefault(pair.other(sock), bytearray()).extend(data)
                self._flush(pair, pair.other(sock))
            if events & selectors.EVENT_WRITE:
                self._flush(pair, sock)
        except OSError:
            self._drop(pair)

    def _flush(self, pair: _Pair, sock: socket.socket) -> None:
        buffer = pair.pending.get(sock)
        if not buffer:
            return
        try:
            sent = sock.send(buffer)
        except BlockingIOError:
            return
        del buffer[:sent]

    def _drop(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.upstream):
            self._pairs.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            # RST rather than FIN: a cut connection, not a polite goodbye
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
