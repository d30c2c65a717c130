"""A short drafter trajectory for a memory checker (run it with scripts/memcheck.sh).

Exercises everything a host touches: weight upload, the ring cache (fold-in append, bulk append in
several chunks, rewind, reset, ring wrap, both mask kinds, lm_head, token-id input), the one-shot
graph, the Drafter (greedy + sampling), error paths, and close / garbage collection. Prints
"memcheck trajectory ok: N steps" at the end.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np

# the checkout, after PYTHONPATH: scripts/memcheck.sh puts a copy of the package with the
# valgrind-friendly extension first
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pyggml_dkv.drafter.bulk_append as dkv  # noqa: E402
from pyggml_dkv import (  # noqa: E402
    Backend,
    DraftConfig,
    Drafter,
    DraftKvCache,
    DraftWeights,
    FeatureRing,
    OneShotDrafter,
    live_objects,
)
from pyggml_dkv import reference as R  # noqa: E402
from pyggml_dkv.common.numeric import relative_error  # noqa: E402


def main() -> int:
    n_steps = int(os.environ.get("MEMCHECK_STEPS", "24"))
    dkv.BULK_CHUNK = 16  # bulk appends in several temporary graphs
    cfg = DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=2,
        n_head_kv=1,
        head_dim=32,
        ffn=96,
        block_size=4,
        n_target_layers=2,
        layer_types=["full", "sliding"],
        swa_window=7,
    )
    w = DraftWeights.random(cfg, seed=3)
    rng = np.random.default_rng(0)
    cap = 19
    feats = rng.standard_normal((400, cfg.fc_in)).astype(np.float32)
    lm = (rng.standard_normal((40, cfg.hidden)) / 8).astype(np.float32)
    steps = 0
    backend = Backend("cpu", n_threads=2)
    bw = w.to_backend(backend, "f32")
    ring = FeatureRing(cap + 8, cfg.fc_in)
    with (
        DraftKvCache(bw, backend, cap, cache_type="f32") as cache,
        DraftKvCache(bw, backend, cap, lm_head=lm, cache_type="f16", swa="per_row") as cache2,
        OneShotDrafter(bw, backend, cap, cache_type="f32") as oneshot,
    ):
        committed = 0
        jumps = [1, 3, 4, 11, 2, 25, 1, -3, 4, 60, -2, 1]  # fold-in, bulk (> a_step), rewinds, wraps
        for i in range(n_steps):
            d = jumps[i % len(jumps)]
            if d < 0:
                committed = max(1, committed + d)
                ring.truncate(committed)
            else:
                ring.append(feats[committed : committed + d])
                committed += d
            noise = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
            got = cache.step(ring, committed, noise)
            cache2.step(ring, committed, noise)
            if i % 4 == 0:
                err = relative_error(got, R.reference_step(w, feats, committed, cap, noise))
                assert err < 1e-4, err
                assert relative_error(oneshot.step(ring, committed, noise), got) < 1e-4
            if i == n_steps // 2:
                cache.reset()
            for bad in (0, committed + 1):  # error paths leave the cache usable
                try:
                    cache.step(ring, bad, noise)
                except ValueError:
                    pass
            steps += 1
    embed = (rng.standard_normal((40, cfg.hidden)) / 8).astype(np.float32)
    with Drafter(w, embed_tokens=embed, lm_head=lm, backend=backend, cap=cap, weight_dtype="f32") as drafter:
        drafter.add_features(feats[:30])
        for i in range(6):
            ids = drafter.propose(int(i % 40))
            drafter.rewind(28 + i)
            drafter.add_features(feats[28 + i : 30 + i])
            ids, probs = drafter.propose(5, temperature=0.8, top_k=10, top_p=0.9, rng=rng)
            assert ids.shape == (cfg.block_size - 1,) and np.isfinite(probs).all()
            steps += 2
    # objects left to the garbage collector
    leftover = DraftKvCache(bw, backend, cap)
    leftover.step(ring, ring.written, np.zeros((cfg.block_size, cfg.hidden), np.float32))
    del leftover
    gc.collect()
    bw.close()
    backend.close()
    left = {k: v for k, v in live_objects().items() if v}
    assert not left, left
    from pyggml_dkv import _ggml_cffi
    from pyggml_dkv._cffi.stamp import extension_build
    from pyggml_dkv.ggml import _lowlevel

    built = extension_build(_lowlevel.ffi, _lowlevel.lib)
    print(
        f"memcheck trajectory ok: {steps} steps (extension {_ggml_cffi.__file__}: {built.version}, {built.variant})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
