"""API fuzzing (issue #6): every misuse ends in a Python exception that names the problem.

Each group of cases runs in its own child interpreter (this file, run as a script), so a
segfault or a ggml abort fails that group's test instead of killing the test run. The child
drives hypothesis directly, prints ``cases tried: N`` and exits 0; the parent asserts both. The
case being run is written to a log file first, so a crash names the case that caused it.

The contract checked for every case:

* a misuse raises ValueError, TypeError or RuntimeError (GGMLError is a RuntimeError), never
  anything else, and the message contains a word naming the problem;
* a valid call that looks unusual (non-contiguous, read-only, float16/float64, numpy ints,
  lists) succeeds and gives the same result as the plain call;
* after a failed call the object still works: a valid step gives the same result as a fresh cache;
* failed constructors leak nothing (`live_objects()` is unchanged).

Knobs: PYGGML_DKV_FUZZ_SCALE (multiplies the examples per group, default 1),
PYGGML_DKV_FUZZ_RANDOM=1 (random instead of derandomized hypothesis runs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# group -> examples at scale 1 (each example is one or more cases)
GROUPS = {
    "step_inputs": 150,
    "construct": 80,
    "weights_config": 150,
    "drafter": 120,
    "lifecycle": 60,
    "ring": 150,
    "ggml_api": 150,
    "ggml_ops": 400,
}


# ============================================================================ child side

def _child(group: str, log_path: str) -> int:  # noqa: C901 - one function per group below
    import gc

    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sys.path.insert(0, str(ROOT))
    import pyggml_dkv.drafter.cache as dkv
    from pyggml_dkv import (
        Backend, BackendWeights, DraftConfig, DraftKvCache, DraftKvState, DraftWeights, Drafter, FeatureRing,
        OneShotDrafter, draft_kv_begin_step, draft_kv_init, live_objects,
    )
    from pyggml_dkv import reference as R
    from pyggml_dkv.model.backend_weights import upload_matrix
    from pyggml_dkv.model.config import ConfigError
    from pyggml_dkv.ggml import Buffer, Context, Gallocr, GGMLError, Graph
    from pyggml_dkv.common.numeric import relative_error
    from pyggml_dkv.model.errors import WeightsError
    from pyggml_dkv.model.tensor_names import expected_shapes

    ALLOWED = (ValueError, TypeError, RuntimeError)
    scale = float(os.environ.get("PYGGML_DKV_FUZZ_SCALE", "1"))
    n_examples = max(1, int(GROUPS[group] * scale))
    log = open(log_path, "w")
    stats = {"cases": 0, "errors": 0}

    def fuzz(fn):  # the hypothesis settings every group uses
        return settings(max_examples=n_examples, deadline=None, database=None, print_blob=True,
                        derandomize=not os.environ.get("PYGGML_DKV_FUZZ_RANDOM"),
                        suppress_health_check=list(HealthCheck))(fn)

    def case(desc: str) -> None:
        stats["cases"] += 1
        log.write(desc[:300] + "\n")
        log.flush()

    def expect_error(fn, words, desc=""):
        """fn() must raise an allowed exception whose message contains one of `words`."""
        case(f"expect error {words}: {desc}")
        try:
            fn()
        except ALLOWED as exc:
            msg = str(exc).lower()
            if not any(w.lower() in msg for w in words):
                raise AssertionError(f"{desc}: {type(exc).__name__}({exc}) does not name the problem {words}") from exc
            stats["errors"] += 1
            return exc
        except BaseException as exc:
            raise AssertionError(f"{desc}: raised {type(exc).__name__}({exc}), not ValueError/TypeError/RuntimeError") from exc
        raise AssertionError(f"{desc}: no exception (expected one naming {words})")

    def objects() -> dict:
        gc.collect()
        return {k: v for k, v in live_objects().items() if v}

    CFG = DraftConfig(hidden=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, ffn=96, block_size=4,
                      n_target_layers=2, layer_types=["full", "sliding"], swa_window=6)
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

    bad_dtypes = st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64, object])
    small_shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
    not_ints = st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
                         st.just(np.float32(5.0)), st.just([5]), st.just(np.array([5])))

    # ------------------------------------------------------------------ groups
    def step_inputs() -> None:
        small_ring = FeatureRing(8, FC)  # positions 22..29 kept: every window needs overwritten ones
        small_ring.append(FEATS[:30])
        wrong_ring = FeatureRing(64, FC + 2)
        wrong_ring.append(np.zeros((10, FC + 2), np.float32))
        short_ring = FeatureRing(64, FC)
        short_ring.append(FEATS[:7])
        cache = DraftKvCache(bw, backend, CAP, cache_type="f32")

        noise_bad = st.one_of(
            small_shapes.filter(lambda s: s != (Q, H)).map(lambda s: ("shape", np.zeros(s, np.float32), ("noise_embed", "shape"))),
            st.tuples(st.integers(0, Q), st.integers(0, 3)).filter(lambda t: t != (Q, 0)).map(
                lambda t: ("shape+-", np.zeros((t[0], H + t[1] - 1), np.float32), ("noise_embed", "shape"))),
            bad_dtypes.map(lambda d: (f"dtype {d}", np.zeros((Q, H), d), ("noise_embed", "float", "dtype"))),
            st.tuples(st.integers(0, Q - 1), st.integers(0, H - 1), st.sampled_from([np.nan, np.inf, -np.inf])).map(
                lambda t: ("nonfinite", _poke(NOISE, t[0], t[1], t[2]), ("nan", "inf"))),
            st.sampled_from([None, "noise", {}, 3.0]).map(lambda v: (f"object {v!r}", v, ("noise_embed", "shape", "float"))),
        )
        noise_ok = st.sampled_from(["f16", "f64", "fortran", "strided", "readonly", "list"]).map(lambda k: (k, _variant(NOISE, k)))
        commit_bad = st.one_of(
            st.integers(max_value=0).map(lambda c: (c, ("committed",))),
            st.sampled_from([-(2**63), -(2**70)]).map(lambda c: (c, ("committed",))),
            st.integers(61, 2**80).map(lambda c: (c, ("committed", "ring"))),
            not_ints.map(lambda c: (c, ("committed",))),
        )
        commit_ok = st.sampled_from(COMMITS).flatmap(
            lambda c: st.sampled_from([c, np.int64(c), np.uint32(c), np.int16(c)]).map(lambda v: (c, v)))
        ring_bad = st.one_of(
            st.integers(1, 30).map(lambda c: (small_ring, c, ("overwritten",))),
            st.integers(1, 10).map(lambda c: (wrong_ring, c, ("fc_in",))),
            st.integers(8, 60).map(lambda c: (short_ring, c, ("committed", "ring"))),
            st.sampled_from([None, np.zeros((60, FC), np.float32), "ring"]).map(lambda r: (r, 5, ("ring",))),
        )
        kinds = st.sampled_from(["noise_bad", "noise_ok", "commit_bad", "commit_ok", "ring_bad", "reset"])

        @fuzz
        @given(kind=kinds, data=st.data(), follow=st.sampled_from(COMMITS))
        def run(kind, data, follow):
            if kind == "noise_bad":
                desc, noise, words = data.draw(noise_bad)
                expect_error(lambda: cache.step(RING, 23, noise), words, f"step noise {desc}")
            elif kind == "noise_ok":
                desc, noise = data.draw(noise_ok)
                case(f"step noise variant {desc}")
                got = cache.step(RING, 23, noise)
                want = cache.step(RING, 23, np.asarray(noise, dtype=np.float32))
                assert np.array_equal(got, want), desc
            elif kind == "commit_bad":
                c, words = data.draw(commit_bad)
                expect_error(lambda: cache.step(RING, c, NOISE), words, f"step committed={c!r}")
            elif kind == "commit_ok":
                c, v = data.draw(commit_ok)
                case(f"step committed={v!r} ({type(v).__name__})")
                assert relative_error(cache.step(RING, v, NOISE), EXPECTED[c]) < 1e-5
            elif kind == "ring_bad":
                ring, c, words = data.draw(ring_bad)
                expect_error(lambda: cache.step(ring, c, NOISE), words, f"step ring={type(ring).__name__} committed={c}")
            else:
                case("reset")
                cache.reset()
            still_works(cache, follow)

        run()
        cache.close()

    def construct() -> None:
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
                st.tuples(st.integers(1, 50), st.integers(1, 2 * H)).filter(lambda s: s[1] != H).map(
                    lambda s: (np.zeros(s, np.float32), (name, "hidden", "shape"))),
                st.integers(1, 50).map(lambda n: (np.zeros(n, np.float32), (name, "shape", "array"))),
                st.just((np.zeros((2, 3, H), np.float32), (name, "shape", "array"))),
                bad_dtypes.filter(lambda d: d is not np.bool_).map(lambda d: (np.zeros((40, H), d), (name, "float", "dtype"))),
                st.sampled_from([np.nan, np.inf]).map(lambda v: (_poke(lm, 3, 5, v), (name, "nan", "inf"))),
                st.just((wrong_tensor, (name, "hidden"))),
            )

        bad = st.one_of(
            st.one_of(st.integers(max_value=0), st.integers(dkv.MAX_CAP + 1, 2**70), not_ints).map(
                lambda v: ("cap", dict(cap=v), ("cap",))),
            st.text(max_size=4).filter(lambda s: s not in dkv.CACHE_TYPES).map(lambda v: ("cache_type", dict(cache_type=v), ("cache_type",))),
            st.sampled_from(["q8_0", "bf16", "F16", None, 1]).map(lambda v: ("cache_type", dict(cache_type=v), ("cache_type",))),
            st.one_of(st.text(max_size=4), st.sampled_from(["SEED", None, True])).filter(lambda s: s not in dkv.SWA_MODES).map(
                lambda v: ("swa", dict(swa=v), ("swa",))),
            matrix_bad("lm_head").map(lambda t: ("lm_head", dict(lm_head=t[0]), t[1])),
            matrix_bad("embed_tokens").map(lambda t: ("embed_tokens", dict(embed_tokens=t[0]), t[1])),
            st.sampled_from([W, None, "weights", closed_weights]).map(
                lambda v: ("weights", dict(weights=v), ("backendweights", "closed"))),
            st.sampled_from([None, "cpu", bw, closed_backend]).map(lambda v: ("backend", dict(backend=v), ("backend", "closed"))),
        )
        good = st.fixed_dictionaries({
            "cap": st.integers(1, 70), "cache_type": st.sampled_from(dkv.CACHE_TYPES), "swa": st.sampled_from(dkv.SWA_MODES),
            "lm": st.booleans(), "committed": st.integers(1, 60), "oneshot": st.booleans(),
        })

        @fuzz
        @given(data=st.data(), valid=st.integers(0, 3))
        def run(data, valid):
            if valid == 0:
                g = data.draw(good)
                case(f"construct valid {g}")
                kw = dict(cap=g["cap"], cache_type=g["cache_type"], swa=g["swa"], lm_head=lm if g["lm"] else None)
                cls = OneShotDrafter if g["oneshot"] else DraftKvCache
                with cls(bw, backend, **kw) as c:
                    got = c.step(RING, g["committed"], NOISE)
                want = R.reference_step(W, FEATS, g["committed"], g["cap"], NOISE, swa=g["swa"],
                                        lm_head=lm if g["lm"] else None)
                assert relative_error(got, want) < (1e-4 if g["cache_type"] == "f32" else 5e-3), g
            else:
                what, kw, words = data.draw(bad)
                args = dict(weights=bw, backend=backend, cap=CAP)
                args.update(kw)
                cls = data.draw(st.sampled_from([DraftKvCache, OneShotDrafter])) if what not in ("embed_tokens",) else DraftKvCache
                if cls is OneShotDrafter and what == "lm_head" and kw["lm_head"] is wrong_tensor:
                    cls = DraftKvCache  # the one-shot graph takes a Tensor head as given
                expect_error(lambda: cls(**args), words, f"{cls.__name__}({what}={_short(kw)})")
            assert objects() == base, f"a constructor leaked ggml objects: {objects()} vs {base}"

        run()
        t_buf.close()
        t_ctx.close()

    def weights_config() -> None:
        names = list(expected_shapes(CFG))
        host = {k: np.array(v) for k, v in W.items()}
        fields = ["hidden", "n_layer", "n_head", "n_head_kv", "head_dim", "ffn", "block_size", "n_target_layers",
                  "rms_eps", "rope_theta", "freq_scale", "ext_factor", "attn_factor", "swa_window", "n_ctx_orig",
                  "mask_token_id", "vocab", "layer_types", "final_logit_softcapping", "target_layer_ids",
                  "input_embedding_scale", "output_multiplier"]
        values = st.one_of(st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                           st.text(max_size=3), st.lists(st.sampled_from(["full", "sliding", "swa", 1]), max_size=3))
        mutation = st.one_of(
            st.sampled_from(names).map(lambda n: ("missing", n)),
            st.text(min_size=1, max_size=12).filter(lambda n: n not in host).map(lambda n: ("extra", n)),
            st.tuples(st.sampled_from(names), st.integers(-1, 1)).map(lambda t: ("shape", t)),
            st.tuples(st.sampled_from(names), bad_dtypes.filter(lambda d: d is not object)).map(lambda t: ("dtype", t)),
            st.tuples(st.sampled_from(names), st.sampled_from([np.nan, np.inf, -np.inf])).map(lambda t: ("nonfinite", t)),
            st.sampled_from(["f32", "f16", "bf16", "q8_0", "q4_0", "int8", "", None]).map(lambda d: ("upload_dtype", d)),
            st.sampled_from([None, {}, host, "w"]).map(lambda o: ("not_weights", o)),
        )

        @fuzz
        @given(which=st.sampled_from(["weights", "config"]), mut=mutation,
               changes=st.dictionaries(st.sampled_from(fields), values, min_size=1, max_size=3))
        def run(which, mut, changes):
            if which == "config":
                kw = dict(hidden=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, ffn=96, block_size=4, n_target_layers=2)
                kw.update(changes)
                case(f"DraftConfig({_short(changes)})")
                try:
                    cfg = DraftConfig(**kw)
                except ConfigError as exc:
                    assert any(k in str(exc) for k in changes) or "swa" in str(exc) or "layer" in str(exc), \
                        f"ConfigError({exc}) does not name one of {list(changes)}"
                    stats["errors"] += 1
                    return
                except BaseException as exc:
                    raise AssertionError(f"DraftConfig({changes}) raised {type(exc).__name__}({exc}), not ConfigError") from exc
                cfg.validate()  # a config that validated stays valid
                return
            kind, arg = mut
            tensors = dict(host)
            if kind == "missing":
                del tensors[arg]
                expect_error(lambda: DraftWeights(CFG, tensors), (arg, "missing"), f"weights without {arg}")
            elif kind == "extra":
                tensors[arg] = np.zeros(3, np.float32)
                expect_error(lambda: DraftWeights(CFG, tensors), ("cannot run", "unexpected", arg), f"weights + {arg!r}")
            elif kind == "shape":
                name, d = arg
                a = tensors[name]
                tensors[name] = np.zeros(a.shape[:-1] + (a.shape[-1] + (d or 1),), np.float32) if d >= 0 else a.T.copy() if a.ndim == 2 and a.shape[0] != a.shape[1] else a[..., :-1]
                expect_error(lambda: DraftWeights(CFG, tensors), (name, "shape"), f"{name} reshaped")
            elif kind == "dtype":
                name, dt = arg
                tensors[name] = tensors[name].astype(dt)
                expect_error(lambda: DraftWeights(CFG, tensors), (name, "float", "dtype"), f"{name} as {dt}")
            elif kind == "nonfinite":
                name, v = arg
                a = tensors[name].copy()
                a.flat[a.size // 2] = v
                tensors[name] = a
                expect_error(lambda: DraftWeights(CFG, tensors), (name, "nan", "inf"), f"{name} with {v}")
            elif kind == "upload_dtype":
                base = objects()
                if arg in ("f32", "f16", "bf16"):
                    case(f"upload as {arg}")
                    with W.to_backend(backend, arg) as b2:
                        assert b2.dtype == arg
                elif arg == "q8_0":  # every matrix of this config has rows of 32k values
                    case("upload as q8_0")
                    W.to_backend(backend, arg).close()
                else:
                    expect_error(lambda: W.to_backend(backend, arg), ("dtype",), f"upload as {arg!r}")
                assert objects() == base
            else:
                expect_error(lambda: BackendWeights(arg, backend), ("draftweights",), f"BackendWeights({type(arg).__name__})")

        run()
        # q8_0 refuses matrices whose rows are not whole blocks, naming them
        odd = DraftConfig(hidden=48, n_layer=1, n_head=2, n_head_kv=1, head_dim=24, ffn=80, block_size=4, n_target_layers=2)
        expect_error(lambda: DraftWeights.random(odd).to_backend(backend, "q8_0"), ("q8_0", "multiple", "block"), "odd q8_0")
        # weights of another config: the C-style API refuses them, the cache refuses the other ring
        other_cfg = CFG.replace(hidden=32, head_dim=16, n_target_layers=3)
        with DraftWeights.random(other_cfg).to_backend(backend, "f32") as other:
            st_ = DraftKvState()
            draft_kv_init(st_, bw, backend, CAP, cache_type="f32")
            expect_error(lambda: draft_kv_begin_step(st_, other, backend, RING, 5), ("weights",), "begin_step, other weights")
            other_ring = FeatureRing(16, other_cfg.fc_in)
            other_ring.append(np.zeros((4, other_cfg.fc_in), np.float32))
            expect_error(lambda: st_.cache.step(other_ring, 4, NOISE), ("fc_in",), "ring of another config")
            with DraftKvCache(other, backend, CAP) as oc:
                expect_error(lambda: oc.step(RING, 5, np.zeros((Q, 32), np.float32)), ("fc_in",), "ring of another config 2")
                expect_error(lambda: oc.step(other_ring, 4, NOISE), ("noise_embed",), "noise of another config")
            st_.cache.close()
            still = DraftKvCache(bw, backend, CAP, cache_type="f32")
            still_works(still, 41)
            still.close()

    def drafter() -> None:
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
        bad_top_p = st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True),
                              st.sampled_from([np.nan, "x", None, [0.5]]))
        bad_top_k = st.one_of(st.integers(max_value=-1), st.sampled_from([1.5, "k", None, np.nan, [3]]))
        cases = st.one_of(
            st.integers(0, vocab - 1).map(lambda t: ("propose-empty", lambda: empty.propose(t), ("features",))),
            bad_tok.map(lambda t: (f"last_token={t!r}", lambda: d.propose(t), ("last_token", "token"))),
            bad_temp.map(lambda v: (f"temperature={v!r}", lambda: d.propose(3, temperature=v), ("temperature",))),
            bad_top_p.map(lambda v: (f"top_p={v!r}", lambda: d.propose(3, temperature=1.0, top_p=v), ("top_p",))),
            bad_top_k.map(lambda v: (f"top_k={v!r}", lambda: d.propose(3, temperature=1.0, top_k=v), ("top_k",))),
            small_shapes.filter(lambda s: len(s) not in (1, 2) or s[-1] != FC).map(
                lambda s: (f"add_features{s}", lambda: d.add_features(np.zeros(s, np.float32)), ("feature", "shape"))),
            bad_dtypes.map(lambda dt: (f"add_features {dt}", lambda: d.add_features(np.zeros((2, FC), dt)), ("feature", "float", "dtype"))),
            st.sampled_from([np.nan, np.inf]).map(lambda v: ("add_features nonfinite", lambda: d.add_features(_poke(FEATS[:3], 1, 2, v)), ("nan", "inf"))),
            st.one_of(st.integers(max_value=-1), st.integers(31, 2**40), not_ints).map(
                lambda v: (f"rewind({v!r})", lambda: d.rewind(v), ("rewind", "truncate", "pos"))),
            st.one_of(small_shapes.filter(lambda s: s != (Q,)).map(lambda s: np.zeros(s, np.int32)),
                      st.just(np.zeros(Q, np.float32)), st.just(np.full(Q, vocab, np.int32)), st.just(np.full(Q, -1, np.int64))).map(
                lambda ids: (f"step_tokens {ids.dtype}{ids.shape}", lambda: d.cache.step_tokens(d.ring, 30, ids), ("token",))),
            st.text(max_size=5).filter(lambda s: s not in ("ids", "logits", "hidden")).map(
                lambda o: (f"output={o!r}", lambda: d.cache.step_tokens(d.ring, 30, np.zeros(Q, np.int32), output=o), ("output",))),
            st.just(("step() on a token cache", lambda: d.cache.step(d.ring, 30, NOISE), ("step_tokens", "token"))),
        )
        ctor_bad = st.sampled_from([
            ("weights=None", dict(weights=None), ("weights",)),
            ("embed hidden", dict(embed_tokens=np.zeros((vocab, H + 1), np.float32)), ("embed_tokens", "hidden")),
            ("lm 1-D", dict(lm_head=np.zeros(H, np.float32)), ("lm_head", "hidden")),
            ("vocab mismatch", dict(lm_head=np.zeros((vocab + 1, H), np.float32)), ("rows", "vocab", "embed_tokens")),
            ("mask id", dict(weights=DraftWeights.random(CFG.replace(mask_token_id=vocab + 3))), ("mask_token_id",)),
            ("cap", dict(cap=0), ("cap",)), ("ring_cap", dict(ring_cap=-3), ("cap",)),
            ("ring_dtype", dict(ring_dtype="f64"), ("dtype",)), ("cache_type", dict(cache_type="q4"), ("cache_type",)),
            ("weight_dtype", dict(weights=W, weight_dtype="f8"), ("dtype",)), ("swa", dict(swa="x"), ("swa",)),
            ("embed nan", dict(embed_tokens=_poke(embed, 0, 0, np.nan)), ("embed_tokens", "nan")),
            ("own backend + bad cap", dict(backend=None, cap=-1), ("cap",)),
        ])

        @fuzz
        @given(c=cases, ctor=ctor_bad, ok=st.sampled_from(["greedy", "sample", "ctor"]))
        def run(c, ctor, ok):
            desc, fn, words = c
            expect_error(fn, words, desc)
            assert d.committed == 30
            if ok == "greedy":
                case("propose greedy")
                assert np.array_equal(d.propose(np.int32(7)), want_ids)
            elif ok == "sample":
                case("propose sampling")
                ids, probs = d.propose(7, temperature=0.7, top_k=5, top_p=0.9, rng=np.random.default_rng(1))
                assert ids.shape == (Q - 1,) and np.allclose(probs.sum(axis=1), 1) and (probs[np.arange(Q - 1), ids] > 0).all()
            else:
                what, kw, words = ctor
                args = dict(weights=bw, embed_tokens=embed, lm_head=lm, backend=backend, cap=CAP, cache_type="f32")
                args.update(kw)
                expect_error(lambda: Drafter(**args), words, f"Drafter({what})")
                assert objects() == base, f"Drafter({what}) leaked {objects()} vs {base}"
            assert np.array_equal(d.propose(7), want_ids)

        run()
        d.close()
        empty.close()

    def lifecycle() -> None:
        ops = st.lists(st.sampled_from([
            "close backend", "close weights", "close cache", "close oneshot", "close graph ctx", "close galloc",
            "close buffer", "step", "step oneshot", "reset", "begin_step", "compute", "graph compute", "tensor set",
            "tensor numpy", "new cache", "buffer set", "gc",
        ]), min_size=1, max_size=8)

        @fuzz
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
            objs = {"backend": be, "weights": w, "cache": cache, "oneshot": one, "graph ctx": gctx, "galloc": galloc, "buffer": buf}
            case(f"lifecycle {seq}")
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
                    "step oneshot": (lambda: one.step(RING, 23, NOISE), not ({"backend", "weights", "oneshot"} & closed), ("closed",)),
                    "reset": (cache.reset, usable, ("closed",)),
                    "begin_step": (lambda: cache.begin_step(RING, 41), usable, ("closed",)),
                    "compute": (cache.compute, usable, ("closed",)),
                    "graph compute": (lambda: cache.gf.compute(be), usable, ("closed",)),
                    "tensor set": (lambda: cache.inp_embed.set(NOISE), "cache" not in closed, ("closed",)),
                    "tensor numpy": (lambda: cache.hidden_states.numpy(), "cache" not in closed, ("closed",)),
                    "new cache": (lambda: DraftKvCache(w, be, CAP, cache_type="f32").close(), not ({"backend", "weights"} & closed), ("closed",)),
                    "buffer set": (lambda: (graph.compute(be), a.set(np.ones((2, 8), np.float32))),
                                   not ({"backend", "buffer", "graph ctx", "galloc"} & closed), ("closed",)),
                }[op]
                if ok:
                    case(f"  {op} (valid)")
                    fn()
                else:
                    expect_error(fn, words, f"{op} after closing {sorted(closed)}")
            if not ({"backend", "weights", "cache"} & closed):
                cache.reset()
                out = cache.step(RING, 41, NOISE)
                assert relative_error(out, EXPECTED[41]) < 1e-5
            for obj in (cache, one, galloc, gctx, buf, ctx, w, be):
                obj.close()

        base = objects()
        run()
        assert objects() == base, f"lifecycle leaked {objects()} vs {base}"

    def ring() -> None:
        op = st.one_of(
            st.tuples(st.just("append"), st.integers(0, 12)),
            st.tuples(st.just("write"), st.integers(-3, 40), st.integers(0, 6)),
            st.tuples(st.just("truncate"), st.integers(-3, 40)),
            st.tuples(st.just("read"), st.integers(-3, 40), st.integers(-1, 12)),
            st.tuples(st.just("clear")),
            st.tuples(st.just("bad_rows"), st.integers(0, 4)),
            st.tuples(st.just("bad_pos"), not_ints),
        )

        @fuzz
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
                    rows = src[nxt:nxt + n]
                    nxt = (nxt + n) % 150
                    if pos < 0 or pos > written or pos < oldest:
                        expect_error(lambda: r.write(pos, rows), ("position",), f"write at {pos} (written {written}, oldest {oldest})")
                        continue
                    case(f"write {n} at {pos}")
                    r.write(pos, rows)
                    for i in range(n):
                        model[pos + i] = rows[i]
                    if n:
                        written = pos + n
                        oldest = max(oldest, written - cap)
                elif o[0] == "truncate":
                    if not oldest <= o[1] <= written:
                        expect_error(lambda: r.truncate(o[1]), ("truncate",), f"truncate {o[1]}")
                        continue
                    case(f"truncate {o[1]}")
                    r.truncate(o[1])
                    written = o[1]
                elif o[0] == "read":
                    start, n = o[1], o[2]
                    if n < 0 or start < 0 or (n > 0 and (start < oldest or start + n > written)):
                        expect_error(lambda: r.read(start, n), ("range", "overwritten", "never written", "position"),
                                     f"read {start}+{n} of [{oldest}, {written})")
                        continue
                    case(f"read {start}+{n}")
                    got = r.read(start, n)
                    want = np.array([model[start + i] for i in range(n)], np.float32).reshape(n, 4)
                    assert np.array_equal(got, want) if dtype == "f32" else np.allclose(got, want, atol=1e-2)
                elif o[0] == "clear":
                    case("clear")
                    r.clear()
                    written = oldest = 0
                elif o[0] == "bad_rows":
                    bad = [np.zeros((2, 5), np.float32), np.zeros((2, 4), np.int32), _poke(np.zeros((2, 4), np.float32), 1, 1, np.nan),
                           np.zeros((2, 2, 4), np.float32), "rows"][o[1]]
                    expect_error(lambda: r.append(bad), ("feature", "nan", "float", "shape"), f"append {type(bad).__name__}")
                else:
                    expect_error(lambda: r.write(o[1], src[:1]), ("pos",), f"write at {o[1]!r}")
                assert (r.written, r.oldest, len(r)) == (written, oldest, written - oldest)

        run()
        for bad in (dict(cap=0, fc_in=4), dict(cap=3, fc_in=-1), dict(cap=True, fc_in=4), dict(cap=3, fc_in=4, dtype="i8"),
                    dict(cap=3.0, fc_in=4), dict(cap=2**40, fc_in=2**20)):
            expect_error(lambda: FeatureRing(**bad), ("cap", "fc_in", "dtype", "large"), f"FeatureRing({bad})")

    def ggml_api() -> None:
        types = st.sampled_from(["f32", "f16", "bf16", "i32", "q8_0"])
        arrays = st.tuples(
            st.sampled_from(["same", "other shape", "transposed", "fortran", "strided", "readonly", "0-d", "list"]),
            st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64, object]),
            st.sampled_from(["normal", "nan", "big"]),
        )
        dims = st.lists(st.sampled_from([1, 2, 3, 4, 8, 32]), min_size=1, max_size=3)

        @fuzz
        @given(ty=types, ne=dims, arr=arrays)
        def run(ty, ne, arr):
            with Context(n_tensors=4) as ctx:
                if ne[0] % 32 and ty == "q8_0":
                    expect_error(lambda: ctx.new_tensor(ty, *ne), ("block",), f"new_tensor {ty}{ne}")
                    ne = [32] + ne[1:]
                for bad_ne in ([0], [-1, 2], [2] * 5, [1.5], [True], []):
                    expect_error(lambda: ctx.new_tensor("f32", *bad_ne), ("dims",), f"new_tensor {bad_ne}")
                for bad_ty in ("f7", None, 99, 1.0):
                    expect_error(lambda: ctx.new_tensor(bad_ty, 4), ("type",), f"new_tensor type {bad_ty!r}")
                t = ctx.new_tensor(ty, *ne, name="t")
                expect_error(lambda: t.set(np.zeros(t.shape, np.float32)), ("no data", "allocate"), "set before alloc")
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
                        expect_error(lambda: t.set(a), ("shape",), desc)
                    elif (ty == "i32" and kind not in "iu") or (ty != "i32" and kind != "f"):
                        expect_error(lambda: t.set(a), ("expected", "dtype", "array"), desc)
                    elif ty == "i32" and na.size and (na.min() < -2**31 or na.max() >= 2**31):
                        expect_error(lambda: t.set(a), ("range",), desc)
                    else:
                        case(desc)
                        t.set(a)
                        back = t.numpy()
                        assert back.shape == shape
                        if ty == "i32" or (ty == "f32" and vals != "nan"):
                            assert np.array_equal(back, na.astype(back.dtype)), desc
                    expect_error(lambda: t.set_bytes(np.zeros(t.nbytes + 1, np.uint8)), ("exceeds",), "set_bytes overflow")
                    expect_error(lambda: t.set_bytes(np.zeros(4, np.uint8), -1), ("offset", "exceeds"), "set_bytes offset")
                expect_error(lambda: t.set(np.zeros(t.shape, np.float32)), ("closed", "no data"), "set after buffer closed")
            expect_error(lambda: t.numpy(), ("closed",), "numpy after context closed")

        run()

    def ggml_ops() -> None:
        """Each op with shapes that are valid, then maybe one thing broken: refused, or computed without an abort."""
        OPS = ["add", "mul", "mul_mat", "rms_norm", "scale", "silu", "get_rows", "set_rows", "concat", "cpy", "cast",
               "soft_max_ext", "rope_ext", "flash_attn_ext", "argmax", "view", "reshape", "permute"]
        dim = st.sampled_from([1, 2, 3, 4, 8, 32, 64])
        mutation = st.one_of(
            st.none(), st.none(),
            st.tuples(st.just("type"), st.integers(0, 3), st.sampled_from(["f32", "f16", "bf16", "i32", "q8_0", "i64"])),
            st.tuples(st.just("dim"), st.integers(0, 3), st.integers(0, 3), st.sampled_from([-1, 1, 2])),
            st.tuples(st.just("transpose"), st.integers(0, 3)),
        )

        def specs(op, n0, n1, n2, k, extra):
            """[(type, ne)] inputs for `op` that are valid as drawn."""
            q8 = "q8_0" if n0 % 32 == 0 else "f16"
            return {
                "add": [("f32", (n0, n1, n2)), (["f32", "f16"][extra % 2] if False else "f32", (n0, 1 if extra % 2 else n1, 1))],
                "mul": [("f32", (n0, n1, n2)), ("f32", (n0, 1, 1))],
                "mul_mat": [(["f32", "f16", "bf16", q8][extra % 4], (n0, n1, 1)), ("f32", (n0, k, n2))],
                "rms_norm": [("f32", (n0, n1, n2))], "scale": [("f32", (n0, n1))], "silu": [(["f32", "f16"][extra % 2], (n0, n1))],
                "get_rows": [(["f32", "f16", q8, "i32"][extra % 4], (n0, n1)), ("i32", (k,))],
                "set_rows": [(["f32", "f16"][extra % 2], (n0, n1)), ("f32", (n0, min(k, n1))), (["i32", "i64"][extra % 2], (min(k, n1),))],
                "concat": [("f32", (n0, n1, n2)), ("f32", (n0, n1, n2) if extra % 3 == 2 else ((n0, k, n2) if extra % 3 else (k, n1, n2)))],
                "cpy": [(["f32", "f16", "bf16"][extra % 3], (n0, n1)), (["f32", "f16", "bf16", q8][(extra // 3) % 4], (n0, n1))],
                "cast": [(["f32", "f16", "bf16", "i32"][extra % 4], (n0, n1))],
                "soft_max_ext": [("f32", (n0, n1, n2)), (["f16", "f32"][extra % 2], (n0, n1 + extra % 3))],
                "rope_ext": [(["f32", "f16"][extra % 2], (2 * n0, n1, k)), ("i32", (k,))],
                "flash_attn_ext": [("f32", (n0, k, 2 * n2)), (["f16", "f32", "bf16"][extra % 3], (n0, n1, n2)),
                                   (["f16", "f32"][extra % 2], (n0, n1, n2)), ("f16", (n1, k + extra % 4))],
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
                "add": lambda: g.add(a, b), "mul": lambda: g.mul(a, b), "mul_mat": lambda: g.mul_mat(a, b),
                "rms_norm": lambda: g.rms_norm(a, [1e-6, 0.0, -1.0, float("nan")][extra % 4]),
                "scale": lambda: g.scale(a, [0.5, float("inf")][extra % 2]), "silu": lambda: g.silu(a),
                "get_rows": lambda: g.get_rows(a, b), "set_rows": lambda: g.set_rows(a, b, c),
                "concat": lambda: g.concat(a, b, [0, 1, 2, 4][extra % 4] if extra % 5 else (1 if b.ne[1] != a.ne[1] else 0)),
                "cpy": lambda: g.cpy(a, b), "cast": lambda: g.cast(a, ["f32", "f16", "q8_0", "i32", "bf16"][extra % 5]),
                "soft_max_ext": lambda: g.soft_max_ext(a, b if extra % 4 else None, 0.5, 1.0 if extra % 5 == 0 else 0.0),
                "rope_ext": lambda: g.rope_ext(a, b, [a.ne[0], 2, a.ne[0] + 2, 3][extra % 4], [2, 0, 1][extra % 3], 0, 10000.0,
                                               1.0, 0.0 if extra % 2 else 1.0),
                "flash_attn_ext": lambda: g.flash_attn_ext(a, b, c, ts[3] if extra % 3 else None, 0.125,
                                                           0.0 if extra % 7 else 1.0, 0.0 if extra % 2 else 30.0),
                "argmax": lambda: g.argmax(a),
                "view": lambda: g.cont(g.view(a, ((extra % n0) + 1, n1), (), 4 * (extra % 3))),
                "reshape": lambda: g.reshape(a, *( (n1, n0, n2) if extra % 3 == 0 else (n0 * n1, n2) if extra % 3 == 1 else (n0, n1 + 1))),
                "permute": lambda: g.cont(g.permute(a, *[(1, 0, 2, 3), (2, 0, 1, 3), (0, 2, 1, 3), (0, 1, 2, 2)][extra % 4])),
            }[op]()

        @fuzz
        @given(op=st.sampled_from(OPS), n=st.tuples(dim, dim, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 5])),
               extra=st.integers(0, 59), mut=mutation)
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
                    expect_error(lambda: [ictx.new_tensor(ty, *ne) for ty, ne in spec], ("block", "type"), desc)
                    return
                used = list(ts)
                case(desc)
                try:
                    if transpose is not None and ts[transpose].ne[1] > 1:
                        used[transpose] = g.permute(ts[transpose], 1, 0, 2, 3)
                    out = apply(g, op, used, n0, n1, n2, k, extra)
                except ALLOWED as exc:
                    stats["errors"] += 1
                    # ops name themselves ("mul_mat: cannot multiply ..."); tensor creation names the dims / type
                    assert re.match(r"^[a-z_0-9]+: \S", str(exc)) or "type" in str(exc) or "dims" in str(exc), f"{desc}: {exc}"
                    return
                with Buffer.alloc_ctx_tensors(ictx, backend):
                    for t in ts:
                        if t.type in ("i32", "i64"):
                            rows = int(used[0].ne[1]) if op in ("get_rows", "set_rows") else 1  # in range: data asserts are not checked
                            idx = np.arange(t.nelements) % max(rows, 1) if op != "rope_ext" else np.arange(t.nelements) * 7
                            t.set(idx.reshape(t.shape))
                        else:
                            t.set(np.random.default_rng(1).standard_normal(t.shape).astype(np.float32))
                    graph = Graph(g, 64)
                    graph.expand(out)
                    with Gallocr(backend) as ga:
                        ga.alloc_graph(graph)
                        log.write(f"  computing -> {out.type}{out.ne}\n")
                        log.flush()
                        graph.compute(backend)
                        if out.is_contiguous:
                            out.numpy()
            stats["computed"] = stats.get("computed", 0) + 1

        run()
        print(f"ggml_ops: {stats.get('computed', 0)} graphs computed", flush=True)

    {"step_inputs": step_inputs, "construct": construct, "weights_config": weights_config, "drafter": drafter,
     "lifecycle": lifecycle, "ring": ring, "ggml_api": ggml_api, "ggml_ops": ggml_ops}[group]()
    bw.close()
    backend.close()
    left = objects()
    assert not left, f"ggml objects left alive: {left}"
    print(f"group {group}: cases tried: {stats['cases']} (errors raised: {stats['errors']}, examples: {n_examples})", flush=True)
    return 0


def _poke(a, i, j, value):
    out = np.array(a, dtype=np.float32, copy=True)
    out[i, j] = value
    return out


def _variant(x, kind):
    """Valid but unusual spellings of the array x."""
    if kind == "f16":
        return x.astype(np.float16)
    if kind == "f64":
        return x.astype(np.float64)
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "strided":
        return np.repeat(x, 2, axis=1)[:, ::2]
    if kind == "readonly":
        y = x.copy()
        y.flags.writeable = False
        return y
    return x.tolist()


def _short(obj) -> str:
    text = repr({k: (f"array{getattr(v, 'shape', '')}" if hasattr(v, "shape") else v) for k, v in obj.items()})
    return text[:160]


# ============================================================================ parent side

import numpy as np  # noqa: E402  (used by the helpers above in the child)
import pytest  # noqa: E402

_TRIED: dict[str, int] = {}


@pytest.mark.parametrize("group", list(GROUPS))
def test_fuzz_group(group, tmp_path):
    log = tmp_path / f"{group}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, group, str(log)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    last = log.read_text().splitlines()[-5:] if log.exists() else []
    report = f"exit {proc.returncode}\nlast cases:\n" + "\n".join(last) + f"\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"fuzz group {group!r} failed ({'crashed: signal ' + str(-proc.returncode) if proc.returncode < 0 else 'error'})\n{report}"
    m = re.search(r"cases tried: (\d+)", proc.stdout)
    assert m, report
    _TRIED[group] = int(m.group(1))
    assert _TRIED[group] >= GROUPS[group] * min(1.0, float(os.environ.get("PYGGML_DKV_FUZZ_SCALE", "1"))), report


def test_fuzz_summary(capsys):
    """Prints the number of fuzz cases tried (run after the groups)."""
    if not _TRIED:
        pytest.skip("no fuzz group ran in this session")
    with capsys.disabled():
        print(f"\nhardening fuzz: {sum(_TRIED.values())} cases tried in {len(_TRIED)} groups: {_TRIED}")


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.devnull))


@pytest.mark.skipif(not os.environ.get("PYGGML_DKV_MEMCHECK"),
                    reason="valgrind memcheck takes minutes: set PYGGML_DKV_MEMCHECK=1 (docs/hardening.md)")
def test_memcheck_trajectory():
    """scripts/memcheck.sh: a drafter trajectory under valgrind memcheck reports no error."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "memcheck.sh")], capture_output=True, text=True,
                          timeout=3600, cwd=ROOT)
    summary = re.findall(r"ERROR SUMMARY: .*", proc.stderr)
    assert proc.returncode == 0, f"exit {proc.returncode} {summary}\n{proc.stderr[-8000:]}"
    assert "memcheck trajectory ok" in proc.stdout, proc.stdout[-2000:]
    assert summary and summary[-1].startswith("ERROR SUMMARY: 0 errors"), summary
