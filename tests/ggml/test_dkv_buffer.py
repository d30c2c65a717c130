"""Our extra CPU buffer type (CPU_DKV): the hook patch (port plan P1) compiles our kernel files into
ggml-cpu and lists their buffer type among the CPU backend's extra buffer types. It holds host
memory laid out as ggml's CPU buffer: every op may read it (ggml's own answer and kernels), and the
products our narrow kernels take (f16 / bf16 weights x few f32 columns: tests/ggml/test_ops.py,
test_bf16_products.py) run on them."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.ggml import Backend, Buffer, Context, built_capabilities, cpu_extra_buffer_types, lib
from pyggml_dkv.ggml.capabilities import CPU_DKV_HOOK, DKV_BUFFER_KERNEL, DKV_BUFFER_TYPE
from tests.ggml.helpers import compute


def test_buffer_type_is_listed_exactly_when_built():
    listed = list(cpu_extra_buffer_types())
    assert (DKV_BUFFER_TYPE in listed) == (DKV_BUFFER_KERNEL in built_capabilities()), (listed, built_capabilities())
    if DKV_BUFFER_KERNEL in built_capabilities():
        assert CPU_DKV_HOOK in built_capabilities()
        assert listed[0] == DKV_BUFFER_TYPE  # first: ops on its buffers reach our kernels before ggml's
        assert listed.count(DKV_BUFFER_TYPE) == 1


needs_dkv_buffer = pytest.mark.skipif(
    DKV_BUFFER_KERNEL not in built_capabilities(),
    reason="ggml built without our extra buffer type (GGML_PATCHES=none or GGML_SRC)",
)


@needs_dkv_buffer
def test_buffer_type_belongs_to_the_cpu_device_and_holds_tensors():
    buft = cpu_extra_buffer_types()[DKV_BUFFER_TYPE]
    cpu_dev = lib.ggml_backend_dev_by_name(b"CPU")
    assert lib.ggml_backend_buft_get_device(buft) == cpu_dev
    assert lib.ggml_backend_dev_supports_buft(cpu_dev, buft)
    data = np.arange(3 * 70, dtype=np.float32).reshape(3, 70)
    with Backend("cpu") as cpu, Context(n_tensors=2) as ctx:
        t = ctx.new_tensor("f32", 70, 3)
        with Buffer.alloc_ctx_tensors_from_buft(ctx, buft, cpu) as buf:
            assert buf.name == DKV_BUFFER_TYPE and buf.size >= data.nbytes
            t.set(data)
            np.testing.assert_array_equal(t.numpy(), data)
            buf.clear(0)
            np.testing.assert_array_equal(t.numpy(), np.zeros_like(data))


@needs_dkv_buffer
def test_ops_no_kernel_of_ours_takes_compute_as_ggml(rng):
    """An op on weights in our buffer that no kernel of ours takes (a get_rows, a product too wide
    for the narrow kernels, f32 weights) is supported as ggml supports it and computes exactly as on
    ggml's own buffer; the buffer is host memory."""
    w16 = rng.standard_normal((8, 64)).astype(np.float16)
    w32 = rng.standard_normal((8, 64)).astype(np.float32)
    x = rng.standard_normal((70, 64)).astype(np.float32)
    rows = np.array([3, 0, 7], np.int32)
    with Backend("cpu") as cpu:
        cases = [
            (lambda g, a, b: g.mul_mat(a, b), ("f32", x)),  # 70 columns: wider than the narrow kernels
            (lambda g, a, b: g.get_rows(a, b), ("i32", rows)),
        ]
        for wtype, w in (("f16", w16), ("f32", w32)):
            for build, second in cases:
                ours = compute(cpu, [(wtype, w), second], build, dkv=(0,))
                np.testing.assert_array_equal(ours, compute(cpu, [(wtype, w), second], build))
        buft = cpu_extra_buffer_types()[DKV_BUFFER_TYPE]
        with Context(n_tensors=2) as ctx, Context(n_tensors=4, graph_size=4) as g:
            t = ctx.new_tensor("f16", 64, 8)
            r = ctx.new_tensor("i32", 3)
            with Buffer.alloc_ctx_tensors_from_buft(ctx, buft, cpu) as buf:
                assert buf.is_host and t.in_host_memory
                t.set(w16)
                assert cpu.supports(g.get_rows(t, r)) and cpu.supports(g.mul_mat(t, g.new_tensor("f32", 64, 3)))
