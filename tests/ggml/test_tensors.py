"""Tensor metadata and I/O: numpy round trips in every type, quantization, dtype and shape checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyggml_dkv.common.bf16 import from_bf16_bits as bf16_bits_to_fp32
from pyggml_dkv.common.bf16 import to_bf16_bits as fp32_to_bf16_bits
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import (
    Buffer,
    Context,
)
from pyggml_dkv.ggml._lowlevel import lib

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
    x = np.array(
        [
            1 + one_ulp / 2,  # tie -> even (1.0)
            1 + 1.5 * one_ulp,  # tie -> even (1 + 2 ulp)
            1 + one_ulp / 2 + 2**-20,  # just above the tie -> up
            1 + one_ulp / 2 - 2**-20,  # just below -> down
            -(1 + 1.5 * one_ulp),
            0.0,
            np.inf,
            -0.0,
        ],
        np.float32,
    )
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
    np.testing.assert_array_equal(
        _roundtrip(be, "i32", np.array([-(2**31), 2**31 - 1], np.int64)), [-(2**31), 2**31 - 1]
    )
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


# ------------------------------------------------------------------ outputs placed in numpy arrays
def _product_graph(backend, rng):  # noqa: ANN001, ANN202
    """a @ b.T (a [6, 32], b [5, 32]) as a graph: (inputs' context and buffer, graph context, graph,
    output, gallocr, the expected product)."""
    from pyggml_dkv.ggml import Gallocr, Graph

    a, b = rng.standard_normal((6, 32)).astype(np.float32), rng.standard_normal((5, 32)).astype(np.float32)
    ctx = Context(n_tensors=2)
    ta, tb = ctx.new_tensor("f32", 32, 6), ctx.new_tensor("f32", 32, 5)
    buf = Buffer.alloc_ctx_tensors(ctx, backend)
    ta.set(a)
    tb.set(b)
    g = Context(n_tensors=8, graph_size=8)
    graph = Graph(g, 8)
    out = graph.expand(g.mul_mat(tb, ta))  # [5, 6]: numpy (6, 5)
    galloc = Gallocr(backend)
    galloc.alloc_graph(graph)
    return (ctx, buf), g, graph, out, galloc, a @ b.T


def test_output_placed_in_a_numpy_array(cpu, rng):
    """A graph output placed in a numpy array: computing writes the values there (no copy out);
    the tensor reads them back from it; the array outlives the caller's reference (its Context
    keeps it), and allocating the graph again leaves the tensor where it was placed."""
    import gc

    from pyggml_dkv.ggml import host_array

    (ctx, buf), g, graph, out, galloc, want = _product_graph(cpu, rng)
    with ctx, buf, g, galloc:
        first = host_array(out.shape)
        assert first.ctypes.data % 64 == 0 and first.shape == (6, 5) and first.dtype == np.float32
        out.place_in(first)
        assert out.data_address == first.ctypes.data
        graph.compute(cpu)
        np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out.numpy(), first)
        # a second array: the first keeps its values, the second gets the next results
        second = host_array(out.shape)
        out.place_in(second)
        keep = first.copy()
        del second
        gc.collect()  # the Context holds the array the tensor is placed in
        galloc.alloc_graph(graph)  # reallocating does not move a placed tensor
        graph.compute(cpu)
        np.testing.assert_array_equal(first, keep)
        np.testing.assert_array_equal(out.numpy(), keep)


def test_placing_refuses_what_would_break(cpu, rng):
    from pyggml_dkv.ggml import Gallocr, GGMLError, Graph, cpu_extra_buffer_types, cpu_repack_fits, host_array

    (ctx, buf), g, graph, out, galloc, _ = _product_graph(cpu, rng)
    with ctx, buf, g, galloc:
        with pytest.raises(ValueError, match="float32 array of shape"):
            out.place_in(host_array((5, 6)))
        with pytest.raises(ValueError, match="float32 array of shape"):
            out.place_in(host_array((6, 5), np.float64))
        with pytest.raises(TypeError, match="numpy array"):
            out.place_in([[0.0] * 5] * 6)  # type: ignore[arg-type]
        wide = host_array((6, 10))
        with pytest.raises(ValueError, match="C-contiguous"):
            out.place_in(wide[:, ::2])
        ro = host_array((6, 5))
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            out.place_in(ro)
        raw = host_array((6 * 5 + 1,))
        with pytest.raises(ValueError, match="64-byte aligned"):
            out.place_in(raw[1:].reshape(6, 5))
    # a matrix stored repacked for a CPU kernel holds no numpy layout
    if "CPU_DKV_REPACK" in cpu_extra_buffer_types() and cpu_repack_fits("q8_0", (64, 16)):
        with Context(n_tensors=1) as wctx:
            w = wctx.new_tensor("q8_0", 64, 16)
            with Buffer.alloc_ctx_tensors_from_buft(wctx, cpu_extra_buffer_types()["CPU_DKV_REPACK"], cpu):
                with pytest.raises(GGMLError, match="repacked"):
                    w.place_in(host_array((16, 64), np.uint8))
    # views: unallocated, or placed with the tensor they view
    with Context(n_tensors=1) as ctx, Context(n_tensors=8, graph_size=8) as g:
        t = ctx.new_tensor("f32", 8, 2)
        unallocated = g.view(t, (8,))
        with pytest.raises(GGMLError, match="has no data"):
            unallocated.place_in(host_array((8,)))
        with Buffer.alloc_ctx_tensors(ctx, cpu):
            t.set(np.ones((2, 8), np.float32))
            graph = Graph(g, 8)
            first_row = graph.expand(g.view(g.scale(t, 2.0), (8,)))
            with Gallocr(cpu) as galloc:
                galloc.alloc_graph(graph)
                with pytest.raises(GGMLError, match="is a view"):
                    first_row.place_in(host_array((8,)))
