"""TensorWriter: the per-step upload route of persistent inputs, checked once at creation."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.ggml import Buffer, Context, Gallocr, GGMLError, Graph
from pyggml_dkv.ggml.delta import DeltaUpload
from pyggml_dkv.ggml.writer import TensorWriter


def _tensor(be, ty, *ne):
    ctx = Context(n_tensors=2)
    t = ctx.new_tensor(ty, *ne, name=f"w_{ty}")
    buf = Buffer.alloc_ctx_tensors(ctx, be)
    return ctx, buf, t


@pytest.mark.parametrize("ty, dt", [("f32", np.float32), ("f16", np.float16), ("i32", np.int32), ("i64", np.int64)])
def test_write_whole_and_rows(be, rng, ty, dt):
    ctx, buf, t = _tensor(be, ty, 8, 5)  # numpy shape (5, 8)
    with ctx, buf:
        w = TensorWriter(t)
        full = (rng.standard_normal((5, 8)) * 100).astype(dt)
        w.write(full)
        np.testing.assert_array_equal(t.numpy(), full.astype(t.numpy().dtype))
        top = (rng.standard_normal((2, 8)) * 100).astype(dt)
        w.write_rows(top)
        want = full.copy()
        want[:2] = top
        np.testing.assert_array_equal(t.numpy(), want.astype(t.numpy().dtype))  # rows 2.. kept their bytes


def test_bad_arrays_are_refused_before_any_copy(be):
    ctx, buf, t = _tensor(be, "f32", 8, 5)
    with ctx, buf:
        w = TensorWriter(t)
        w.write(np.ones((5, 8), np.float32))
        for bad, err, match in (
            (np.zeros((5, 8), np.float64), TypeError, "takes float32 arrays, got float64"),
            ([[0.0] * 8] * 5, TypeError, "got list"),
            (np.zeros((8, 5), np.float32), ValueError, r"numpy shape \(5, 8\)"),
            (np.zeros((10, 16), np.float32)[::2, ::2], ValueError, "C-contiguous"),
        ):
            with pytest.raises(err, match=match):
                w.write(bad)
        with pytest.raises(ValueError, match=r"numpy shape \(5, 8\)"):
            w.write_rows(np.zeros((6, 8), np.float32))  # more rows than the tensor has
        with pytest.raises(ValueError, match=r"numpy shape \(5, 8\)"):
            w.write_rows(np.zeros((2, 7), np.float32))
        np.testing.assert_array_equal(t.numpy(), np.ones((5, 8), np.float32))  # nothing was written


def test_types_it_cannot_write_are_refused_at_creation(be):
    for ty in ("bf16", "q8_0"):
        ctx, buf, t = _tensor(be, ty, 32, 2)
        with ctx, buf, pytest.raises(TypeError, match=f"is {ty}: a TensorWriter writes only"):
            TensorWriter(t)
    with Context(n_tensors=1) as ctx:
        t = ctx.new_tensor("f32", 4)
        with pytest.raises(GGMLError, match="has no data"):
            TensorWriter(t)  # not allocated yet


def test_a_closed_buffer_or_context_raises_not_crashes(be):
    ctx, buf, t = _tensor(be, "f32", 4, 2)
    w = TensorWriter(t)
    buf.close()
    with pytest.raises(GGMLError, match="has no data|buffer that was closed"):
        w.write(np.zeros((2, 4), np.float32))
    ctx2, buf2, t2 = _tensor(be, "f32", 4, 2)
    w2 = TensorWriter(t2)
    buf2.close()
    ctx2.close()
    with pytest.raises(GGMLError, match="after its Context was closed"):
        w2.write(np.zeros((2, 4), np.float32))
    ctx.close()


def test_a_tensor_placed_anew_by_a_gallocr_is_written_where_it_is_now(be):
    """A graph's input placed by a Gallocr moves when the graph is allocated again (a new buffer):
    the writer checks the tensor again and writes it there."""
    with Context(n_tensors=4, graph_size=8) as gctx:
        a = gctx.new_tensor("f32", 4, 2, name="a").set_input()
        g = Graph(gctx, size=8)
        out = gctx.scale(a, 2.0)
        g.expand(out)
        with Gallocr(be) as ga:
            ga.alloc_graph(g)
            w = TensorWriter(a)
            w.write(np.ones((2, 4), np.float32))
            g.compute(be)
            np.testing.assert_array_equal(out.numpy(), np.full((2, 4), 2.0, np.float32))
        with Gallocr(be) as ga2:  # a new buffer: the old one is gone
            ga2.alloc_graph(g)
            w.write(np.full((2, 4), 3.0, np.float32))
            g.compute(be)
            np.testing.assert_array_equal(out.numpy(), np.full((2, 4), 6.0, np.float32))


def test_a_write_makes_an_overlapping_delta_upload_forget(be):
    """A DeltaUpload (on for RPC buffers, or when asked) must not skip bytes a writer changed."""
    ctx, buf, t = _tensor(be, "f32", 8, 4)
    with ctx, buf:
        up = DeltaUpload(t, enabled=True)
        up.upload(np.zeros((4, 8), np.float32))
        assert up.knows_device
        TensorWriter(t).write_rows(np.ones((1, 8), np.float32))
        assert not up.knows_device
        up.upload(np.zeros((4, 8), np.float32))  # whole again: the device holds zeros
        np.testing.assert_array_equal(t.numpy(), np.zeros((4, 8), np.float32))


def test_a_plain_delta_upload_writes_through_its_writer_or_converts(be):
    """DeltaUpload off (host memory) takes an array of the storage dtype through its TensorWriter
    and converts any other float array as Tensor.set does."""
    ctx, buf, t = _tensor(be, "f16", 8, 2)
    with ctx, buf:
        up = DeltaUpload.for_tensor(t)
        assert not up.enabled and up._writer is not None
        x = np.arange(16, dtype=np.float16).reshape(2, 8)
        up.upload(x)
        np.testing.assert_array_equal(t.numpy(), x.astype(np.float32))
        up.upload(x.astype(np.float64) * 2)  # converted, not refused
        np.testing.assert_array_equal(t.numpy(), x.astype(np.float32) * 2)
        assert up.bytes_sent == t.nbytes
