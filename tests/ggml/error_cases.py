"""Error paths of the ggml layer, each run in a child interpreter (tests/ggml/test_errors.py):
a case that would abort or crash the process is reported as a CRASH instead of ending the run.

Each case is a function whose last statement must raise the exception type it is registered
with (or none, for "NOERROR"); GROUPS maps a group name to its cases.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np

from pyggml_dkv.ggml import Backend, Buffer, Context, Gallocr, Graph, live_objects
from pyggml_dkv.ggml._lowlevel import lib

GROUPS: dict[str, dict[str, tuple[str, Callable[[], None]]]] = {"tensor": {}, "ops": {}, "lifecycle": {}, "harness": {}}


def case(group: str, expected: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register the decorated function as a case of `group` expected to raise `expected`."""

    def register(fn: Callable[[], None]) -> Callable[[], None]:
        GROUPS[group][fn.__name__] = (expected, fn)
        return fn

    return register


# ---------------------------------------------------------------------------- what cases share
BE = Backend("cpu", n_threads=1)
NEOX = lib.GGML_ROPE_TYPE_NEOX
META = Context(n_tensors=2048)  # unallocated tensors for graph-building checks
G = Context(n_tensors=2048)


def T(ty, *ne):
    return META.new_tensor(ty, *ne)


def inputs(*specs):
    """A context with one tensor per (type, *ne) spec, all allocated (zeroed) in one Buffer."""
    ctx = Context(n_tensors=len(specs) + 4)
    ts = [ctx.new_tensor(*s) for s in specs]
    buf = Buffer.alloc_ctx_tensors(ctx, BE)
    buf.clear(0)
    return (ctx, buf, *ts)


def graph_ctx(n=64):
    return Context(n_tensors=n, graph_size=n)


def run(g, *outs, galloc=None, size=64):
    graph = Graph(g, size)
    for o in outs:
        graph.expand(o)
    galloc = galloc or Gallocr(BE)
    galloc.alloc_graph(graph)
    graph.compute(BE)
    return graph, galloc


def scaled_graph():
    """An input a = 1 in a Buffer and a computed graph out = 2a: (ctx, buf, a, g, graph, galloc, out)."""
    ctx, buf, a = inputs(("f32", 4, 2))
    a.set(np.ones((2, 4), np.float32))
    g = graph_ctx()
    out = g.scale(a, 2.0)
    graph, galloc = run(g, out)
    assert (out.numpy() == 2).all()
    return ctx, buf, a, g, graph, galloc, out


# ---------------------------------------------------------------------------- tensor


@case("tensor", "ValueError")
def set_wrong_shape() -> None:
    ctx, buf, t = inputs(("f32", 4, 3))
    t.set(np.zeros((4, 3), np.float32))


@case("tensor", "ValueError")
def set_wrong_ndim() -> None:
    ctx, buf, t = inputs(("f32", 4, 3))
    t.set(np.zeros(12, np.float32))


@case("tensor", "ValueError")
def set_scalar() -> None:
    ctx, buf, t = inputs(("f32", 1))
    t.set(1.0)


@case("tensor", "TypeError")
def set_int_into_f32() -> None:
    ctx, buf, t = inputs(("f32", 4))
    t.set(np.arange(4))


@case("tensor", "TypeError")
def set_int_into_bf16() -> None:
    ctx, buf, t = inputs(("bf16", 4))
    t.set(np.arange(4))


@case("tensor", "TypeError")
def set_int_into_q8_0() -> None:
    ctx, buf, t = inputs(("q8_0", 32))
    t.set(np.arange(32))


@case("tensor", "TypeError")
def set_complex_into_f32() -> None:
    ctx, buf, t = inputs(("f32", 2))
    t.set(np.ones(2, np.complex64))


@case("tensor", "TypeError")
def set_float_into_i32() -> None:
    ctx, buf, t = inputs(("i32", 4))
    t.set(np.zeros(4, np.float32))


@case("tensor", "TypeError")
def set_bool_into_i32() -> None:
    ctx, buf, t = inputs(("i32", 2))
    t.set(np.array([True, False]))


@case("tensor", "ValueError")
def set_i8_out_of_range() -> None:
    ctx, buf, t = inputs(("i8", 4))
    t.set(np.array([1, 2, 3, 300]))


@case("tensor", "ValueError")
def set_i32_out_of_range() -> None:
    ctx, buf, t = inputs(("i32", 2))
    t.set(np.array([0, 2**40]))


@case("tensor", "ValueError")
def set_i32_negative_out_of_range() -> None:
    ctx, buf, t = inputs(("i32", 2))
    t.set(np.array([0, -(2**31) - 1]))


@case("tensor", "ValueError")
def set_i64_from_huge_uint64() -> None:
    ctx, buf, t = inputs(("i64", 1))
    t.set(np.array([2**64 - 1], np.uint64))


@case("tensor", "GGMLError")
def set_unallocated() -> None:
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    t.set(np.zeros(4, np.float32))


@case("tensor", "GGMLError")
def numpy_unallocated() -> None:
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    t.numpy()


@case("tensor", "GGMLError")
def fill_unallocated() -> None:
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    t.fill(0)


@case("tensor", "GGMLError")
def set_bytes_unallocated() -> None:
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    t.set_bytes(np.zeros(4, np.uint8))


@case("tensor", "GGMLError")
def set_noncontiguous_view() -> None:
    ctx = Context(n_tensors=2)
    t = ctx.new_tensor("f32", 4, 3)
    v = ctx.permute(t, 1, 0, 2, 3)
    buf = Buffer.alloc_ctx_tensors(ctx, BE)
    assert t.is_allocated and v.is_allocated and not v.is_contiguous and v.shape == (4, 3)
    v.set(np.zeros((4, 3), np.float32))


@case("tensor", "GGMLError")
def numpy_noncontiguous_view() -> None:
    ctx = Context(n_tensors=2)
    t = ctx.new_tensor("f32", 4, 3)
    v = ctx.view(t, (2, 3), (16,), 4)
    buf = Buffer.alloc_ctx_tensors(ctx, BE)
    assert v.is_allocated and not v.is_contiguous
    v.numpy()


@case("tensor", "ValueError")
def set_bytes_past_end() -> None:
    ctx, buf, t = inputs(("f32", 4))
    t.set_bytes(np.zeros(16, np.uint8), offset=8)


@case("tensor", "ValueError")
def set_bytes_negative_offset() -> None:
    ctx, buf, t = inputs(("f32", 4))
    t.set_bytes(np.zeros(4, np.uint8), offset=-4)


@case("tensor", "ValueError")
def name_too_long() -> None:
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    t.name = "x" * 200


@case("tensor", "ValueError")
def new_tensor_zero_dim() -> None:
    Context(n_tensors=1).new_tensor("f32", 4, 0)


@case("tensor", "ValueError")
def new_tensor_negative_dim() -> None:
    Context(n_tensors=1).new_tensor("f32", -4)


@case("tensor", "ValueError")
def new_tensor_no_dims() -> None:
    Context(n_tensors=1).new_tensor("f32")


@case("tensor", "ValueError")
def new_tensor_five_dims() -> None:
    Context(n_tensors=1).new_tensor("f32", 1, 1, 1, 1, 1)


@case("tensor", "ValueError")
def new_tensor_float_dim() -> None:
    Context(n_tensors=1).new_tensor("f32", 4.0)


@case("tensor", "ValueError")
def new_tensor_bool_dim() -> None:
    Context(n_tensors=1).new_tensor("f32", True)


@case("tensor", "ValueError")
def new_tensor_huge() -> None:
    Context(n_tensors=1).new_tensor("f32", 2**31, 2**31, 2**10)


@case("tensor", "ValueError")
def new_tensor_block_size() -> None:
    Context(n_tensors=1).new_tensor("q8_0", 33)


@case("tensor", "ValueError")
def new_tensor_unknown_type() -> None:
    Context(n_tensors=1).new_tensor("f8", 4)


@case("tensor", "ValueError")
def new_tensor_bad_type_id() -> None:
    Context(n_tensors=1).new_tensor(999, 4)


@case("tensor", "KeyError")
def get_tensor_missing() -> None:
    Context(n_tensors=1).get_tensor("nope")


@case("tensor", "GGMLError")
def context_full() -> None:
    ctx = Context(n_tensors=2)
    made = []
    try:
        for _ in range(100):
            made.append(ctx.new_tensor("f32", 4))
    finally:
        assert len(made) >= 2, len(made)


@case("tensor", "GGMLError")
def tiny_context() -> None:
    Context(mem_size=16).new_tensor("f32", 1)


@case("tensor", "GGMLError")
def tiny_arena_context() -> None:
    Context(mem_size=256, arena=np.zeros(256, np.uint8)).new_tensor("f32", 1)


@case("tensor", "GGMLError")
def context_full_of_views() -> None:
    ctx = Context(n_tensors=2)
    t = ctx.new_tensor("f32", 4)
    for _ in range(100):
        ctx.view(t, (2,))


@case("tensor", "GGMLError")
def context_full_with_data() -> None:
    ctx = Context(mem_size=4096, no_alloc=False)
    ctx.new_tensor("f32", 512)  # 2 KiB of data in the context
    ctx.new_tensor("f32", 512)


@case("tensor", "GGMLError")
def graph_context_full() -> None:
    ctx, buf, a = inputs(("f32", 4))
    g = Context(n_tensors=3)
    x = a
    for _ in range(10):
        x = g.scale(x, 1.0)


@case("tensor", "GGMLError")
def op_needing_data_in_alloc_context() -> None:
    ctx = Context(mem_size=1 << 16, no_alloc=False)
    a = ctx.new_tensor("f32", 1024)
    ctx.add(a, a)


@case("tensor", "ValueError")
def mem_size_zero() -> None:
    Context(mem_size=0)


@case("tensor", "ValueError")
def mem_size_float() -> None:
    Context(mem_size=1024.0)


@case("tensor", "ValueError")
def n_tensors_negative() -> None:
    Context(n_tensors=-1)


@case("tensor", "ValueError")
def arena_too_small() -> None:
    Context(mem_size=4096, arena=bytearray(1024))


@case("tensor", "ValueError")
def arena_read_only() -> None:
    Context(mem_size=1024, arena=bytes(1024))


@case("tensor", "ValueError")
def arena_misaligned() -> None:
    Context(mem_size=4096, arena=np.zeros(4096 + 64, np.uint8)[1:])


@case("tensor", "TypeError")
def arena_not_a_buffer() -> None:
    Context(mem_size=1024, arena=[0] * 1024)


@case("tensor", "GGMLError")
def graph_without_room() -> None:
    Graph(Context(n_tensors=4), 64)


@case("tensor", "GGMLError")
def graph_bigger_than_room() -> None:
    Graph(Context(n_tensors=4, graph_size=16), 64)


@case("tensor", "GGMLError")
def second_graph_without_room() -> None:
    g = Context(graph_size=16)
    Graph(g, 16)
    Graph(g, 16)


@case("tensor", "ValueError")
def graph_size_zero() -> None:
    Graph(graph_ctx(), 0)


@case("tensor", "ValueError")
def graph_size_float() -> None:
    Graph(graph_ctx(), 8.0)


@case("tensor", "GGMLError")
def graph_too_large_for_size() -> None:
    ctx, buf, a = inputs(("f32", 4))
    g = graph_ctx(64)
    graph = Graph(g, 8)
    x = a
    for _ in range(20):
        x = g.scale(x, 1.0)
    graph.expand(x)


@case("tensor", "GGMLError")
def graph_fills_up_across_expands() -> None:
    ctx, buf, a = inputs(("f32", 4))
    g = graph_ctx(64)
    graph = Graph(g, 6)
    x = a
    for _ in range(20):
        x = graph.expand(g.scale(x, 1.0))


@case("tensor", "GGMLError")
def alloc_empty_graph() -> None:
    Gallocr(BE).alloc_graph(Graph(graph_ctx(), 8))


@case("tensor", "GGMLError")
def compute_empty_graph() -> None:
    Graph(graph_ctx(), 8).compute(BE)


@case("tensor", "GGMLError")
def compute_unallocated_graph() -> None:
    ctx, buf, a = inputs(("f32", 4))
    g = graph_ctx()
    graph = Graph(g, 8)
    graph.expand(g.scale(a, 2.0))
    graph.compute(BE)


@case("tensor", "GGMLError")
def compute_with_unallocated_input() -> None:
    ctx, buf, a = inputs(("f32", 4))
    other = Context(n_tensors=1)
    b = other.new_tensor("f32", 4)
    g = graph_ctx()
    graph = Graph(g, 8)
    graph.expand(g.add(a, b))
    graph.compute(BE)


# ---------------------------------------------------------------------------- ops


@case("ops", "ValueError")
def mul_mat_k_mismatch() -> None:
    G.mul_mat(T("f32", 8, 4), T("f32", 16, 2))


@case("ops", "ValueError")
def mul_mat_batch_mismatch() -> None:
    G.mul_mat(T("f32", 8, 4, 3), T("f32", 8, 2, 4))


@case("ops", "ValueError")
def mul_mat_transposed_a() -> None:
    G.mul_mat(G.permute(T("f32", 4, 8), 1, 0, 2, 3), T("f32", 8, 2))


@case("ops", "ValueError")
def mul_mat_transposed_b() -> None:
    G.mul_mat(T("f32", 8, 4), G.permute(T("f32", 2, 8), 1, 0, 2, 3))


@case("ops", "ValueError")
def mul_mat_int_a() -> None:
    G.mul_mat(T("i32", 8, 4), T("f32", 8, 2))


@case("ops", "ValueError")
def mul_mat_f16_b_with_q8_a() -> None:
    G.mul_mat(T("q8_0", 32, 4), T("f16", 32, 2))


@case("ops", "ValueError")
def mul_mat_i32_b() -> None:
    G.mul_mat(T("f32", 8, 4), T("i32", 8, 2))


@case("ops", "ValueError")
def add_broadcast_mismatch() -> None:
    G.add(T("f32", 8, 3), T("f32", 3))


@case("ops", "ValueError")
def add_b_larger_than_a() -> None:
    G.add(T("f32", 8), T("f32", 8, 3))


@case("ops", "ValueError")
def mul_broadcast_mismatch() -> None:
    G.mul(T("f32", 8, 4, 2), T("f32", 8, 3))


@case("ops", "ValueError")
def sub_broadcast_mismatch() -> None:
    G.sub(T("f32", 8, 4), T("f32", 8, 1, 2))


@case("ops", "ValueError")
def add_int_types() -> None:
    G.add(T("i32", 4), T("i32", 4))


@case("ops", "ValueError")
def add_f32_plus_f16() -> None:
    G.add(T("f32", 4), T("f16", 4))


@case("ops", "ValueError")
def add_transposed_a() -> None:
    G.add(G.permute(T("f32", 4, 8), 1, 0, 2, 3), T("f32", 8))


@case("ops", "ValueError")
def silu_transposed() -> None:
    G.silu(G.permute(T("f32", 4, 3), 1, 0, 2, 3))


@case("ops", "ValueError")
def tanh_transposed() -> None:
    G.tanh(G.permute(T("f32", 4, 3), 1, 0, 2, 3))


@case("ops", "ValueError")
def silu_int() -> None:
    G.silu(T("i32", 4))


@case("ops", "ValueError")
def softplus_q8() -> None:
    G.softplus(T("q8_0", 32))


@case("ops", "ValueError")
def scale_permuted() -> None:
    G.scale(G.permute(T("f32", 4, 3, 2), 0, 2, 1, 3), 2.0)


@case("ops", "ValueError")
def scale_f16() -> None:
    G.scale(T("f16", 4), 2.0)


@case("ops", "ValueError")
def scale_nan() -> None:
    G.scale(T("f32", 4), float("nan"))


@case("ops", "ValueError")
def scale_string() -> None:
    G.scale(T("f32", 4), "2")


@case("ops", "ValueError")
def rms_norm_negative_eps() -> None:
    G.rms_norm(T("f32", 4), -1e-6)


@case("ops", "ValueError")
def rms_norm_inf_eps() -> None:
    G.rms_norm(T("f32", 4), float("inf"))


@case("ops", "ValueError")
def rms_norm_f16() -> None:
    G.rms_norm(T("f16", 4), 1e-6)


@case("ops", "ValueError")
def rms_norm_transposed() -> None:
    G.rms_norm(G.permute(T("f32", 4, 3), 1, 0, 2, 3), 1e-6)


@case("ops", "ValueError")
def argmax_3d() -> None:
    G.argmax(T("f32", 4, 3, 2))


@case("ops", "ValueError")
def argmax_f16() -> None:
    G.argmax(T("f16", 4, 3))


@case("ops", "ValueError")
def soft_max_permuted() -> None:
    G.soft_max_ext(G.permute(T("f32", 4, 3, 2), 0, 2, 1, 3), None, 1.0)


@case("ops", "ValueError")
def soft_max_max_bias_without_mask() -> None:
    G.soft_max_ext(T("f32", 4, 3), None, 1.0, 0.5)


@case("ops", "ValueError")
def soft_max_mask_too_short() -> None:
    G.soft_max_ext(T("f32", 4, 3), T("f16", 4, 2), 1.0)


@case("ops", "ValueError")
def soft_max_mask_i32() -> None:
    G.soft_max_ext(T("f32", 4, 3), T("i32", 4, 3), 1.0)


@case("ops", "ValueError")
def soft_max_mask_heads() -> None:
    G.soft_max_ext(T("f32", 4, 3, 3), T("f16", 4, 3, 2), 1.0)


@case("ops", "ValueError")
def rope_pos_f32() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("f32", 5), 16, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_pos_i64() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i64", 5), 16, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_pos_too_short() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 4), 16, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_pos_too_long() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 6), 16, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_pos_matrix() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5, 2), 16, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_odd_n_dims() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 15, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_n_dims_too_big() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 32, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_mode_1() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, 1, 0, 10000.0)


@case("ops", "ValueError")
def rope_mode_mrope() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, 8, 0, 10000.0)


@case("ops", "ValueError")
def rope_int_input() -> None:
    G.rope_ext(T("i32", 16, 2, 5), T("i32", 5), 16, NEOX, 0, 10000.0)


@case("ops", "ValueError")
def rope_nan_base() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, NEOX, 0, float("nan"))


@case("ops", "ValueError")
def rope_freq_factors_short() -> None:
    G.rope_ext(T("f32", 16, 2, 5), T("i32", 5), 16, NEOX, 0, 1e4, freq_factors=T("f32", 4))


@case("ops", "ValueError")
def fa_mask_f32() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f32", 10, 4), 0.1)


@case("ops", "ValueError")
def fa_mask_wrong_kv_len() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f16", 12, 4), 0.1)


@case("ops", "ValueError")
def fa_mask_too_few_rows() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f16", 10, 2), 0.1)


@case("ops", "ValueError")
def fa_mask_heads() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), T("f16", 10, 4, 3), 0.1)


@case("ops", "ValueError")
def fa_mask_noncontiguous() -> None:
    G.flash_attn_ext(
        T("f32", 32, 4, 4, 1),
        T("f16", 32, 10, 2, 1),
        T("f16", 32, 10, 2, 1),
        G.permute(T("f16", 4, 10), 1, 0, 2, 3),
        0.1,
    )


@case("ops", "ValueError")
def fa_head_dim_mismatch() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 16, 10, 2, 1), T("f16", 16, 10, 2, 1), None, 0.1)


@case("ops", "ValueError")
def fa_heads_not_multiple() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 3, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, 0.1)


@case("ops", "ValueError")
def fa_kv_rows_differ() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 9, 2, 1), None, 0.1)


@case("ops", "ValueError")
def fa_kv_heads_differ() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 1, 1), None, 0.1)


@case("ops", "ValueError")
def fa_ne3_differ() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 2), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, 0.1)


@case("ops", "ValueError")
def fa_max_bias_without_mask() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, 0.1, max_bias=1.0)


@case("ops", "ValueError")
def fa_scale_inf() -> None:
    G.flash_attn_ext(T("f32", 32, 4, 4, 1), T("f16", 32, 10, 2, 1), T("f16", 32, 10, 2, 1), None, float("inf"))


@case("ops", "ValueError")
def set_rows_index_f32() -> None:
    G.set_rows(T("f32", 8, 6), T("f32", 8, 2), T("f32", 2))


@case("ops", "ValueError")
def set_rows_index_i16() -> None:
    G.set_rows(T("f32", 8, 6), T("f32", 8, 2), T("i16", 2))


@case("ops", "ValueError")
def set_rows_source_f16() -> None:
    G.set_rows(T("f32", 8, 6), T("f16", 8, 2), T("i32", 2))


@case("ops", "ValueError")
def set_rows_width_mismatch() -> None:
    G.set_rows(T("f32", 8, 6), T("f32", 4, 2), T("i32", 2))


@case("ops", "ValueError")
def set_rows_count_mismatch() -> None:
    G.set_rows(T("f32", 8, 6), T("f32", 8, 2), T("i32", 3))


@case("ops", "ValueError")
def set_rows_transposed_source() -> None:
    G.set_rows(T("f32", 2, 6), G.permute(T("f32", 2, 2), 1, 0, 2, 3), T("i32", 2))


@case("ops", "ValueError")
def get_rows_index_i64() -> None:
    G.get_rows(T("f32", 8, 6), T("i64", 3))


@case("ops", "ValueError")
def get_rows_index_f32() -> None:
    G.get_rows(T("f32", 8, 6), T("f32", 3))


@case("ops", "ValueError")
def get_rows_batch_mismatch() -> None:
    G.get_rows(T("f32", 8, 6, 2), T("i32", 3))


@case("ops", "ValueError")
def get_rows_f64_data() -> None:
    G.get_rows(T("f64", 8, 6), T("i32", 3))


@case("ops", "ValueError")
def reshape_element_count() -> None:
    G.reshape(T("f32", 8, 3), 5, 5)


@case("ops", "ValueError")
def reshape_noncontiguous() -> None:
    G.reshape(G.permute(T("f32", 8, 3), 1, 0, 2, 3), 24, 1)


@case("ops", "ValueError")
def reshape_one_dim() -> None:
    G.reshape(T("f32", 8, 3), 24)


@case("ops", "ValueError")
def permute_repeated_axis() -> None:
    G.permute(T("f32", 8, 3), 0, 0, 1, 2)


@case("ops", "ValueError")
def permute_axis_out_of_range() -> None:
    G.permute(T("f32", 8, 3), 0, 1, 2, 4)


@case("ops", "ValueError")
def permute_negative_axis() -> None:
    G.permute(T("f32", 8, 3), -1, 0, 1, 2)


@case("ops", "ValueError")
def view_out_of_bounds() -> None:
    G.view(T("f32", 8, 3), (8, 3), offset=4)


@case("ops", "ValueError")
def view_too_many_rows() -> None:
    G.view(T("f32", 8, 3), (8, 4))


@case("ops", "ValueError")
def view_overlapping_strides() -> None:
    G.view(T("f32", 16), (8, 4), (4,), 0)


@case("ops", "ValueError")
def view_of_view_past_base() -> None:
    t = T("f32", 16)
    v = G.view(t, (8,), offset=32)
    G.view(v, (4, 2), (8,), 4)


@case("ops", "ValueError")
def view_negative_offset() -> None:
    G.view(T("f32", 8), (4,), offset=-4)


@case("ops", "ValueError")
def view_zero_dim() -> None:
    G.view(T("f32", 8), (0,))


@case("ops", "ValueError")
def view_five_dims() -> None:
    G.view(T("f32", 8), (1, 1, 1, 1, 1))


@case("ops", "ValueError")
def view_stride_count() -> None:
    G.view(T("f32", 8, 2), (4, 2), (16, 32))


@case("ops", "ValueError")
def view_quantized_partial_block() -> None:
    G.view(T("q8_0", 64), (16,))


@case("ops", "ValueError")
def concat_type_mismatch() -> None:
    G.concat(T("f32", 4, 3), T("f16", 4, 3), 1)


@case("ops", "ValueError")
def concat_bad_dim() -> None:
    G.concat(T("f32", 4, 3), T("f32", 4, 3), 4)


@case("ops", "ValueError")
def concat_shape_mismatch() -> None:
    G.concat(T("f32", 4, 3), T("f32", 5, 3), 1)


@case("ops", "ValueError")
def cpy_count_mismatch() -> None:
    G.cpy(T("f32", 4, 3), T("f32", 4, 2))


@case("ops", "ValueError")
def cpy_i32_to_f16() -> None:
    G.cpy(T("i32", 4), T("f16", 4))


@case("ops", "ValueError")
def cast_int_to_f16() -> None:
    G.cast(T("i32", 4, 3), "f16")


@case("ops", "ValueError")
def cast_f16_to_i32() -> None:
    G.cast(T("f16", 4, 3), "i32")


@case("ops", "ValueError")
def cast_q8_to_f16() -> None:
    G.cast(T("q8_0", 32, 3), "f16")


@case("ops", "ValueError")
def cast_partial_block() -> None:
    G.cast(T("f32", 10, 3), "q8_0")


@case("ops", "ValueError")
def cast_transposed_to_q8() -> None:
    G.cast(G.permute(T("f32", 32, 32), 1, 0, 2, 3), "q8_0")


@case("ops", "ValueError")
def cast_unknown_type() -> None:
    G.cast(T("f32", 4), "f8")


@case("ops", "GGMLError")
def op_on_tensor_of_closed_context() -> None:
    c = Context(n_tensors=1)
    t = c.new_tensor("f32", 4)
    c.close()
    G.scale(t, 2.0)


@case("ops", "GGMLError")
def op_in_closed_context() -> None:
    g = Context(n_tensors=4)
    g.close()
    g.scale(T("f32", 4), 2.0)


# ---------------------------------------------------------------------------- lifecycle


@case("lifecycle", "GGMLError")
def compute_after_buffer_closed() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    buf.close()
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def compute_after_buffer_closed_and_address_reused() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    buf.close()
    others = [inputs(("f32", 4, 2)) for _ in range(4)]  # malloc hands the freed address out again
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def read_after_buffer_closed() -> None:
    ctx, buf, a = inputs(("f32", 4))
    buf.close()
    others = [inputs(("f32", 4)) for _ in range(4)]
    a.numpy()


@case("lifecycle", "GGMLError")
def write_after_buffer_closed() -> None:
    ctx, buf, a = inputs(("f32", 4))
    buf.close()
    a.set(np.zeros(4, np.float32))


@case("lifecycle", "GGMLError")
def read_view_after_buffer_closed() -> None:
    ctx, buf, a = inputs(("f32", 4))
    v = G.view(a, (2,), offset=8)
    buf.close()
    others = [inputs(("f32", 4)) for _ in range(4)]
    v.numpy()


@case("lifecycle", "GGMLError")
def buffer_dropped_without_a_reference() -> None:
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 4)
    Buffer.alloc_ctx_tensors(ctx, BE)  # not kept: garbage-collected at once
    gc.collect()
    t.set(np.zeros(4, np.float32))


@case("lifecycle", "NOERROR")
def buffer_again_after_close() -> None:
    ctx, buf, a = inputs(("f32", 4))
    buf.close()
    buf2 = Buffer.alloc_ctx_tensors(ctx, BE)
    a.set(np.arange(4, dtype=np.float32))
    assert (a.numpy() == np.arange(4)).all()


@case("lifecycle", "GGMLError")
def closed_buffer_properties() -> None:
    ctx, buf, a = inputs(("f32", 4))
    buf.close()
    buf.close()
    buf.size


@case("lifecycle", "GGMLError")
def compute_after_gallocr_closed() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    galloc.close()
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def read_output_after_gallocr_closed() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    galloc.close()
    others = [scaled_graph() for _ in range(3)]
    out.numpy()


@case("lifecycle", "NOERROR")
def gallocr_kept_alive_by_its_graph() -> None:
    ctx, buf, a = inputs(("f32", 4))
    a.set(np.ones(4, np.float32))
    g = graph_ctx()
    graph = Graph(g, 8)
    out = graph.expand(g.scale(a, 2.0))
    Gallocr(BE).alloc_graph(graph)  # not kept by the caller: the graph keeps it
    gc.collect()
    others = [scaled_graph() for _ in range(3)]
    graph.compute(BE)
    assert (out.numpy() == 2).all()


@case("lifecycle", "NOERROR")
def gallocr_again_after_close() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    galloc.close()
    with Gallocr(BE) as galloc2:
        galloc2.alloc_graph(graph)
        graph.compute(BE)
        assert (out.numpy() == 2).all()


@case("lifecycle", "GGMLError")
def stale_graph_after_gallocr_growth() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    ctx2, buf2, big = inputs(("f32", 4096, 16))
    g2 = graph_ctx()
    run(g2, g2.add(big, big), galloc=galloc)
    others = [scaled_graph() for _ in range(3)]
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def stale_output_after_gallocr_growth() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    ctx2, buf2, big = inputs(("f32", 4096, 16))
    g2 = graph_ctx()
    run(g2, g2.add(big, big), galloc=galloc)
    out.numpy()


@case("lifecycle", "NOERROR")
def growing_a_graph_after_allocation() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    ctx2, buf2, big = inputs(("f32", 4096, 16))
    big.set(np.ones((16, 4096), np.float32))
    out2 = graph.expand(g.scale(big, 3.0))  # more nodes after allocation: the buffer must grow
    galloc.alloc_graph(graph)
    graph.compute(BE)
    assert (out.numpy() == 2).all() and (out2.numpy() == 3).all()


@case("lifecycle", "GGMLError")
def reserve_growth_detaches() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    ctx2, buf2, big = inputs(("f32", 4096, 16))
    g2 = graph_ctx()
    graph2 = Graph(g2, 8)
    graph2.expand(g2.add(big, big))
    galloc.reserve(graph2)
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def compute_after_graph_context_closed() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    g.close()
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def compute_after_input_context_closed() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    ctx.close()
    graph.compute(BE)


@case("lifecycle", "GGMLError")
def alloc_after_input_context_closed() -> None:
    ctx, buf, a = inputs(("f32", 4))
    g = graph_ctx()
    graph = Graph(g, 8)
    graph.expand(g.scale(a, 2.0))
    ctx.close()
    Gallocr(BE).alloc_graph(graph)


@case("lifecycle", "GGMLError")
def expand_after_context_closed() -> None:
    ctx, buf, a = inputs(("f32", 4))
    g = graph_ctx()
    graph = Graph(g, 8)
    t = g.scale(a, 2.0)
    ctx.close()
    graph.expand(t)


@case("lifecycle", "GGMLError")
def tensor_after_context_closed() -> None:
    c = Context(n_tensors=1)
    t = c.new_tensor("f32", 4)
    c.close()
    t.ne


@case("lifecycle", "GGMLError")
def tensor_name_after_context_closed() -> None:
    c = Context(n_tensors=1)
    t = c.new_tensor("f32", 4)
    c.close()
    t.name = "x"


@case("lifecycle", "GGMLError")
def new_tensor_after_context_closed() -> None:
    c = Context(n_tensors=1)
    c.close()
    c.close()
    c.new_tensor("f32", 4)


@case("lifecycle", "GGMLError")
def graph_in_closed_context() -> None:
    g = graph_ctx()
    g.close()
    Graph(g, 8)


@case("lifecycle", "GGMLError")
def compute_on_closed_backend() -> None:
    ctx, buf, a, g, graph, galloc, out = scaled_graph()
    other = Backend("cpu")
    other.close()
    graph.compute(other)


@case("lifecycle", "GGMLError")
def gallocr_on_closed_backend() -> None:
    b = Backend("cpu")
    b.close()
    Gallocr(b)


@case("lifecycle", "GGMLError")
def buffer_on_closed_backend() -> None:
    c = Context(n_tensors=1)
    c.new_tensor("f32", 4)
    b = Backend("cpu")
    b.close()
    Buffer.alloc_ctx_tensors(c, b)


@case("lifecycle", "GGMLError")
def alloc_ctx_tensors_twice() -> None:
    ctx, buf, a = inputs(("f32", 4))
    Buffer.alloc_ctx_tensors(ctx, BE)


@case("lifecycle", "GGMLError")
def alloc_ctx_tensors_of_data_context() -> None:
    c = Context(mem_size=4096, no_alloc=False)
    c.new_tensor("f32", 4)
    Buffer.alloc_ctx_tensors(c, BE)


@case("lifecycle", "ValueError")
def buffer_size_zero() -> None:
    Buffer.alloc(BE, 0)


@case("lifecycle", "GGMLError")
def closed_backend_threads() -> None:
    b = Backend("cpu")
    b.close()
    b.set_n_threads(2)


@case("lifecycle", "NOERROR")
def live_objects_balance() -> None:
    gc.collect()
    before = {k: v for k, v in live_objects().items() if v}
    for _ in range(3):
        parts = scaled_graph()
        for obj in reversed(parts):
            if hasattr(obj, "close"):
                obj.close()
    del parts
    gc.collect()
    after = {k: v for k, v in live_objects().items() if v}
    assert after == before, (before, after)


# ---------------------------------------------------------------------------- the harness itself


@case("harness", "NOERROR")
def ok() -> None:
    pass


@case("harness", "")
def abort() -> None:
    import os

    os.abort()


@case("harness", "ValueError")
def after() -> None:
    raise ValueError("still running")


def run_cases(group: str, *names: str) -> int:
    """Child side: run the named cases of `group` in order, printing START / RESULT lines."""
    for name in names:
        print("START", name, flush=True)
        try:
            GROUPS[group][name][1]()
        except BaseException as e:  # noqa: BLE001 - report whatever it was
            msg = " ".join(str(e).split())[:300]
            print("RESULT", name, type(e).__name__, msg, flush=True)
        else:
            print("RESULT", name, "NOERROR", flush=True)
    return 0
