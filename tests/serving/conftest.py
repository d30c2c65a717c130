"""RPC servers for the serving tests: child processes on loopback, on ephemeral ports."""

from __future__ import annotations

import socket

import pytest

from pyggml_dkv.ggml import built_backends

if "rpc" not in built_backends():  # pragma: no cover - depends on the build
    pytest.skip("ggml built without RPC (GGML_RPC=1 ./build_ggml.sh)", allow_module_level=True)

from pyggml_dkv.serving import RpcServerProcess  # noqa: E402


def _free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (free unless someone races us for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server():
    """A fresh server per test (the failure tests kill or freeze theirs)."""
    with RpcServerProcess(_free_port(), threads=1) as srv:
        yield srv


@pytest.fixture(scope="module")
def shared_server():
    with RpcServerProcess(_free_port(), threads=1) as srv:
        yield srv


@pytest.fixture
def free_port():
    return _free_port
