"""Our drafter on llama.cpp's own `ggml-rpc-server` (built from the llama-cpp-python 0.3.36 sdist,
the ggml release we build on): the same protocol as our client, the local CPU's bits over 60
steps, and a killed, frozen, busy or absent server an exception in bounded time, the host alive.

The binary comes from `bash scripts/build_llama_cpp_tool.sh ggml-rpc-server` (.ci/run builds it
before the tests; ~4 minutes once, then cached). Without it the module skips, except under CI.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv import Backend, DraftConfig, DraftWeights
from pyggml_dkv.ggml import BackendUnavailableError, RemoteBackendError, rpc
from pyggml_dkv.serving import RpcServerProcess

from .test_rpc_drafter import run, start_cache

ROOT = Path(__file__).resolve().parents[2]


def _llama_rpc_server_binary() -> str | None:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/build_llama_cpp_tool.sh"), "--cached", "ggml-rpc-server"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


BINARY = _llama_rpc_server_binary()
if BINARY is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI: .ci/run builds llama.cpp's ggml-rpc-server before the tests; it is missing")
    pytest.skip(
        "llama.cpp's ggml-rpc-server is not built (bash scripts/build_llama_cpp_tool.sh ggml-rpc-server)",
        allow_module_level=True,
    )


@pytest.fixture
def llama_server(free_port):
    with RpcServerProcess.llama_cpp(BINARY, free_port(), threads=1) as srv:
        yield srv


def test_llama_server_speaks_our_protocol_and_does_not_say_its_device(llama_server):
    info = rpc.probe(rpc.resolve("127.0.0.1", llama_server.port, llama_server.spec), 5.0, llama_server.spec)
    assert info.version == rpc.client_version()
    assert info.device_type is None  # it closes the connection at our device-type command
    with Backend(llama_server.spec) as undeclared:
        assert not undeclared.computes_on_cpu  # unknown: treated as a GPU
    with Backend(llama_server.spec, device_type="cpu") as declared:
        assert declared.computes_on_cpu and not declared.is_cpu


def test_declared_device_type_is_checked(cpu, shared_server):
    with pytest.raises(ValueError, match="RPC backends only"):
        Backend("cpu", device_type="cpu")
    with pytest.raises(ValueError, match="device_type must be one of"):
        Backend(shared_server.spec, device_type="tpu")
    with pytest.raises(ValueError, match="server says it computes on 'cpu'"):
        Backend(shared_server.spec, device_type="gpu")
    with Backend(shared_server.spec, device_type="cpu") as agreed:  # ours says, and agrees
        assert agreed.computes_on_cpu


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])  # weights; the cache is f16
def test_drafter_on_llama_server_is_bit_identical_to_local_cpu(cpu, llama_server, monkeypatch, dtype):
    """ggml's own kernels on both sides (its server has none of ours), so the same bits."""
    monkeypatch.setenv("PYGGML_DKV_GGML_KERNELS_ONLY", "1")
    cfg = DraftConfig.toy()  # 4 query heads over 2 K/V heads: the CPU-only GQA fold applies
    w = DraftWeights.random(cfg, seed=1)
    n_steps = 60  # committed reaches ~270: the 96-slot cache wraps twice
    feats = np.random.default_rng(2).standard_normal((300, cfg.fc_in)).astype(np.float32)
    fold_local, local = run(cpu, w, feats, dtype, n_steps)
    with Backend(llama_server.spec, device_type="cpu") as remote:
        fold_remote, over_rpc = run(remote, w, feats, dtype, n_steps)
    assert fold_local and fold_remote
    for step, (a, b) in enumerate(zip(local, over_rpc)):
        assert np.array_equal(a, b), f"step {step} differs: max {np.abs(a - b).max():.3g}"


def test_our_kernels_locally_differ_from_llama_server(cpu, llama_server):
    """The check above can fail: with our CPU kernels locally (f16 narrow products, tiled
    attention; ggml rounds the f16 products' columns to f16, ours keep them f32) the bits differ
    from ggml's on llama.cpp's server, by the f16 tolerance of the drafter's parity tests."""
    from pyggml_dkv.ggml.capabilities import dkv_buffer_available

    if not dkv_buffer_available():
        pytest.skip("this ggml has no CPU_DKV kernels: both sides run ggml's")
    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=1)
    feats = np.random.default_rng(2).standard_normal((40, cfg.fc_in)).astype(np.float32)
    _, local = run(cpu, w, feats, "f16", 8)
    with Backend(llama_server.spec, device_type="cpu") as remote:
        _, over_rpc = run(remote, w, feats, "f16", 8)
    assert any(not np.array_equal(a, b) for a, b in zip(local, over_rpc))
    for a, b in zip(local, over_rpc):
        assert np.abs(a - b).max() <= 5e-3 * np.abs(b).max()


@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_llama_server_failure_is_an_exception_and_the_host_lives_on(cpu, llama_server, failure):
    backend = Backend(llama_server.spec, timeout_s=1.5, device_type="cpu")
    bw, cache, step = start_cache(backend)
    if failure == "killed":
        llama_server.kill()
    else:
        llama_server.suspend()
    t0 = time.monotonic()
    with pytest.raises(RemoteBackendError):
        step()
    assert time.monotonic() - t0 < 5
    with pytest.raises(RemoteBackendError, match="re-create"):
        step()
    if failure == "frozen":
        llama_server.resume()
    cache.close()
    bw.close()
    backend.close()
    # the host process computes on: a local cache steps as before
    bw2, cache2, step2 = start_cache(cpu, 2)
    assert np.isfinite(step2()).all()
    cache2.close()
    bw2.close()


def test_stopped_llama_server_is_refused_in_bounded_time(llama_server):
    llama_server.stop()
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        Backend(llama_server.spec, timeout_s=1, device_type="cpu")
    assert time.monotonic() - t0 < 5


def test_busy_llama_server_is_refused_in_bounded_time(llama_server):
    """llama.cpp's server serves one client at a time: a second one (another process's Backend,
    here a raw connection past its handshake) gets an exception, not a hang."""
    import socket
    import struct

    other = socket.create_connection(("127.0.0.1", llama_server.port))
    other.sendall(struct.pack("<BQ", rpc.RPC_CMD_HELLO, rpc.CONN_CAPS_SIZE) + bytes(rpc.CONN_CAPS_SIZE))
    other.recv(8 + rpc.HELLO_RESPONSE_SIZE)
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        Backend(llama_server.spec, timeout_s=1, device_type="cpu")
    assert time.monotonic() - t0 < 5
    other.close()
