"""A byte-counting TCP relay, to measure what an RPC client sends and receives per step.

    with CountingRelay(server_port) as relay:
        backend = Backend(f"rpc:127.0.0.1:{relay.port}")
        ...
        before = relay.snapshot(); cache.step(...); sent, received = relay.since(before)

Loopback only. It adds a hop (latency numbers are taken without it); the byte counts are the
protocol's own, headers included.
"""

from __future__ import annotations

import socket
import threading


class CountingRelay:
    """Listens on 127.0.0.1 (ephemeral port) and relays each connection to 127.0.0.1:target_port,
    counting the bytes client -> server ("sent") and server -> client ("received")."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "sent"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "received"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                with self._lock:
                    setattr(self, counter, getattr(self, counter) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.sent, self.received

    def since(self, snapshot: tuple[int, int]) -> tuple[int, int]:
        sent, received = self.snapshot()
        return sent - snapshot[0], received - snapshot[1]

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            try:  # wakes the relay threads blocked in recv and sends the FIN close() alone would not
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __enter__(self) -> CountingRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
