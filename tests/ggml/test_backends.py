"""What this build and machine can run, what they cannot and why, and bad backend specs."""

from __future__ import annotations

from pathlib import Path

import pytest

import pyggml_dkv
from pyggml_dkv.ggml import (
    Backend,
    BackendInfo,
    BackendUnavailableError,
    GGMLError,
    available_backends,
    list_devices,
    live_objects,
)
from pyggml_dkv.ggml._lowlevel import lib

ROOT = Path(__file__).resolve().parents[2]


def test_available_backends_lists_cpu_and_explains_the_rest():
    infos = pyggml_dkv.available_backends()
    assert all(isinstance(i, BackendInfo) for i in infos)
    by_name = {i.name: i for i in infos}
    assert by_name["cpu"].available and by_name["cpu"].reason is None
    assert by_name["cpu"].description
    for info in infos:
        if not info.available:
            assert isinstance(info.reason, str) and info.reason, info
            assert "unavailable" in repr(info)
    assert any(i.name.startswith("cuda") for i in infos), "CUDA must be listed, available or not"


def test_cuda_unavailable_here():
    cuda = [i for i in available_backends() if i.name.startswith("cuda")]
    if any(i.available for i in cuda):
        pytest.skip("this machine has a usable CUDA device")
    assert len(cuda) == 1 and not cuda[0].available and cuda[0].reason
    before = live_objects().get("backend", 0)
    for spec in ("cuda", "cuda:0", "CUDA:1", " cuda "):
        with pytest.raises(BackendUnavailableError) as err:
            Backend(spec)
        assert isinstance(err.value, GGMLError)
    assert live_objects().get("backend", 0) == before


@pytest.mark.parametrize(
    "spec, exc",
    [
        ("gpu", ValueError),
        ("cpu:1", ValueError),
        ("cpu:0", ValueError),
        ("cuda:x", ValueError),
        ("cuda:-1", ValueError),
        ("cuda:0:1", ValueError),
        ("", ValueError),
        ("metal", ValueError),
        (3, TypeError),
        (None, TypeError),
        (b"cpu", TypeError),
    ],
)
def test_bad_backend_specs(spec, exc):
    with pytest.raises(exc):
        Backend(spec)


def test_list_devices_has_the_cpu():
    devices = list_devices()
    cpu = [d for d in devices if d["type"] == lib.GGML_BACKEND_DEVICE_TYPE_CPU]
    assert cpu, devices
    assert cpu[0]["name"] == "CPU" and cpu[0]["description"]
    assert cpu[0]["memory_total"] >= cpu[0]["memory_free"] >= 0
    assert set(devices[0]) == {"name", "description", "type", "registry", "memory_free", "memory_total"}


@pytest.mark.parametrize("bad", [0, -1, 513, 2**40, 1.5, True, "2"])
def test_cpu_thread_count_validated(bad):
    before = live_objects().get("backend", 0)
    with pytest.raises(ValueError):
        Backend("cpu", n_threads=bad)
    assert live_objects().get("backend", 0) == before  # nothing leaked by the failed constructor


def test_cpu_backend_basics():
    with Backend(" CPU ", n_threads=1) as b:
        assert b.spec == "cpu" and b.is_cpu and b.name == "CPU" and b.n_threads == 1
        b.set_n_threads(2)
        assert b.n_threads == 2
        with pytest.raises(ValueError):
            b.set_n_threads(0)
        assert lib.ggml_backend_buft_is_host(b.buffer_type)
        b.synchronize()
        assert "CPU" in repr(b)
    assert b.closed and "closed" in repr(b)
    with pytest.raises(GGMLError):
        b.name
    b.close()  # twice is fine
