"""Helpers the ggml layer's tests share (fixtures: tests/ggml/conftest.py)."""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np

from pyggml_dkv.common.bf16 import from_bf16_bits, to_bf16_bits
from pyggml_dkv.ggml import (
    Backend,
    Buffer,
    Context,
    Gallocr,
    Graph,
    Tensor,
    cpu_extra_buffer_types,
)
from pyggml_dkv.ggml._lowlevel import lib
from pyggml_dkv.ggml.capabilities import DKV_BUFFER_TYPE, dkv_buffer_available

NEOX = int(lib.GGML_ROPE_TYPE_NEOX)
RNG_SEED = 1234


def as_bf16(a: np.ndarray) -> np.ndarray:
    """float64 of `a` rounded to bf16 (nearest even), as ggml stores bf16 weights."""
    return from_bf16_bits(to_bf16_bits(a)).astype(np.float64)


def compute(
    backend: Backend, specs: list[tuple[str, np.ndarray]], build, graph_size: int = 128, dkv: tuple[int, ...] = ()
):
    """Upload `specs` (type, numpy array) into fresh tensors, run build(g, *tensors) -> output(s), return numpy.

    `dkv`: the indices of `specs` that go to our CPU_DKV buffer, where ggml has it, as the package
    places them on the CPU (our kernels read them there): a product's weights (BackendWeights), the
    K / V of flash attention (the drafter's caches)."""
    dkv = tuple(dkv) if backend.is_cpu and dkv_buffer_available() else ()
    with ExitStack() as stack:
        ctx = stack.enter_context(Context(n_tensors=len(specs)))
        dctx = stack.enter_context(Context(n_tensors=len(specs))) if dkv else ctx
        g = stack.enter_context(Context(n_tensors=graph_size, graph_size=graph_size))
        tensors = [
            (dctx if i in dkv else ctx).new_tensor(ty, *reversed(arr.shape)) for i, (ty, arr) in enumerate(specs)
        ]
        if dkv:
            stack.enter_context(
                Buffer.alloc_ctx_tensors_from_buft(dctx, cpu_extra_buffer_types()[DKV_BUFFER_TYPE], backend)
            )
        if len(specs) > len(dkv):
            stack.enter_context(Buffer.alloc_ctx_tensors(ctx, backend))
        for t, (_, arr) in zip(tensors, specs):
            t.set(arr)
        graph = Graph(g, graph_size)
        outs = build(g, *tensors)
        single = isinstance(outs, Tensor)
        outs = [outs] if single else list(outs)
        for o in outs:
            graph.expand(o)
        with Gallocr(backend) as galloc:
            galloc.alloc_graph(graph)
            graph.compute(backend)
            results = [o.numpy() for o in outs]
    return results[0] if single else results


def mul_mat_rows(backend: Backend, wt: Tensor, x: np.ndarray) -> np.ndarray:
    """x (rows, k) f32, or a batch (seqs, rows, k), times an uploaded weight tensor wt [k, n_out]
    (e.g. repacked): (rows, n_out) / (seqs, rows, n_out)."""
    with Context(n_tensors=1) as ctx, Context(n_tensors=4, graph_size=4) as g:
        xt = ctx.new_tensor("f32", *reversed(x.shape))
        with Buffer.alloc_ctx_tensors(ctx, backend):
            xt.set(x)
            graph = Graph(g, 4)
            out = g.mul_mat(wt, xt)
            graph.expand(out)
            with Gallocr(backend) as galloc:
                galloc.alloc_graph(graph)
                graph.compute(backend)
                return out.numpy()


def quantize_q8_0_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 of each row in 32-value blocks as the VNNI kernels quantize their activations (patches
    0010, 0022): (f16 scales as f32 [rows, blocks], int32 values [rows, blocks, 32]), values rounded
    to nearest even (ggml's vectorised quantizer; ties are measure-zero here)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int32)
    return d.astype(np.float16).astype(np.float32), q
