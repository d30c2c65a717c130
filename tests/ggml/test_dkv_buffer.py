"""Our extra CPU buffer type (CPU_DKV): the hook patch (port plan P1) compiles our kernel files into
ggml-cpu and lists their buffer type among the CPU backend's extra buffer types. The skeleton
holds host memory and claims no op yet."""

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


needs_dkv_buffer = pytest.mark.skipif(DKV_BUFFER_KERNEL not in built_capabilities(),
                                      reason="ggml built without our extra buffer type (GGML_PATCHES=none or GGML_SRC)")


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
def test_skeleton_claims_no_op_and_leaves_ggmls_results_alone(rng):
    """No kernel file yet: an op on ordinary buffers computes exactly as before the hook."""
    w = rng.standard_normal((8, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    with Backend("cpu") as cpu:
        got = compute(cpu, [("f32", w), ("f32", x)], lambda g, a, b: g.mul_mat(a, b))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)
