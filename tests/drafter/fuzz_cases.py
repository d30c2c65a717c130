"""Fuzz groups of the drafter layer (the cache, the one-shot graph, the Drafter, the C-style
API, the feature ring, configs and weights as the drafter takes them). Imported only in the
child interpreter tests.fuzzing runs each group in; the contract is in tests/fuzzing.py."""

from __future__ import annotations

import gc

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import pyggml_dkv.drafter.args as dkv
from pyggml_dkv import (
    Backend,
    BackendWeights,
    DraftConfig,
    Drafter,
    DraftKvCache,
    DraftKvState,
    DraftWeights,
    FeatureRing,
    OneShotDrafter,
    draft_kv_begin_step,
    draft_kv_init,
)
from pyggml_dkv import reference as R
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml import Buffer, Context, Gallocr, Graph
from pyggml_dkv.model.config import ConfigError
from pyggml_dkv.model.tensor_names import expected_shapes
from tests.fuzzing import FuzzRun, objects, poke, short, strategies, variant

CFG = DraftConfig(
    hidden=64,
    n_layer=2,
    n_head=2,
    n_head_kv=1,
    head_dim=32,
    ffn=96,
    block_size=4,
    n_target_layers=2,
    layer_types=["full", "sliding"],
    swa_window=6,
)
CAP = 19
Q, H, FC = CFG.block_size, CFG.hidden, CFG.fc_in
rng0 = np.random.default_rng(0)
W = DraftWeights.random(CFG, seed=1)
FEATS = rng0.standard_normal((60, FC)).astype(np.float32)
NOISE = rng0.standard_normal((Q, H)).astype(np.float32)
backend = Backend("cpu", n_threads=1)
bw = W.to_backend(backend, "f32")


def full_ring() -> FeatureRing:
    ring = FeatureRing(64, FC)
    ring.append(FEATS)
    return ring


RING = full_ring()
COMMITS = [1, 5, 19, 23, 41, 60]
EXPECTED = {}
for c in COMMITS:  # what a fresh cache answers (and the reference agrees)
    with DraftKvCache(bw, backend, CAP, cache_type="f32") as fresh:
        EXPECTED[c] = fresh.step(RING, c, NOISE)
    assert relative_error(EXPECTED[c], R.reference_step(W, FEATS, c, CAP, NOISE)) < 1e-4


def still_works(cache, c) -> None:
    out = cache.step(RING, c, NOISE)
    err = relative_error(out, EXPECTED[c])
    assert err < 1e-5, f"after the failed call the cache answers differently from a fresh one ({err:.2e})"


bad_dtypes, small_shapes, not_ints = strategies()


def teardown() -> None:
    bw.close()
    backend.close()


def step_inputs(fz: FuzzRun) -> None:
    small_ring = FeatureRing(8, FC)  # positions 22..29 kept: every window needs overwritten ones
    small_ring.append(FEATS[:30])
    wrong_ring = FeatureRing(64, FC + 2)
    wrong_ring.append(np.zeros((10, FC + 2), np.float32))
    short_ring = FeatureRing(64, FC)
    short_ring.append(FEATS[:7])
    cache = DraftKvCache(bw, backend, CAP, cache_type="f32")

    noise_bad = st.one_of(
        small_shapes.filter(lambda s: s != (Q, H)).map(
            lambda s: ("shape", np.zeros(s, np.float32), ("noise_embed", "shape"))
        ),
        st.tuples(st.integers(0, Q), st.integers(0, 3))
        .filter(lambda t: t != (Q, 1))
        .map(  # (Q, 1): (Q, H), valid
            lambda t: ("shape+-", np.zeros((t[0], H + t[1] - 1), np.float32), ("noise_embed", "shape"))
        ),
        bad_dtypes.map(lambda d: (f"dtype {d}", np.zeros((Q, H), d), ("noise_embed", "float", "dtype"))),
        st.tuples(st.integers(0, Q - 1), st.integers(0, H - 1), st.sampled_from([np.nan, np.inf, -np.inf])).map(
            lambda t: ("nonfinite", poke(NOISE, t[0], t[1], t[2]), ("nan", "inf"))
        ),
        st.sampled_from([None, "noise", {}, 3.0]).map(
            lambda v: (f"object {v!r}", v, ("noise_embed", "shape", "float"))
        ),
    )
    noise_ok = st.sampled_from(["f16", "f64", "fortran", "strided", "readonly", "list"]).map(
        lambda k: (k, variant(NOISE, k))
    )
    commit_bad = st.one_of(
        st.integers(max_value=0).map(lambda c: (c, ("committed",))),
        st.sampled_from([-(2**63), -(2**70)]).map(lambda c: (c, ("committed",))),
        st.integers(61, 2**80).map(lambda c: (c, ("committed", "ring"))),
        not_ints.map(lambda c: (c, ("committed",))),
    )
    commit_ok = st.sampled_from(COMMITS).flatmap(
        lambda c: st.sampled_from([c, np.int64(c), np.uint32(c), np.int16(c)]).map(lambda v: (c, v))
    )
    ring_bad = st.one_of(
        st.integers(1, 30).map(lambda c: (small_ring, c, ("overwritten",))),
        st.integers(1, 10).map(lambda c: (wrong_ring, c, ("fc_in",))),
        st.integers(8, 60).map(lambda c: (short_ring, c, ("committed", "ring"))),
        st.sampled_from([None, np.zeros((60, FC), np.float32), "ring"]).map(lambda r: (r, 5, ("ring",))),
    )
    kinds = st.sampled_from(["noise_bad", "noise_ok", "commit_bad", "commit_ok", "ring_bad", "reset"])

    @fz.fuzz
    @given(kind=kinds, data=st.data(), follow=st.sampled_from(COMMITS))
    def run(kind, data, follow):
        if kind == "noise_bad":
            desc, noise, words = data.draw(noise_bad)
            fz.expect_error(lambda: cache.step(RING, 23, noise), words, f"step noise {desc}")
        elif kind == "noise_ok":
            desc, noise = data.draw(noise_ok)
            fz.case(f"step noise variant {desc}")
            got = cache.step(RING, 23, noise)
            want = cache.step(RING, 23, np.asarray(noise, dtype=np.float32))
            assert np.array_equal(got, want), desc
        elif kind == "commit_bad":
            c, words = data.draw(commit_bad)
            fz.expect_error(lambda: cache.step(RING, c, NOISE), words, f"step committed={c!r}")
        elif kind == "commit_ok":
            c, v = data.draw(commit_ok)
            fz.case(f"step committed={v!r} ({type(v).__name__})")
            assert relative_error(cache.step(RING, v, NOISE), EXPECTED[c]) < 1e-5
        elif kind == "ring_bad":
            ring, c, words = data.draw(ring_bad)
            fz.expect_error(lambda: cache.step(ring, c, NOISE), words, f"step ring={type(ring).__name__} committed={c}")
        else:
            fz.case("reset")
            cache.reset()
        still_works(cache, follow)

    run()
    cache.close()


def construct(fz: FuzzRun) -> None:
    base = objects()
    lm = (rng0.standard_normal((40, H)) / 8).astype(np.float32)
    closed_backend = Backend("cpu", n_threads=1)
    closed_backend.close()
    closed_weights = W.to_backend(backend, "f32")
    closed_weights.close()
    t_ctx = Context(n_tensors=2)
    wrong_tensor = t_ctx.new_tensor("f32", H + 32, 40, name="wrong_head")
    t_buf = Buffer.alloc_ctx_tensors(t_ctx, backend)
    base = objects()

    def matrix_bad(name):
        return st.one_of(
            st.tuples(st.integers(1, 50), st.integers(1, 2 * H))
            .filter(lambda s: s[1] != H)
            .map(lambda s: (np.zeros(s, np.float32), (name, "hidden", "shape"))),
            st.integers(1, 50).map(lambda n: (np.zeros(n, np.float32), (name, "shape", "array"))),
            st.just((np.zeros((2, 3, H), np.float32), (name, "shape", "array"))),
            bad_dtypes.filter(lambda d: d is not np.bool_).map(
                lambda d: (np.zeros((40, H), d), (name, "float", "dtype"))
            ),
            st.sampled_from([np.nan, np.inf]).map(lambda v: (poke(lm, 3, 5, v), (name, "nan", "inf"))),
            st.just((wrong_tensor, (name, "hidden"))),
        )

    bad = st.one_of(
        st.one_of(st.integers(max_value=0), st.integers(dkv.MAX_CAP + 1, 2**70), not_ints).map(
            lambda v: ("cap", dict(cap=v), ("cap",))
        ),
        st.text(max_size=4)
        .filter(lambda s: s not in dkv.CACHE_TYPES)
        .map(lambda v: ("cache_type", dict(cache_type=v), ("cache_type",))),
        st.sampled_from(["q8_0", "bf16", "F16", None, 1]).map(
            lambda v: ("cache_type", dict(cache_type=v), ("cache_type",))
        ),
        st.one_of(st.text(max_size=4), st.sampled_from(["SEED", None, True]))
        .filter(lambda s: s not in dkv.SWA_MODES)
        .map(lambda v: ("swa", dict(swa=v), ("swa",))),
        matrix_bad("lm_head").map(lambda t: ("lm_head", dict(lm_head=t[0]), t[1])),
        matrix_bad("embed_tokens").map(lambda t: ("embed_tokens", dict(embed_tokens=t[0]), t[1])),
        st.sampled_from([W, None, "weights", closed_weights]).map(
            lambda v: ("weights", dict(weights=v), ("backendweights", "closed"))
        ),
        st.sampled_from([None, "cpu", bw, closed_backend]).map(
            lambda v: ("backend", dict(backend=v), ("backend", "closed"))
        ),
        st.one_of(
            st.text(max_size=4).filter(lambda v: v != "q8_0"), st.sampled_from(["Q8_0", "q4_0", "f16", 1, True])
        ).map(lambda v: ("lm_head_screen", dict(lm_head=lm, lm_head_screen=v), ("lm_head_screen",))),
        st.just(("lm_head_screen", dict(lm_head_screen="q8_0"), ("lm_head_screen", "lm_head"))),
        st.just(("lm_head_screen", dict(lm_head=lm, lm_head_dtype="q8_0", lm_head_screen="q8_0"), ("screen", "q8_0"))),
    )
    good = st.fixed_dictionaries(
        {
            "cap": st.integers(1, 70),
            "cache_type": st.sampled_from(dkv.CACHE_TYPES),
            "swa": st.sampled_from(dkv.SWA_MODES),
            "lm": st.booleans(),
            "committed": st.integers(1, 60),
            "oneshot": st.booleans(),
            "screen": st.booleans(),
        }
    )

    @fz.fuzz
    @given(data=st.data(), valid=st.integers(0, 3))
    def run(data, valid):
        if valid == 0:
            g = data.draw(good)
            fz.case(f"construct valid {g}")
            kw = dict(cap=g["cap"], cache_type=g["cache_type"], swa=g["swa"], lm_head=lm if g["lm"] else None)
            cls = OneShotDrafter if g["oneshot"] else DraftKvCache
            screen = g["screen"] and g["lm"] and not g["oneshot"]
            if screen:
                kw["lm_head_screen"] = "q8_0"
            with cls(bw, backend, **kw) as c:
                got = c.step(RING, g["committed"], NOISE)
                if screen:  # the screened graph: ids of the exact (f32) head for the step's hidden states
                    c.begin_step(RING, g["committed"])
                    c.inp_embed.set(NOISE)
                    c.compute()
                    hidden = c.hidden_states.numpy().astype(np.float64)
                    assert (c.draft_ids.numpy() == np.argmax(hidden @ lm.astype(np.float64).T, axis=1)).all(), g
            want = R.reference_step(
                W, FEATS, g["committed"], g["cap"], NOISE, swa=g["swa"], lm_head=lm if g["lm"] else None
            )
            assert relative_error(got, want) < (1e-4 if g["cache_type"] == "f32" else 5e-3), g
        else:
            what, kw, words = data.draw(bad)
            args = dict(weights=bw, backend=backend, cap=CAP)
            args.update(kw)
            cls = (
                data.draw(st.sampled_from([DraftKvCache, OneShotDrafter]))
                if what not in ("embed_tokens", "lm_head_screen")
                else DraftKvCache
            )
            if cls is OneShotDrafter and what == "lm_head" and kw["lm_head"] is wrong_tensor:
                cls = DraftKvCache  # the one-shot graph takes a Tensor head as given
            fz.expect_error(lambda: cls(**args), words, f"{cls.__name__}({what}={short(kw)})")
        assert objects() == base, f"a constructor leaked ggml objects: {objects()} vs {base}"

    run()
    t_buf.close()
    t_ctx.close()


def weights_config(fz: FuzzRun) -> None:
    names = list(expected_shapes(CFG))
    host = {k: np.array(v) for k, v in W.items()}
    fields = [
        "hidden",
        "n_layer",
        "n_head",
        "n_head_kv",
        "head_dim",
        "ffn",
        "block_size",
        "n_target_layers",
        "rms_eps",
        "rope_theta",
        "freq_scale",
        "ext_factor",
        "attn_factor",
        "swa_window",
        "n_ctx_orig",
        "mask_token_id",
        "vocab",
        "layer_types",
        "final_logit_softcapping",
        "target_layer_ids",
        "input_embedding_scale",
        "output_multiplier",
    ]
    values = st.one_of(
        st.integers(-3, 70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.none(),
        st.text(max_size=3),
        st.lists(st.sampled_from(["full", "sliding", "swa", 1]), max_size=3),
    )
    mutation = st.one_of(
        st.sampled_from(names).map(lambda n: ("missing", n)),
        st.text(min_size=1, max_size=12).filter(lambda n: n not in host).map(lambda n: ("extra", n)),
        st.tuples(st.sampled_from(names), st.integers(-1, 1)).map(lambda t: ("shape", t)),
        st.tuples(st.sampled_from(names), bad_dtypes.filter(lambda d: d is not object)).map(lambda t: ("dtype", t)),
        st.tuples(st.sampled_from(names), st.sampled_from([np.nan, np.inf, -np.inf])).map(lambda t: ("nonfinite", t)),
        st.sampled_from(["f32", "f16", "bf16", "q8_0", "q4_0", "int8", "", None]).map(lambda d: ("upload_dtype", d)),
        st.sampled_from([None, {}, host, "w"]).map(lambda o: ("not_weights", o)),
    )

    @fz.fuzz
    @given(
        which=st.sampled_from(["weights", "config"]),
        mut=mutation,
        changes=st.dictionaries(st.sampled_from(fields), values, min_size=1, max_size=3),
    )
    def run(which, mut, changes):
        if which == "config":
            kw = dict(hidden=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, ffn=96, block_size=4, n_target_layers=2)
            kw.update(changes)
            fz.case(f"DraftConfig({short(changes)})")
            try:
                cfg = DraftConfig(**kw)
            except ConfigError as exc:
                assert any(k in str(exc) for k in changes) or "swa" in str(exc) or "layer" in str(exc), (
                    f"ConfigError({exc}) does not name one of {list(changes)}"
                )
                fz.stats["errors"] += 1
                return
            except BaseException as exc:
                raise AssertionError(
                    f"DraftConfig({changes}) raised {type(exc).__name__}({exc}), not ConfigError"
                ) from exc
            cfg.validate()  # a config that validated stays valid
            return
        kind, arg = mut
        tensors = dict(host)
        if kind == "missing":
            del tensors[arg]
            fz.expect_error(lambda: DraftWeights(CFG, tensors), (arg, "missing"), f"weights without {arg}")
        elif kind == "extra":
            tensors[arg] = np.zeros(3, np.float32)
            fz.expect_error(lambda: DraftWeights(CFG, tensors), ("cannot run", "unexpected", arg), f"weights + {arg!r}")
        elif kind == "shape":
            name, d = arg
            a = tensors[name]
            tensors[name] = (
                np.zeros(a.shape[:-1] + (a.shape[-1] + (d or 1),), np.float32)
                if d >= 0
                else a.T.copy()
                if a.ndim == 2 and a.shape[0] != a.shape[1]
                else a[..., :-1]
            )
            fz.expect_error(lambda: DraftWeights(CFG, tensors), (name, "shape"), f"{name} reshaped")
        elif kind == "dtype":
            name, dt = arg
            tensors[name] = tensors[name].astype(dt)
            fz.expect_error(lambda: DraftWeights(CFG, tensors), (name, "float", "dtype"), f"{name} as {dt}")
        elif kind == "nonfinite":
            name, v = arg
            a = tensors[name].copy()
            a.flat[a.size // 2] = v
            tensors[name] = a
            fz.expect_error(lambda: DraftWeights(CFG, tensors), (name, "nan", "inf"), f"{name} with {v}")
        elif kind == "upload_dtype":
            base = objects()
            if arg in ("f32", "f16", "bf16"):
                fz.case(f"upload as {arg}")
                with W.to_backend(backend, arg) as b2:
                    assert b2.dtype == arg
            elif arg == "q8_0":  # every matrix of this config has rows of 32k values
                fz.case("upload as q8_0")
                W.to_backend(backend, arg).close()
            else:
                fz.expect_error(lambda: W.to_backend(backend, arg), ("dtype",), f"upload as {arg!r}")
            assert objects() == base
        else:
            fz.expect_error(
                lambda: BackendWeights(arg, backend), ("draftweights",), f"BackendWeights({type(arg).__name__})"
            )

    run()
    # q8_0 refuses matrices whose rows are not whole blocks, naming them
    odd = DraftConfig(hidden=48, n_layer=1, n_head=2, n_head_kv=1, head_dim=24, ffn=80, block_size=4, n_target_layers=2)
    fz.expect_error(
        lambda: DraftWeights.random(odd).to_backend(backend, "q8_0"), ("q8_0", "multiple", "block"), "odd q8_0"
    )
    # weights of another config: the C-style API refuses them, the cache refuses the other ring
    other_cfg = CFG.replace(hidden=32, head_dim=16, n_target_layers=3)
    with DraftWeights.random(other_cfg).to_backend(backend, "f32") as other:
        st_ = DraftKvState()
        draft_kv_init(st_, bw, backend, CAP, cache_type="f32")
        fz.expect_error(
            lambda: draft_kv_begin_step(st_, other, backend, RING, 5), ("weights",), "begin_step, other weights"
        )
        other_ring = FeatureRing(16, other_cfg.fc_in)
        other_ring.append(np.zeros((4, other_cfg.fc_in), np.float32))
        fz.expect_error(lambda: st_.cache.step(other_ring, 4, NOISE), ("fc_in",), "ring of another config")
        with DraftKvCache(other, backend, CAP) as oc:
            fz.expect_error(
                lambda: oc.step(RING, 5, np.zeros((Q, 32), np.float32)), ("fc_in",), "ring of another config 2"
            )
            fz.expect_error(lambda: oc.step(other_ring, 4, NOISE), ("noise_embed",), "noise of another config")
        st_.cache.close()
        still = DraftKvCache(bw, backend, CAP, cache_type="f32")
        still_works(still, 41)
        still.close()


def drafter(fz: FuzzRun) -> None:
    vocab = 40
    embed = (rng0.standard_normal((vocab, H)) / 8).astype(np.float32)
    lm = (rng0.standard_normal((vocab, H)) / 8).astype(np.float32)
    d = Drafter(bw, embed_tokens=embed, lm_head=lm, backend=backend, cap=CAP, cache_type="f32")
    d.add_features(FEATS[:30])
    want_ids = d.propose(7)
    empty = Drafter(bw, embed_tokens=embed, lm_head=lm, backend=backend, cap=CAP, cache_type="f32")
    base = objects()
    bad_tok = st.one_of(st.integers(max_value=-1), st.integers(vocab, 2**70), not_ints, st.just(np.int64(-1)))
    bad_temp = st.one_of(st.floats(max_value=-1e-9), st.sampled_from([np.nan, np.inf, -np.inf, "hot", None, 1j, [1.0]]))
    bad_top_p = st.one_of(
        st.floats(max_value=0.0),
        st.floats(min_value=1.0, exclude_min=True),
        st.sampled_from([np.nan, "x", None, [0.5]]),
    )
    bad_top_k = st.one_of(st.integers(max_value=-1), st.sampled_from([1.5, "k", None, np.nan, [3]]))
    cases = st.one_of(
        st.integers(0, vocab - 1).map(lambda t: ("propose-empty", lambda: empty.propose(t), ("features",))),
        bad_tok.map(lambda t: (f"last_token={t!r}", lambda: d.propose(t), ("last_token", "token"))),
        bad_temp.map(lambda v: (f"temperature={v!r}", lambda: d.propose(3, temperature=v), ("temperature",))),
        bad_top_p.map(lambda v: (f"top_p={v!r}", lambda: d.propose(3, temperature=1.0, top_p=v), ("top_p",))),
        bad_top_k.map(lambda v: (f"top_k={v!r}", lambda: d.propose(3, temperature=1.0, top_k=v), ("top_k",))),
        small_shapes.filter(lambda s: len(s) not in (1, 2) or s[-1] != FC).map(
            lambda s: (f"add_features{s}", lambda: d.add_features(np.zeros(s, np.float32)), ("feature", "shape"))
        ),
        bad_dtypes.map(
            lambda dt: (
                f"add_features {dt}",
                lambda: d.add_features(np.zeros((2, FC), dt)),
                ("feature", "float", "dtype"),
            )
        ),
        st.sampled_from([np.nan, np.inf]).map(
            lambda v: ("add_features nonfinite", lambda: d.add_features(poke(FEATS[:3], 1, 2, v)), ("nan", "inf"))
        ),
        st.one_of(st.integers(max_value=-1), st.integers(31, 2**40), not_ints).map(
            lambda v: (f"rewind({v!r})", lambda: d.rewind(v), ("rewind", "truncate", "pos"))
        ),
        st.one_of(
            small_shapes.filter(lambda s: s != (Q,)).map(lambda s: np.zeros(s, np.int32)),
            st.just(np.zeros(Q, np.float32)),
            st.just(np.full(Q, vocab, np.int32)),
            st.just(np.full(Q, -1, np.int64)),
        ).map(
            lambda ids: (
                f"step_tokens {ids.dtype}{ids.shape}",
                lambda: d.cache.step_tokens(d.ring, 30, ids),
                ("token",),
            )
        ),
        st.text(max_size=5)
        .filter(lambda s: s not in ("ids", "logits", "hidden"))
        .map(
            lambda o: (
                f"output={o!r}",
                lambda: d.cache.step_tokens(d.ring, 30, np.zeros(Q, np.int32), output=o),
                ("output",),
            )
        ),
        st.just(("step() on a token cache", lambda: d.cache.step(d.ring, 30, NOISE), ("step_tokens", "token"))),
    )
    ctor_bad = st.sampled_from(
        [
            ("weights=None", dict(weights=None), ("weights",)),
            ("embed hidden", dict(embed_tokens=np.zeros((vocab, H + 1), np.float32)), ("embed_tokens", "hidden")),
            ("lm 1-D", dict(lm_head=np.zeros(H, np.float32)), ("lm_head", "hidden")),
            ("vocab mismatch", dict(lm_head=np.zeros((vocab + 1, H), np.float32)), ("rows", "vocab", "embed_tokens")),
            ("mask id", dict(weights=DraftWeights.random(CFG.replace(mask_token_id=vocab + 3))), ("mask_token_id",)),
            ("cap", dict(cap=0), ("cap",)),
            ("ring_cap", dict(ring_cap=-3), ("cap",)),
            ("ring_dtype", dict(ring_dtype="f64"), ("dtype",)),
            ("cache_type", dict(cache_type="q4"), ("cache_type",)),
            ("weight_dtype", dict(weights=W, weight_dtype="f8"), ("dtype",)),
            ("swa", dict(swa="x"), ("swa",)),
            ("embed nan", dict(embed_tokens=poke(embed, 0, 0, np.nan)), ("embed_tokens", "nan")),
            ("own backend + bad cap", dict(backend=None, cap=-1), ("cap",)),
        ]
    )

    @fz.fuzz
    @given(c=cases, ctor=ctor_bad, ok=st.sampled_from(["greedy", "sample", "ctor"]))
    def run(c, ctor, ok):
        desc, fn, words = c
        fz.expect_error(fn, words, desc)
        assert d.committed == 30
        if ok == "greedy":
            fz.case("propose greedy")
            assert np.array_equal(d.propose(np.int32(7)), want_ids)
        elif ok == "sample":
            fz.case("propose sampling")
            ids, probs = d.propose(7, temperature=0.7, top_k=5, top_p=0.9, rng=np.random.default_rng(1))
            assert (
                ids.shape == (Q - 1,) and np.allclose(probs.sum(axis=1), 1) and (probs[np.arange(Q - 1), ids] > 0).all()
            )
        else:
            what, kw, words = ctor
            args = dict(weights=bw, embed_tokens=embed, lm_head=lm, backend=backend, cap=CAP, cache_type="f32")
            args.update(kw)
            fz.expect_error(lambda: Drafter(**args), words, f"Drafter({what})")
            assert objects() == base, f"Drafter({what}) leaked {objects()} vs {base}"
        assert np.array_equal(d.propose(7), want_ids)

    run()
    d.close()
    empty.close()


def lifecycle(fz: FuzzRun) -> None:
    ops = st.lists(
        st.sampled_from(
            [
                "close backend",
                "close weights",
                "close cache",
                "close oneshot",
                "close graph ctx",
                "close galloc",
                "close buffer",
                "step",
                "step oneshot",
                "reset",
                "begin_step",
                "compute",
                "graph compute",
                "tensor set",
                "tensor numpy",
                "new cache",
                "buffer set",
                "gc",
            ]
        ),
        min_size=1,
        max_size=8,
    )

    @fz.fuzz
    @given(seq=ops)
    def run(seq):
        be = Backend("cpu", n_threads=1)
        w = W.to_backend(be, "f32")
        cache = DraftKvCache(w, be, CAP, cache_type="f32")
        one = OneShotDrafter(w, be, CAP, cache_type="f32")
        ctx = Context(n_tensors=4)
        a = ctx.new_tensor("f32", 8, 2, name="a")
        buf = Buffer.alloc_ctx_tensors(ctx, be)
        a.set(np.ones((2, 8), np.float32))
        gctx = Context(n_tensors=16, graph_size=16)
        graph = Graph(gctx, 16)
        graph.expand(gctx.scale(a, 2.0))
        galloc = Gallocr(be)
        galloc.alloc_graph(graph)
        closed = set()
        objs = {
            "backend": be,
            "weights": w,
            "cache": cache,
            "oneshot": one,
            "graph ctx": gctx,
            "galloc": galloc,
            "buffer": buf,
        }
        fz.case(f"lifecycle {seq}")
        for op in seq:
            usable = not ({"backend", "weights", "cache"} & closed)
            if op.startswith("close "):
                what = op[6:]
                objs[what].close()
                objs[what].close()  # idempotent
                closed.add(what)
                continue
            if op == "gc":
                gc.collect()
                continue
            fn, ok, words = {
                "step": (lambda: cache.step(RING, 23, NOISE), usable, ("closed",)),
                "step oneshot": (
                    lambda: one.step(RING, 23, NOISE),
                    not ({"backend", "weights", "oneshot"} & closed),
                    ("closed",),
                ),
                "reset": (cache.reset, usable, ("closed",)),
                "begin_step": (lambda: cache.begin_step(RING, 41), usable, ("closed",)),
                "compute": (cache.compute, usable, ("closed",)),
                "graph compute": (lambda: cache.gf.compute(be), usable, ("closed",)),
                "tensor set": (lambda: cache.inp_embed.set(NOISE), "cache" not in closed, ("closed",)),
                "tensor numpy": (lambda: cache.hidden_states.numpy(), "cache" not in closed, ("closed",)),
                "new cache": (
                    lambda: DraftKvCache(w, be, CAP, cache_type="f32").close(),
                    not ({"backend", "weights"} & closed),
                    ("closed",),
                ),
                "buffer set": (
                    lambda: (graph.compute(be), a.set(np.ones((2, 8), np.float32))),
                    not ({"backend", "buffer", "graph ctx", "galloc"} & closed),
                    ("closed",),
                ),
            }[op]
            if ok:
                fz.case(f"  {op} (valid)")
                fn()
            else:
                fz.expect_error(fn, words, f"{op} after closing {sorted(closed)}")
        if not ({"backend", "weights", "cache"} & closed):
            cache.reset()
            out = cache.step(RING, 41, NOISE)
            assert relative_error(out, EXPECTED[41]) < 1e-5
        for obj in (cache, one, galloc, gctx, buf, ctx, w, be):
            obj.close()

    base = objects()
    run()
    assert objects() == base, f"lifecycle leaked {objects()} vs {base}"


def ring(fz: FuzzRun) -> None:
    op = st.one_of(
        st.tuples(st.just("append"), st.integers(0, 12)),
        st.tuples(st.just("write"), st.integers(-3, 40), st.integers(0, 6)),
        st.tuples(st.just("truncate"), st.integers(-3, 40)),
        st.tuples(st.just("read"), st.integers(-3, 40), st.integers(-1, 12)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("bad_rows"), st.integers(0, 4)),
        st.tuples(st.just("bad_pos"), not_ints),
    )

    @fz.fuzz
    @given(cap=st.integers(1, 9), dtype=st.sampled_from(["f32", "f16", "bf16"]), ops=st.lists(op, max_size=25))
    def run(cap, dtype, ops):
        r = FeatureRing(cap, 4, dtype)
        model: dict[int, np.ndarray] = {}
        written = oldest = 0
        src = np.random.default_rng(cap).standard_normal((200, 4)).astype(np.float32)
        if dtype != "f32":  # values the storage holds exactly
            src = np.round(src * 8) / 8
        nxt = 0
        for o in ops:
            if o[0] in ("append", "write"):
                pos = written if o[0] == "append" else o[1]
                n = o[1] if o[0] == "append" else o[2]
                rows = src[nxt : nxt + n]
                nxt = (nxt + n) % 150
                if pos < 0 or pos > written or pos < oldest:
                    fz.expect_error(
                        lambda: r.write(pos, rows),
                        ("position",),
                        f"write at {pos} (written {written}, oldest {oldest})",
                    )
                    continue
                fz.case(f"write {n} at {pos}")
                r.write(pos, rows)
                for i in range(n):
                    model[pos + i] = rows[i]
                if n:
                    written = pos + n
                    oldest = max(oldest, written - cap)
            elif o[0] == "truncate":
                if not oldest <= o[1] <= written:
                    fz.expect_error(lambda: r.truncate(o[1]), ("truncate",), f"truncate {o[1]}")
                    continue
                fz.case(f"truncate {o[1]}")
                r.truncate(o[1])
                written = o[1]
            elif o[0] == "read":
                start, n = o[1], o[2]
                if n < 0 or start < 0 or (n > 0 and (start < oldest or start + n > written)):
                    fz.expect_error(
                        lambda: r.read(start, n),
                        ("range", "overwritten", "never written", "position"),
                        f"read {start}+{n} of [{oldest}, {written})",
                    )
                    continue
                fz.case(f"read {start}+{n}")
                got = r.read(start, n)
                want = np.array([model[start + i] for i in range(n)], np.float32).reshape(n, 4)
                assert np.array_equal(got, want) if dtype == "f32" else np.allclose(got, want, atol=1e-2)
            elif o[0] == "clear":
                fz.case("clear")
                r.clear()
                written = oldest = 0
            elif o[0] == "bad_rows":
                bad = [
                    np.zeros((2, 5), np.float32),
                    np.zeros((2, 4), np.int32),
                    poke(np.zeros((2, 4), np.float32), 1, 1, np.nan),
                    np.zeros((2, 2, 4), np.float32),
                    "rows",
                ][o[1]]
                fz.expect_error(
                    lambda: r.append(bad), ("feature", "nan", "float", "shape"), f"append {type(bad).__name__}"
                )
            else:
                fz.expect_error(lambda: r.write(o[1], src[:1]), ("pos",), f"write at {o[1]!r}")
            assert (r.written, r.oldest, len(r)) == (written, oldest, written - oldest)

    run()
    for bad in (
        dict(cap=0, fc_in=4),
        dict(cap=3, fc_in=-1),
        dict(cap=True, fc_in=4),
        dict(cap=3, fc_in=4, dtype="i8"),
        dict(cap=3.0, fc_in=4),
        dict(cap=2**40, fc_in=2**20),
    ):
        fz.expect_error(lambda: FeatureRing(**bad), ("cap", "fc_in", "dtype", "large"), f"FeatureRing({bad})")
