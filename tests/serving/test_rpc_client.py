"""Backend("rpc:...") without a drafter: specs, handshakes, one Backend per server, failures."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from pyggml_dkv.ggml import Backend, BackendUnavailableError, Buffer, Context, RemoteBackendError, rpc


@pytest.mark.parametrize(
    "spec",
    [
        "rpc:127.0.0.1:abc",
        "rpc:127.0.0.1:99999",
        "rpc:127.0.0.1:50153x",
        "rpc:127.0.0.1:0",
        "rpc:127.0.0.1",
        "rpc:",
        "rpc::5000",
        "rpc:127.0.0.1:+80",
        "rpc:[::1]:5000",
        "rpc:127.0.0.1: 80",
    ],
)
def test_bad_specs_are_value_errors(spec):
    with pytest.raises(ValueError):
        Backend(spec)


def test_no_server_is_an_exception_naming_the_endpoint(free_port):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError, match=f"127.0.0.1:{port}"):
        Backend(f"rpc:127.0.0.1:{port}", timeout_s=1)
    assert time.monotonic() - t0 < 5


class FakeServer:
    """Accepts one connection and answers HELLO with `version`, or never answers (version None)."""

    def __init__(self, version: tuple[int, int, int] | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.version = version
        self.conn: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.conn, _ = self.sock.accept()
        request = self.conn.recv(1 + 8 + rpc.CONN_CAPS_SIZE)
        assert request[0] == rpc.RPC_CMD_HELLO
        if self.version is not None:
            reply = bytes(self.version) + bytes(1 + rpc.CONN_CAPS_SIZE)
            self.conn.sendall(struct.pack("<Q", len(reply)) + reply)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


@pytest.mark.parametrize("version", [(3, 0, 0), (4, 1, 0), (5, 0, 0)])
def test_version_mismatch_names_both_versions(version):
    fake = FakeServer(version)
    try:
        with pytest.raises(BackendUnavailableError) as err:
            Backend(f"rpc:127.0.0.1:{fake.port}", timeout_s=2)
        client = ".".join(map(str, rpc.client_version()))
        assert ".".join(map(str, version)) in str(err.value) and client in str(err.value)
    finally:
        fake.close()


def test_server_that_never_answers_the_handshake():
    fake = FakeServer(None)
    t0 = time.monotonic()
    try:
        with pytest.raises(BackendUnavailableError, match="handshake"):
            Backend(f"rpc:127.0.0.1:{fake.port}", timeout_s=1)
    finally:
        fake.close()
    assert time.monotonic() - t0 < 5


def test_server_learns_its_device_type(shared_server):
    with Backend(shared_server.spec) as be:
        assert be.rpc_server is not None and be.rpc_server.version == rpc.client_version()
        assert be.device_type == "cpu" and be.computes_on_cpu and not be.is_cpu


def test_second_backend_for_one_server_is_refused(shared_server):
    port = shared_server.port
    with Backend(f"rpc:127.0.0.1:{port}") as first:
        for spec in (f"rpc:127.0.0.1:{port}", f"rpc:localhost:{port}", f"rpc://localhost:{port}"):
            t0 = time.monotonic()
            with pytest.raises(BackendUnavailableError, match="already has an open Backend"):
                Backend(spec)
            assert time.monotonic() - t0 < 1
        assert not first.failed
    with Backend(f"rpc:localhost:{port}") as again:  # closed: the server is free again
        assert again.rpc_endpoint is not None and again.rpc_endpoint.address == "127.0.0.1"


def small_tensor(backend):
    ctx = Context(n_tensors=4)
    t = ctx.new_tensor("f32", 256, 4)
    buf = Buffer.alloc_ctx_tensors(ctx, backend)
    return ctx, t, buf


def test_killed_server_fails_transfers_not_the_process(server):
    be = Backend(server.spec, timeout_s=2)
    ctx, t, buf = small_tensor(be)
    data = np.arange(1024, dtype=np.float32).reshape(4, 256)
    t.set(data)
    assert np.array_equal(t.numpy(), data)
    server.kill()
    t0 = time.monotonic()
    with pytest.raises(RemoteBackendError):
        t.numpy()
    assert time.monotonic() - t0 < 5
    assert be.failed
    with pytest.raises(RemoteBackendError):
        t.set(data)
    with pytest.raises(RemoteBackendError):
        buf.clear(0)
    buf.close()
    be.close()


def test_frozen_server_times_out(server):
    be = Backend(server.spec, timeout_s=1.5)
    ctx, t, buf = small_tensor(be)
    t.set(np.ones((4, 256), np.float32))
    server.suspend()
    t0 = time.monotonic()
    with pytest.raises(RemoteBackendError):
        t.numpy()
    elapsed = time.monotonic() - t0
    assert 1.0 < elapsed < 5
    with pytest.raises(RemoteBackendError):  # stays failed: the stream cannot be resynchronised
        be.check_connection()
    server.resume()
    buf.close()
    be.close()


def test_server_busy_with_another_client_is_refused_in_bounded_time(server):
    """Another process holding the server (here: a raw connection past its handshake)."""
    other = socket.create_connection(("127.0.0.1", server.port))
    other.sendall(struct.pack("<BQ", rpc.RPC_CMD_HELLO, rpc.CONN_CAPS_SIZE) + bytes(rpc.CONN_CAPS_SIZE))
    other.recv(8 + rpc.HELLO_RESPONSE_SIZE)
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="one client at a time"):
        Backend(server.spec, timeout_s=1)
    assert time.monotonic() - t0 < 5
    other.close()
    with Backend(server.spec, timeout_s=5) as be:  # free again once the other client left
        assert be.device_type == "cpu"
