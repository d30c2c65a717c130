"""The screened argmax op (ggml/ops_screen.py, _cffi/screened_argmax.c): argmax_t (exact_t . x)
found through a q8_0 screen and a proven bound must equal the float64 argmax, also where the
screen alone orders the rows wrongly."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from pyggml_dkv.ggml import Buffer, Context, Gallocr, Graph, amx_available, cpu_extra_buffer_types, vnni_available
from pyggml_dkv.ggml.screen import screen_bounds
from tests.ggml.helpers import RNG_SEED

# where the screen's q8_0 product runs: ggml's generic kernel, our VNNI one, ggml's AMX tiles
REPACK = [False] + (["CPU_DKV_REPACK"] if vnni_available() else []) + (["AMX"] if amx_available() else [])


class ScreenedArgmax:
    """exact (V, H) uploaded as `exact_type`, its q8_0 screen (in a repacking buffer when asked), and a
    graph computing [screen scores, screened ids, the plain argmax of the exact product] for x."""

    def __init__(self, backend, exact: np.ndarray, q: int, exact_type: str = "f16", repack: str | bool = False) -> None:
        v, h = exact.shape
        self.stack = contextlib.ExitStack()
        wctx = self.stack.enter_context(Context(n_tensors=2))
        self.exact = wctx.new_tensor(exact_type, h, v, name="exact")
        self.bounds = wctx.new_tensor("f32", 2, v + 1, name="bounds")
        self.stack.enter_context(Buffer.alloc_ctx_tensors(wctx, backend))
        self.exact.set(exact)
        self.values = self.exact.numpy().astype(np.float64)  # what the exact products read
        screen = screen_bounds(self.values)
        self.bounds.set(screen.bounds)
        sctx = self.stack.enter_context(Context(n_tensors=1))
        self.screen = sctx.new_tensor("q8_0", h, v, name="screen")
        if repack:
            self.stack.enter_context(
                Buffer.alloc_ctx_tensors_from_buft(sctx, cpu_extra_buffer_types()[repack], backend)
            )
        else:
            self.stack.enter_context(Buffer.alloc_ctx_tensors(sctx, backend))
        self.screen.set_bytes(screen.raw)
        assert self.screen.is_repacked == bool(repack)
        xctx = self.stack.enter_context(Context(n_tensors=1))
        self.x = xctx.new_tensor("f32", h, q, name="x")
        self.stack.enter_context(Buffer.alloc_ctx_tensors(xctx, backend))
        g = self.stack.enter_context(Context(n_tensors=16, graph_size=16))
        self.graph = Graph(g, 16)
        self.scores = g.mul_mat(self.screen, self.x)
        self.ids = g.screened_argmax(self.scores, self.x, self.exact, self.bounds)
        self.plain = g.argmax(g.mul_mat(self.exact, self.x))
        for t in (self.scores, self.ids, self.plain):
            t.set_output()
            self.graph.expand(t)
        self.stack.enter_context(Gallocr(backend)).alloc_graph(self.graph)
        self.backend = backend

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.x.set(x)
        self.graph.compute(self.backend)
        return self.ids.numpy(), self.scores.numpy(), self.plain.numpy()

    def exact_argmax(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(x.astype(np.float64) @ self.values.T, axis=1)

    def close(self) -> None:
        self.stack.close()


@pytest.fixture
def rng():
    return np.random.default_rng(RNG_SEED)


@pytest.mark.parametrize("repack", REPACK)
@pytest.mark.parametrize("exact_type", ["f16", "bf16", "f32"])
def test_random_rows_match_float64(be, rng, exact_type, repack):
    v, h, q = 3008, 256, 16
    exact = rng.standard_normal((v, h), dtype=np.float32) / 16
    op = ScreenedArgmax(be, exact, q, exact_type, repack)
    try:
        for _ in range(4):
            x = rng.standard_normal((q, h), dtype=np.float32) * rng.uniform(0.1, 10)
            ids, _, plain = op(x)
            want = op.exact_argmax(x)
            np.testing.assert_array_equal(ids, want)
            if exact_type != "bf16":  # ggml's bf16 product rounds x to bf16 too: its argmax may differ
                np.testing.assert_array_equal(plain, want)
    finally:
        op.close()


def near_tied_rows(rng, v: int, h: int, scale: float) -> np.ndarray:
    """Rows in pairs that differ by a relative ~`scale`: their products with any x are closer than
    the screen's q8_0 error, so the screen often orders a pair wrongly."""
    base = rng.standard_normal((v // 2, h)).astype(np.float32)
    twin = base * (1 + scale * rng.standard_normal((v // 2, h)).astype(np.float32))
    rows = np.empty((v, h), np.float32)
    rows[0::2], rows[1::2] = base, twin
    return rows.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("repack", REPACK)
def test_near_ties_the_screen_gets_wrong(be, rng, repack):
    """The screen's own argmax is wrong for many columns; the screened argmax never is. (A bound too
    small to cover the screen's error, or no exact rescoring, fails this.)"""
    v, h, q = 512, 512, 16
    op = ScreenedArgmax(be, near_tied_rows(rng, v, h, 2e-3), q, "f16", repack)
    screen_wrong = 0
    try:
        for _ in range(12):
            x = rng.standard_normal((q, h), dtype=np.float32)
            ids, scores, _ = op(x)
            want = op.exact_argmax(x)
            np.testing.assert_array_equal(ids, want)
            screen_wrong += int((np.argmax(scores, axis=1) != want).sum())
    finally:
        op.close()
    assert screen_wrong >= 10, f"the screen alone was wrong in only {screen_wrong} of {12 * q} columns"


def test_exact_ties_take_the_lowest_row(be, rng):
    v, h, q = 256, 64, 8
    exact = rng.standard_normal((v, h), dtype=np.float32)
    exact[200] = exact[70] = exact[130] = 3 * np.abs(exact).max(axis=0)  # three equal rows, above the rest
    op = ScreenedArgmax(be, exact, q, "f32")
    try:
        ids, _, _ = op(np.abs(rng.standard_normal((q, h), dtype=np.float32)))
        np.testing.assert_array_equal(ids, 70)
    finally:
        op.close()


def test_portable_code_gives_the_same_ids(be, rng, monkeypatch):
    """PYGGML_DKV_SCREEN_SCALAR runs the scans and f16 products without AVX2 / F16C."""
    v, h, q = 1000, 512, 16
    op = ScreenedArgmax(be, near_tied_rows(rng, v, h, 2e-3), q, "f16")
    try:
        x = rng.standard_normal((q, h), dtype=np.float32)
        fast, _, _ = op(x)
        monkeypatch.setenv("PYGGML_DKV_SCREEN_SCALAR", "1")
        portable, _, _ = op(x)
        np.testing.assert_array_equal(portable, fast)
        np.testing.assert_array_equal(portable, op.exact_argmax(x))
    finally:
        op.close()


@pytest.mark.parametrize("case", ["wide range in a block", "tiny (f16 subnormal scales)", "past q8_0's range", "zeros"])
def test_extreme_columns(be, rng, case):
    """The bound covers the activations' quantization at any magnitude: values of very different
    size in one block, scales f16 stores as subnormals, and blocks whose scale overflows f16 (the
    screen's scores are then inf / NaN and every row is multiplied exactly)."""
    v, h, q = 600, 128, 4
    op = ScreenedArgmax(be, near_tied_rows(rng, v, h, 1e-2), q, "f16")
    try:
        x = rng.standard_normal((q, h), dtype=np.float32)
        if case == "wide range in a block":
            x *= np.float32(1e-4)
            x[:, ::32] = 1e3
        elif case == "tiny (f16 subnormal scales)":
            x *= np.float32(1e-9)
        elif case == "past q8_0's range":
            x[:, 5] = 3e7
        else:
            x[:] = 0
        ids, _, _ = op(x)
        np.testing.assert_array_equal(ids, op.exact_argmax(x))
    finally:
        op.close()


def test_non_finite_column_gives_minus_one(be, rng):
    v, h, q = 300, 64, 4
    op = ScreenedArgmax(be, rng.standard_normal((v, h), dtype=np.float32), q, "f16")
    try:
        x = rng.standard_normal((q, h), dtype=np.float32)
        x[1, 3] = np.nan
        x[3, 0] = np.inf
        ids, _, _ = op(x)
        assert ids[1] == -1 and ids[3] == -1
        np.testing.assert_array_equal(ids[[0, 2]], op.exact_argmax(x)[[0, 2]])
    finally:
        op.close()


def test_checks_before_building(be, rng):
    with contextlib.ExitStack() as st:
        w = st.enter_context(Context(n_tensors=8))
        exact = w.new_tensor("f16", 64, 100, name="exact")
        bounds = w.new_tensor("f32", 2, 101, name="bounds")
        q8 = w.new_tensor("q8_0", 64, 100, name="q8")
        odd = w.new_tensor("f16", 48, 100, name="odd")
        st.enter_context(Buffer.alloc_ctx_tensors(w, be))
        g = st.enter_context(Context(n_tensors=32, graph_size=32))
        x = g.new_tensor("f32", 64, 4, name="x")
        scores = g.new_tensor("f32", 100, 4, name="scores")
        with pytest.raises(ValueError, match="exact must be f32/f16/bf16, got q8_0"):
            g.screened_argmax(scores, x, q8, bounds)
        with pytest.raises(ValueError, match=r"scores must be \[100, 4\]"):
            g.screened_argmax(g.new_tensor("f32", 99, 4), x, exact, bounds)
        with pytest.raises(ValueError, match=r"bounds must be \[2, 101\]"):
            g.screened_argmax(scores, x, exact, g.new_tensor("f32", 2, 100))
        with pytest.raises(ValueError, match="exact rows have 48 values, x columns 64"):
            g.screened_argmax(scores, x, odd, bounds)
        with pytest.raises(ValueError, match="multiple of 32"):
            g.screened_argmax(g.new_tensor("f32", 100, 4), g.new_tensor("f32", 48, 4), odd, bounds)
        with pytest.raises(ValueError, match="scores must be f32"):
            g.screened_argmax(g.new_tensor("f16", 100, 4), x, exact, bounds)
        with pytest.raises(ValueError, match="must be contiguous"):
            g.screened_argmax(scores, g.permute(g.new_tensor("f32", 4, 64), 1, 0, 2, 3), exact, bounds)
        with pytest.raises(ValueError, match="must already be allocated"):
            g.screened_argmax(scores, x, g.new_tensor("f16", 64, 100), bounds)


def test_screen_bounds_checks():
    with pytest.raises(ValueError, match="multiple of 32"):
        screen_bounds(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match="NaN or inf"):
        screen_bounds(np.full((4, 32), np.inf, np.float32))
    with pytest.raises(ValueError, match="floating-point"):
        screen_bounds(np.zeros((4, 32), np.int32))
    big = np.ones((4, 32), np.float32)
    big[2, 7] = 1e7  # a bf16 / f32 head may hold it; q8_0's f16 block scale cannot
    with pytest.raises(ValueError, match="beyond q8_0's range .* rows 0..3"):
        screen_bounds(big)


def test_screen_bounds_are_upper_bounds(rng):
    """Each row's stored norms are at least the float64 norms (rounded up into f32), the last row
    their maxima."""
    m = (rng.standard_normal((70, 96)) * 10.0 ** rng.uniform(-6, 3, (70, 1))).astype(np.float32)
    s = screen_bounds(m)
    from pyggml_dkv.ggml import dequantize

    deq = dequantize("q8_0", s.raw, m.size).reshape(m.shape).astype(np.float64)
    ew = np.linalg.norm(m.astype(np.float64) - deq, axis=1)
    wq = np.linalg.norm(deq, axis=1)
    assert s.bounds.dtype == np.float32 and s.bounds.shape == (71, 2)
    assert (s.bounds[:70, 0] >= ew).all() and (s.bounds[:70, 1] >= wq).all()
    np.testing.assert_allclose(s.bounds[:70, 0], ew, rtol=1e-6)
    np.testing.assert_array_equal(s.bounds[70], s.bounds[:70].max(axis=0))


@pytest.mark.parametrize("repack", REPACK)
def test_errors_aligned_against_the_screen(be, rng, repack):
    """A worst case for the bound: row u scores above row t on the screen, but both rows' q8_0
    rounding errors point along x (t's towards it, u's away), so t is the exact argmax by a margin
    of ~10% of those errors. x is flat (every |x_i| equal: its q8_0 quantization is exact) and the
    rows small but for each block's maximum, so the bound is mostly the weight-error part (the
    activation part, ~20% of it, cannot be made to point the same way at once): a bound under
    ~3/4 of the proven one rules t out (checked by hand: 0.7x fails, 0.8x passes)."""
    h, d = 256, 2.0**-7  # every block's scale is d exactly: each block holds one 127 d value
    x = np.where(rng.random(h) < 0.5, -0.75, 0.75).astype(np.float32)
    grid = rng.integers(-3, 4, h).astype(np.float64)
    grid[::32] = 127
    free = np.ones(h, bool)
    free[::32] = False  # the block maxima stay on the grid (they fix the scale)
    err = np.where(free, 0.45 * d * np.sign(x), 0.0)  # |err| < d/2: rounds back to the grid
    aligned = float(err @ x.astype(np.float64))  # each row's error along x
    # u: the grid row plus 2-unit steps where x > 0, worth ~90% of both rows' errors, minus its error
    steps = np.zeros(h)
    for k in np.flatnonzero(free & (x > 0)):
        if (steps @ x + 2 * x[k]) * d > 1.8 * aligned:
            break
        steps[k] = 2
    rows = np.zeros((64, h))
    rows[0] = (grid + steps) * d - err  # u
    rows[1] = grid * d + err  # t
    rows[2:] = -np.abs(rows[1]) * rng.uniform(0.5, 1, (62, 1))  # far below
    op = ScreenedArgmax(be, rows.astype(np.float32), 1, "f32", repack)
    try:
        ids, scores, _ = op(x[None, :])
        exact = op.values @ x.astype(np.float64)
        assert exact[1] > exact[0] and scores[0, 0] > scores[0, 1], "the case is not adversarial"
        margin = (exact[1] - exact[0]) / (2 * aligned)
        assert 0.02 < margin < 0.2, margin
        assert ids[0] == 1
    finally:
        op.close()


@pytest.mark.parametrize("case", ["most rows tied", "past q8_0's range", "wide hidden"])
def test_scratch_past_the_stack_buffers(be, rng, case):
    """The op keeps a column's candidates (2048) and x (4096 values) on its stack; more go to the
    heap: thousands of rows within the bound (near-identical rows), every row a candidate (x past
    q8_0's range) with V > 2048, a hidden size over 4096."""
    v, h = (64, 4128) if case == "wide hidden" else (3008, 64)
    base = rng.standard_normal(h).astype(np.float32)
    rows = np.tile(base, (v, 1)) if case == "most rows tied" else rng.standard_normal((v, h), dtype=np.float32)
    x = np.abs(rng.standard_normal((2, h), dtype=np.float32))
    if case == "most rows tied":
        rows[2900, :] += 1e-3 * np.sign(base)  # one row a little above its identical twins ...
        rows[2950, :] = rows[2900]  # ... and its twin, later: the first one wins
        x = np.tile(np.sign(base) * np.abs(x[:1]), (2, 1)).astype(np.float32)
    elif case == "past q8_0's range":
        x[:, 5] = 3e7
    op = ScreenedArgmax(be, rows, 2, "f32")
    try:
        ids, _, _ = op(x)
        np.testing.assert_array_equal(ids, op.exact_argmax(x))
        if case == "most rows tied":
            np.testing.assert_array_equal(ids, 2900)
    finally:
        op.close()
