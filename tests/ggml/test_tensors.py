"""Tensor metadata and I/O: numpy round trips in every type, quantization, dtype and shape checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv.ggml._lowlevel import lib
from pyggml_dkv.ggml import (
    Buffer,
    Context,
)
from pyggml_dkv.common.bf16 import from_bf16_bits as bf16_bits_to_fp32, to_bf16_bits as fp32_to_bf16_bits
from pyggml_dkv.common.numeric import relative_error


ROOT = Path(__file__).resolve().parents[2]


def _roundtrip(backend, ty, arr, shape=None):
    with Context(n_tensors=1) as ctx:
        t = ctx.new_tensor(ty, *reversed(shape or arr.shape), name=f"rt_{ty}")
        with Buffer.alloc_ctx_tensors(ctx, backend) as buf:
            assert t.is_allocated and buf.size >= t.nbytes and buf.is_host
            t.set(arr)
            return t.numpy()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_roundtrip_f32_f16_bf16_f64(be, rng):
    x = (rng.standard_normal((3, 5, 8)) * 10.0 ** rng.integers(-6, 6, (3, 5, 8))).astype(np.float32)
    np.testing.assert_array_equal(_roundtrip(be, "f32", x), x)
    np.testing.assert_array_equal(_roundtrip(be, "f16", x), x.astype(np.float16).astype(np.float32))
    got = _roundtrip(be, "bf16", x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint32) >> 16, fp32_to_bf16_bits(x))
    np.testing.assert_array_equal(got.view(np.uint32) & 0xFFFF, 0)
    x64 = rng.standard_normal((2, 3))
    np.testing.assert_array_equal(_roundtrip(be, "f64", x64), x64)
    # float64 and float16 arrays are accepted for f32 tensors (converted)
    np.testing.assert_array_equal(_roundtrip(be, "f32", x64), x64.astype(np.float32))
    h = x64.astype(np.float16)
    np.testing.assert_array_equal(_roundtrip(be, "f32", h), h.astype(np.float32))
    np.testing.assert_array_equal(_roundtrip(be, "bf16", h), bf16_bits_to_fp32(fp32_to_bf16_bits(h.astype(np.float32))))


def test_bf16_rounds_to_nearest_even(be):
    one_ulp = 2.0**-7  # bf16 keeps 7 mantissa bits
    x = np.array([1 + one_ulp / 2,  # tie -> even (1.0)
                  1 + 1.5 * one_ulp,  # tie -> even (1 + 2 ulp)
                  1 + one_ulp / 2 + 2**-20,  # just above the tie -> up
                  1 + one_ulp / 2 - 2**-20,  # just below -> down
                  -(1 + 1.5 * one_ulp), 0.0, np.inf, -0.0], np.float32)
    x[5] = np.array(0x7F7F8000, np.uint32).view(np.float32)  # max bf16 + half an ulp: a tie, to even = inf
    want = np.array([1.0, 1 + 2 * one_ulp, 1 + one_ulp, 1.0, -(1 + 2 * one_ulp), np.inf, np.inf, -0.0], np.float32)
    got = _roundtrip(be, "bf16", x)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[-1])


def test_roundtrip_ints(be, rng):
    for ty, dt in (("i8", np.int8), ("i16", np.int16), ("i32", np.int32), ("i64", np.int64)):
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, (4, 6), dtype=dt, endpoint=True)
        x[0, :2] = info.min, info.max
        got = _roundtrip(be, ty, x)
        assert got.dtype == dt
        np.testing.assert_array_equal(got, x)
    # any integer dtype whose values fit is accepted
    np.testing.assert_array_equal(_roundtrip(be, "i32", np.arange(6, dtype=np.uint8)), np.arange(6))
    np.testing.assert_array_equal(_roundtrip(be, "i32", np.array([-(2**31), 2**31 - 1], np.int64)),
                                  [-(2**31), 2**31 - 1])
    # values another integer dtype holds that the tensor's cannot are refused, not wrapped
    for bad in (np.array([2**31], np.int64), np.array([-(2**31) - 1], np.int64), np.array([2**31], np.uint32)):
        with pytest.raises(ValueError, match="values out of range for i32"):
            _roundtrip(be, "i32", bad)
    with pytest.raises(ValueError, match="values out of range for i8"):
        _roundtrip(be, "i8", np.array([200], np.int16))


@pytest.mark.parametrize("ty, tol", [("q8_0", 8e-3), ("q4_0", 1.5e-1)])
def test_roundtrip_quantized(be, rng, ty, tol):
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = _roundtrip(be, ty, x)
    assert got.shape == x.shape and got.dtype == np.float32
    assert relative_error(got, x) < tol
    # per 32-block absmax scaling: every value within half a step (+ the f16 rounding of the scale)
    if ty == "q8_0":
        step = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / 127
        assert (np.abs(got - x).reshape(-1, 32) <= step * 0.57).all()


def test_tensor_metadata(be):
    with Context(n_tensors=4) as ctx:
        t = ctx.new_tensor("f32", 8, 3, name="x")
        assert (t.ne, t.shape, t.ndim, t.type, t.nbytes, t.nelements) == ((8, 3, 1, 1), (3, 8), 2, "f32", 96, 24)
        assert t.nb == (4, 32, 96, 96) and t.is_contiguous and not t.is_allocated and t.op == "NONE"
        assert t.buffer_name is None
        v = ctx.new_tensor(lib.GGML_TYPE_I32, 5)
        assert v.shape == (5,) and v.type == "i32" and v.name == ""
        v.name = "idx"
        assert ctx.get_tensor("idx") == v and hash(ctx.get_tensor("idx")) == hash(v) and v != t
        q = ctx.new_tensor("Q8_0", 64, 2, 1, 1)
        assert q.shape == (1, 1, 2, 64) and q.ndim == 4 and q.nbytes == 2 * 68
        assert [x.name for x in ctx.tensors()] == ["x", "idx", ""]
        assert "x" in repr(t) and ctx.used_mem > 0
        with Buffer.alloc_ctx_tensors(ctx, be) as buf:
            assert t.is_allocated and t.data_address != 0
            assert t.buffer_name == buf.name  # "CPU", "CUDA0", "RPC[...]"
            t.fill(0)
            np.testing.assert_array_equal(t.numpy(), 0)
            t.set_bytes(np.full(8, 1.5, np.float32), offset=8 * 4)
            np.testing.assert_array_equal(t.numpy()[1], 1.5)
            buf.clear(0)
            np.testing.assert_array_equal(t.numpy(), 0)
            assert buf.name and buf.backend is be
    assert repr(t) == "Tensor(<context closed>)"


