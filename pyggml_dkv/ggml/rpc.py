"""Client side of ggml's RPC backend, checked in Python before ggml sees an endpoint.

ggml's own client aborts the process on a bad endpoint, an absent server or a version mismatch.
So `Backend("rpc:HOST:PORT")` first validates the spec here, resolves the host (IPv4, as ggml's
transport does), and speaks the first two messages of the protocol itself on a throw-away
connection with a timeout:

- HELLO (command 14, fixed by ggml forever): the server's protocol version. ggml's rule: the
  major versions match and the server's minor is not newer than the client's.
- DEVICE_TYPE (GGML_RPC_EXT_CMD_DEVICE_TYPE, 0xF0: a command our ggml's server adds outside the
  protocol's numbering): whether the server computes on a CPU or a GPU, which protocol 7.0.0
  cannot tell (ggml's client reports every RPC device as a GPU). A server of another ggml build
  (llama.cpp's ggml-rpc-server) closes the connection at that command; its device type is then
  unknown and treated as "not a CPU".

Only then does ggml open its own connection, which speaks plain protocol 7.0.0 (with socket
timeouts where our ggml has them).
"""

from __future__ import annotations

import socket
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._lowlevel import lib
from .errors import BackendUnavailableError

if TYPE_CHECKING:  # pragma: no cover
    from .backend import Backend

RPC_CMD_HELLO = 14
# our server's device-type command (None: this ggml build's server lacks it, so do not ask)
RPC_CMD_DEVICE_TYPE: int | None = getattr(lib, "GGML_RPC_EXT_CMD_DEVICE_TYPE", None)
CONN_CAPS_SIZE = 24
HELLO_RESPONSE_SIZE = 4 + CONN_CAPS_SIZE  # major, minor, patch, padding, conn_caps

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# what a caller may declare for a server that does not say (Backend(..., device_type=...))
DECLARABLE_DEVICE_TYPES = ("cpu", "gpu")

DEFAULT_TIMEOUT_S = 10.0


def client_version() -> tuple[int, int, int]:
    """The RPC protocol version of this build's ggml client."""
    return (int(lib.RPC_PROTO_MAJOR_VERSION), int(lib.RPC_PROTO_MINOR_VERSION), int(lib.RPC_PROTO_PATCH_VERSION))


@dataclass(frozen=True)
class Endpoint:
    host: str  # as written in the spec
    address: str  # the IPv4 address it resolved to
    port: int

    def __str__(self) -> str:
        return f"{self.address}:{self.port}"


@dataclass(frozen=True)
class ServerInfo:
    version: tuple[int, int, int]
    device_type: str | None  # "cpu", "gpu", ...; None when the server does not say (other ggml build)


def parse_spec(spec: str) -> tuple[str, int]:
    """'rpc:HOST:PORT' (or 'rpc://HOST:PORT') -> (HOST, PORT). PORT: digits only, 1..65535."""
    rest = spec.split(":", 1)[1] if ":" in spec else ""
    rest = rest.removeprefix("//")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"RPC backend spec must be 'rpc:HOST:PORT', got {spec!r}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"RPC port must be a number in 1..65535, got {port!r} in {spec!r}")
    if host.startswith("[") or ":" in host:
        raise ValueError(
            f"RPC host {host!r} in {spec!r}: ggml's RPC transport speaks IPv4 only (use a name or a dotted address)"
        )
    if not host.isascii() or any(c.isspace() for c in host):
        raise ValueError(f"bad RPC host {host!r} in {spec!r}")
    return host, int(port)


def resolve(host: str, port: int, spec: str) -> Endpoint:
    """The IPv4 address ggml would connect to; the same server named twice resolves the same."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise BackendUnavailableError(f"{spec!r}: cannot resolve RPC host {host!r} to an IPv4 address ({exc})") from exc
    return Endpoint(host, str(infos[0][4][0]), port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def _command(sock: socket.socket, cmd: int, payload: bytes, response_size: int) -> bytes:
    # request: | cmd (1 byte) | size (8 bytes) | payload |; response: | size (8 bytes) | data |
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != response_size:
        raise ConnectionError(f"malformed reply to command {cmd}: {size} bytes, expected {response_size}")
    return _recv_exact(sock, size)


def probe(endpoint: Endpoint, timeout_s: float, spec: str) -> ServerInfo:
    """Connect, check the protocol version and ask the device type, all within timeout_s per
    socket operation. Raises BackendUnavailableError naming the endpoint (and versions)."""
    client = client_version()
    where = f"RPC server {endpoint} ({spec!r})"
    try:
        sock = socket.create_connection((endpoint.address, endpoint.port), timeout=timeout_s)
    except OSError as exc:
        raise BackendUnavailableError(
            f"{where}: cannot connect ({exc}); is `python -m pyggml_dkv.serving.rpc_server` running there?"
        ) from exc
    with sock:
        try:
            hello = _command(sock, RPC_CMD_HELLO, bytes(CONN_CAPS_SIZE), HELLO_RESPONSE_SIZE)
        except (OSError, ConnectionError) as exc:
            busy = (
                " (a ggml RPC server serves one client at a time: is another process or Backend using it?)"
                if isinstance(exc, socket.timeout)
                else ""
            )
            raise BackendUnavailableError(
                f"{where}: no protocol handshake within {timeout_s:g} s per message: {exc}{busy}"
            ) from exc
        server = (hello[0], hello[1], hello[2])
        if server[0] != client[0] or server[1] > client[1]:
            raise BackendUnavailableError(
                f"{where}: RPC protocol version {'.'.join(map(str, server))} does not fit this client's "
                f"{'.'.join(map(str, client))} (majors must match, the server's minor may not be newer); "
                "run the server and the client from the same pyggml_dkv version"
            )
        device_type: str | None = None
        if RPC_CMD_DEVICE_TYPE is not None:
            try:
                (type_id,) = struct.unpack("<I", _command(sock, RPC_CMD_DEVICE_TYPE, struct.pack("<I", 0), 4))
                device_type = DEVICE_TYPES.get(type_id, f"type{type_id}")
            except (OSError, ConnectionError):
                pass  # a server of another ggml build: it does not know the command
    return ServerInfo(server, device_type)


class _OpenEndpoints:
    """One Backend per RPC server per process. ggml shares one connection between all clients of
    an endpoint string, and its per-backend graph cache then replays another backend's graph
    (wrong results); two strings for one server (127.0.0.1 / localhost) open a second connection,
    which a one-client-at-a-time server never answers (deadlock). So a second one is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], weakref.ref[Backend]] = {}

    def claim(self, endpoint: Endpoint, backend: Backend, spec: str) -> None:
        key = (endpoint.address, endpoint.port)
        with self._lock:
            ref = self._open.get(key)
            other = ref() if ref is not None else None
            if other is not None and not other.closed:
                raise BackendUnavailableError(
                    f"{spec!r}: this process already has an open Backend({other.spec!r}) on RPC server {endpoint}; "
                    "use that one (ggml's RPC client keeps one connection per server) or close it first"
                )
            self._open[key] = weakref.ref(backend)

    def release(self, endpoint: Endpoint, backend: Backend) -> None:
        key = (endpoint.address, endpoint.port)
        with self._lock:
            ref = self._open.get(key)
            if ref is not None and ref() in (backend, None):
                del self._open[key]


open_endpoints = _OpenEndpoints()
