"""Fuzz groups of the ggml layer (the binding's API and its ops). Imported only in the child
interpreter tests.fuzzing runs each group in; the contract is in tests/fuzzing.py."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pyggml_dkv.ggml import Backend, Buffer, Context, Gallocr, Graph
from tests.fuzzing import ALLOWED, FuzzRun

backend = Backend("cpu", n_threads=1)


def teardown() -> None:
    backend.close()


def ggml_api(fz: FuzzRun) -> None:
    types = st.sampled_from(["f32", "f16", "bf16", "i32", "q8_0"])
    arrays = st.tuples(
        st.sampled_from(["same", "other shape", "transposed", "fortran", "strided", "readonly", "0-d", "list"]),
        st.sampled_from(
            [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64, object]
        ),
        st.sampled_from(["normal", "nan", "big"]),
    )
    dims = st.lists(st.sampled_from([1, 2, 3, 4, 8, 32]), min_size=1, max_size=3)

    @fz.fuzz
    @given(ty=types, ne=dims, arr=arrays)
    def run(ty, ne, arr):
        with Context(n_tensors=4) as ctx:
            if ne[0] % 32 and ty == "q8_0":
                fz.expect_error(lambda: ctx.new_tensor(ty, *ne), ("block",), f"new_tensor {ty}{ne}")
                ne = [32] + ne[1:]
            for bad_ne in ([0], [-1, 2], [2] * 5, [1.5], [True], []):
                fz.expect_error(lambda: ctx.new_tensor("f32", *bad_ne), ("dims",), f"new_tensor {bad_ne}")
            for bad_ty in ("f7", None, 99, 1.0):
                fz.expect_error(lambda: ctx.new_tensor(bad_ty, 4), ("type",), f"new_tensor type {bad_ty!r}")
            t = ctx.new_tensor(ty, *ne, name="t")
            fz.expect_error(lambda: t.set(np.zeros(t.shape, np.float32)), ("no data", "allocate"), "set before alloc")
            with Buffer.alloc_ctx_tensors(ctx, backend):
                how, dt, vals = arr
                shape = t.shape
                base = np.random.default_rng(0).standard_normal(shape[::-1] if how == "transposed" else shape) * 3
                if vals == "nan" and base.size:
                    base.flat[0] = np.nan
                if vals == "big":
                    base = base * 1e12
                a = base.T if how == "transposed" else np.asfortranarray(base) if how == "fortran" else base
                if how == "strided":
                    a = np.repeat(base, 2, axis=-1)[..., ::2]
                if how == "other shape":
                    a = np.zeros(shape + (2,))
                if how == "0-d":
                    a = np.float64(1.0)
                with np.errstate(all="ignore"):
                    a = np.asarray(a).astype(dt)
                if how == "readonly":
                    a.flags.writeable = False
                if how == "list":
                    a = a.tolist()
                na = np.asarray(a)
                kind = na.dtype.kind
                desc = f"set {ty}{shape} <- {how} {np.dtype(dt)} {vals}"
                if na.shape != shape:
                    fz.expect_error(lambda: t.set(a), ("shape",), desc)
                elif (ty == "i32" and kind not in "iu") or (ty != "i32" and kind != "f"):
                    fz.expect_error(lambda: t.set(a), ("expected", "dtype", "array"), desc)
                elif ty == "i32" and na.size and (na.min() < -(2**31) or na.max() >= 2**31):
                    fz.expect_error(lambda: t.set(a), ("range",), desc)
                else:
                    fz.case(desc)
                    t.set(a)
                    back = t.numpy()
                    assert back.shape == shape
                    if ty == "i32" or (ty == "f32" and vals != "nan"):
                        assert np.array_equal(back, na.astype(back.dtype)), desc
                fz.expect_error(
                    lambda: t.set_bytes(np.zeros(t.nbytes + 1, np.uint8)), ("exceeds",), "set_bytes overflow"
                )
                fz.expect_error(
                    lambda: t.set_bytes(np.zeros(4, np.uint8), -1), ("offset", "exceeds"), "set_bytes offset"
                )
            fz.expect_error(
                lambda: t.set(np.zeros(t.shape, np.float32)), ("closed", "no data"), "set after buffer closed"
            )
        fz.expect_error(lambda: t.numpy(), ("closed",), "numpy after context closed")

    run()


def ggml_ops(fz: FuzzRun) -> None:
    """Each op with shapes that are valid, then maybe one thing broken: refused, or computed without an abort."""
    OPS = [
        "add",
        "mul",
        "mul_mat",
        "rms_norm",
        "scale",
        "silu",
        "get_rows",
        "set_rows",
        "concat",
        "cpy",
        "cast",
        "soft_max_ext",
        "rope_ext",
        "flash_attn_ext",
        "argmax",
        "view",
        "reshape",
        "permute",
    ]
    dim = st.sampled_from([1, 2, 3, 4, 8, 32, 64])
    mutation = st.one_of(
        st.none(),
        st.none(),
        st.tuples(st.just("type"), st.integers(0, 3), st.sampled_from(["f32", "f16", "bf16", "i32", "q8_0", "i64"])),
        st.tuples(st.just("dim"), st.integers(0, 3), st.integers(0, 3), st.sampled_from([-1, 1, 2])),
        st.tuples(st.just("transpose"), st.integers(0, 3)),
    )

    def specs(op, n0, n1, n2, k, extra):
        """[(type, ne)] inputs for `op` that are valid as drawn."""
        q8 = "q8_0" if n0 % 32 == 0 else "f16"
        return {
            "add": [
                ("f32", (n0, n1, n2)),
                (["f32", "f16"][extra % 2] if False else "f32", (n0, 1 if extra % 2 else n1, 1)),
            ],
            "mul": [("f32", (n0, n1, n2)), ("f32", (n0, 1, 1))],
            "mul_mat": [(["f32", "f16", "bf16", q8][extra % 4], (n0, n1, 1)), ("f32", (n0, k, n2))],
            "rms_norm": [("f32", (n0, n1, n2))],
            "scale": [("f32", (n0, n1))],
            "silu": [(["f32", "f16"][extra % 2], (n0, n1))],
            "get_rows": [(["f32", "f16", q8, "i32"][extra % 4], (n0, n1)), ("i32", (k,))],
            "set_rows": [
                (["f32", "f16"][extra % 2], (n0, n1)),
                ("f32", (n0, min(k, n1))),
                (["i32", "i64"][extra % 2], (min(k, n1),)),
            ],
            "concat": [
                ("f32", (n0, n1, n2)),
                ("f32", (n0, n1, n2) if extra % 3 == 2 else ((n0, k, n2) if extra % 3 else (k, n1, n2))),
            ],
            "cpy": [
                (["f32", "f16", "bf16"][extra % 3], (n0, n1)),
                (["f32", "f16", "bf16", q8][(extra // 3) % 4], (n0, n1)),
            ],
            "cast": [(["f32", "f16", "bf16", "i32"][extra % 4], (n0, n1))],
            "soft_max_ext": [("f32", (n0, n1, n2)), (["f16", "f32"][extra % 2], (n0, n1 + extra % 3))],
            "rope_ext": [(["f32", "f16"][extra % 2], (2 * n0, n1, k)), ("i32", (k,))],
            "flash_attn_ext": [
                ("f32", (n0, k, 2 * n2)),
                (["f16", "f32", "bf16"][extra % 3], (n0, n1, n2)),
                (["f16", "f32"][extra % 2], (n0, n1, n2)),
                ("f16", (n1, k + extra % 4)),
            ],
            "argmax": [("f32", (n0, n1))],
            "view": [(["f32", "f16", q8, "i32"][extra % 4], (n0, n1))],
            "reshape": [(["f32", "f16", q8, "i32"][extra % 4], (n0, n1, n2))],
            "permute": [(["f32", "f16", q8, "i32"][extra % 4], (n0, n1, n2))],
        }[op]

    def apply(g, op, ts, n0, n1, n2, k, extra):
        a = ts[0]
        b = ts[1] if len(ts) > 1 else None
        c = ts[2] if len(ts) > 2 else None
        return {
            "add": lambda: g.add(a, b),
            "mul": lambda: g.mul(a, b),
            "mul_mat": lambda: g.mul_mat(a, b),
            "rms_norm": lambda: g.rms_norm(a, [1e-6, 0.0, -1.0, float("nan")][extra % 4]),
            "scale": lambda: g.scale(a, [0.5, float("inf")][extra % 2]),
            "silu": lambda: g.silu(a),
            "get_rows": lambda: g.get_rows(a, b),
            "set_rows": lambda: g.set_rows(a, b, c),
            "concat": lambda: g.concat(
                a, b, [0, 1, 2, 4][extra % 4] if extra % 5 else (1 if b.ne[1] != a.ne[1] else 0)
            ),
            "cpy": lambda: g.cpy(a, b),
            "cast": lambda: g.cast(a, ["f32", "f16", "q8_0", "i32", "bf16"][extra % 5]),
            "soft_max_ext": lambda: g.soft_max_ext(a, b if extra % 4 else None, 0.5, 1.0 if extra % 5 == 0 else 0.0),
            "rope_ext": lambda: g.rope_ext(
                a,
                b,
                [a.ne[0], 2, a.ne[0] + 2, 3][extra % 4],
                [2, 0, 1][extra % 3],
                0,
                10000.0,
                1.0,
                0.0 if extra % 2 else 1.0,
            ),
            "flash_attn_ext": lambda: g.flash_attn_ext(
                a, b, c, ts[3] if extra % 3 else None, 0.125, 0.0 if extra % 7 else 1.0, 0.0 if extra % 2 else 30.0
            ),
            "argmax": lambda: g.argmax(a),
            "view": lambda: g.cont(g.view(a, ((extra % n0) + 1, n1), (), 4 * (extra % 3))),
            "reshape": lambda: g.reshape(
                a, *((n1, n0, n2) if extra % 3 == 0 else (n0 * n1, n2) if extra % 3 == 1 else (n0, n1 + 1))
            ),
            "permute": lambda: g.cont(
                g.permute(a, *[(1, 0, 2, 3), (2, 0, 1, 3), (0, 2, 1, 3), (0, 1, 2, 2)][extra % 4])
            ),
        }[op]()

    @fz.fuzz
    @given(
        op=st.sampled_from(OPS),
        n=st.tuples(dim, dim, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 5])),
        extra=st.integers(0, 59),
        mut=mutation,
    )
    def run(op, n, extra, mut):
        n0, n1, n2, k = n
        spec = [list(x) for x in specs(op, n0, n1, n2, k, extra)]
        transpose = None
        if mut is not None and mut[1] < len(spec):
            i = mut[1]
            if mut[0] == "type":
                spec[i][0] = mut[2]
            elif mut[0] == "dim":
                ne = list(spec[i][1])
                d = mut[2] % len(ne)
                ne[d] = max(1, ne[d] + mut[3]) if mut[3] != 2 else ne[d] * 2
                spec[i][1] = tuple(ne)
            else:
                transpose = i
        desc = f"op {op} {spec} extra={extra} mut={mut}"
        with Context(n_tensors=8) as ictx, Context(n_tensors=64, graph_size=64) as g:
            try:
                ts = [ictx.new_tensor(ty, *ne, name=f"in{i}") for i, (ty, ne) in enumerate(spec)]
            except ALLOWED:  # e.g. a q8_0 tensor whose rows are not whole blocks: refused at creation
                fz.expect_error(lambda: [ictx.new_tensor(ty, *ne) for ty, ne in spec], ("block", "type"), desc)
                return
            used = list(ts)
            fz.case(desc)
            try:
                if transpose is not None and ts[transpose].ne[1] > 1:
                    used[transpose] = g.permute(ts[transpose], 1, 0, 2, 3)
                out = apply(g, op, used, n0, n1, n2, k, extra)
            except ALLOWED as exc:
                fz.stats["errors"] += 1
                # ops name themselves ("mul_mat: cannot multiply ..."); tensor creation names the dims / type
                assert re.match(r"^[a-z_0-9]+: \S", str(exc)) or "type" in str(exc) or "dims" in str(exc), (
                    f"{desc}: {exc}"
                )
                return
            with Buffer.alloc_ctx_tensors(ictx, backend):
                for t in ts:
                    if t.type in ("i32", "i64"):
                        rows = (
                            int(used[0].ne[1]) if op in ("get_rows", "set_rows") else 1
                        )  # in range: data asserts are not checked
                        idx = np.arange(t.nelements) % max(rows, 1) if op != "rope_ext" else np.arange(t.nelements) * 7
                        t.set(idx.reshape(t.shape))
                    else:
                        t.set(np.random.default_rng(1).standard_normal(t.shape).astype(np.float32))
                graph = Graph(g, 64)
                graph.expand(out)
                with Gallocr(backend) as ga:
                    ga.alloc_graph(graph)
                    fz.log.write(f"  computing -> {out.type}{out.ne}\n")
                    fz.log.flush()
                    graph.compute(backend)
                    if out.is_contiguous:
                        out.numpy()
        fz.stats["computed"] = fz.stats.get("computed", 0) + 1

    run()
    print(f"ggml_ops: {fz.stats.get('computed', 0)} graphs computed", flush=True)
