"""CUDA: run-time selection everywhere; parity and CUDA-graph replay where a GPU exists.

On a machine without a GPU (or a build without CUDA) the CUDA backend must be reported
unavailable with a reason and refuse to start with a clear error. The GPU tests skip there;
scripts/gpu_check.sh runs them on a lent GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyggml_dkv
from pyggml_dkv import Backend, BackendUnavailableError, DraftConfig, DraftKvCache, DraftWeights
from pyggml_dkv.ggml import _lowlevel, built_backends, cuda_graph_stats

CUDA_DEVICES = [b.name for b in pyggml_dkv.available_backends() if b.name.startswith("cuda:") and b.available]
needs_gpu = pytest.mark.skipif(not CUDA_DEVICES, reason="no CUDA device (or this ggml was built without CUDA)")


@pytest.mark.skipif(bool(CUDA_DEVICES), reason="a CUDA device is present")
def test_cuda_reported_unavailable_with_a_reason():
    cuda = [b for b in pyggml_dkv.available_backends() if b.name.startswith("cuda")]
    assert cuda and not cuda[0].available and cuda[0].reason
    if "cuda" in built_backends():
        assert "no CUDA device" in cuda[0].reason
    else:
        assert "GGML_CUDA=1" in cuda[0].reason
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            Backend(spec)


def test_cuda_graph_events_are_parsed_from_ggml_debug_log():
    cuda_graph_stats(reset=True)
    for msg in (
        "CUDA Graph id 7 reused",
        "ggml_backend_cuda_graph_compute: CUDA graph warmup complete",
        "ggml_cuda_graph_update: CUDA graph update failed",
        "unrelated message about a graph",
        "ggml_backend_cuda_graph_compute: CUDA graph warmup reset",
    ):
        _lowlevel._count_cuda_graph_event(msg)
    assert cuda_graph_stats(reset=True) == {
        "reused": 1,
        "warmup_complete": 1,
        "warmup_reset": 1,
        "update_failed": 1,
        "disabled": 0,
    }
    assert sum(cuda_graph_stats().values()) == 0


@pytest.fixture(scope="module")
def gpu():
    backend = Backend(CUDA_DEVICES[0]) if CUDA_DEVICES else None
    yield backend
    if backend is not None:
        backend.close()


@needs_gpu
@pytest.mark.parametrize(
    "name",
    [
        "gqa1-hd64-q10-mixed-swa<cap",
        "gqa2-hd128-q16-mixed-swa>cap-yarn",
        "gqa4-hd64-q16-full",
        "gqa4-hd128-q10-sliding",
    ],
)
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_parity_on_cuda(name, cache_type, gpu, parity_log):
    from tests.drafter.test_parity import CONFIGS, TOL, run_trajectory

    spec = CONFIGS[name]
    # ggml's CUDA flash attention converts K and V to f16 whatever the cache's type: an f32 cache
    # computes to f16's precision there (measured on an H200: 1.2-1.5e-3 against the reference)
    run_trajectory(
        DraftConfig(**spec["cfg"]),
        spec["cap"],
        "f32",
        cache_type,
        "seed",
        False,
        n_steps=40,
        seed=5,
        cpu=gpu,
        parity_log=parity_log,
        case=f"{name} [CUDA]",
        tol=TOL["f16"],
    )


@needs_gpu
def test_step_graph_replays_as_a_cuda_graph(gpu):
    """Same topology and addresses every step: after warm-up ggml replays its captured CUDA graph.

    ggml logs "CUDA Graph id N reused" only for scheduler graphs (they carry a uid); for ours it
    logs the warm-up once and then replays without a word, unless a property changed (a reset)."""
    import os

    from pyggml_dkv import FeatureRing

    if os.environ.get("GGML_CUDA_DISABLE_GRAPHS"):
        pytest.skip("CUDA graphs disabled by GGML_CUDA_DISABLE_GRAPHS")
    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=0)
    ring = FeatureRing(512, cfg.fc_in)
    feats = np.random.default_rng(0).standard_normal((400, cfg.fc_in)).astype(np.float32)
    noise = np.random.default_rng(1).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    with w.to_backend(gpu, "f16") as bw, DraftKvCache(bw, gpu, 256) as cache:
        ring.append(feats[:100])
        cache.step(ring, 100, noise)
        cuda_graph_stats(reset=True)
        for committed in range(101, 161):
            ring.append(feats[committed - 1 : committed])
            cache.step(ring, committed, noise)
        stats = cuda_graph_stats(reset=True)
    # ggml captures the graph on the second identical compute and replays it silently afterwards;
    # any change of topology, shapes or tensor addresses would show up as a warm-up reset
    assert stats["warmup_complete"] == 1 and stats["warmup_reset"] == 0, stats
    assert stats["update_failed"] == 0 and stats["disabled"] == 0, stats


@needs_gpu
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_lanes_on_cuda_match_single_lane_caches(cache_type, gpu, parity_log):
    """Lanes on the GPU (unfolded attention, the lanes as flash attention's batch): every lane of
    random steps with lanes joining and idling equals a single-lane cache on that lane's trajectory,
    and the numpy reference. ggml's CUDA flash attention converts K and V to f16 whatever the
    cache's type, and cuBLAS picks its kernels by the number of rows: an f32 cache is held to f16's
    tolerance (measured on an H200: lanes vs single lanes 2.4e-3 max|a-b|/max|b| for both types;
    single-lane f32 caches vs the reference 1.2-1.5e-3)."""
    from pyggml_dkv import FeatureRing
    from pyggml_dkv import reference as R
    from pyggml_dkv.common.numeric import relative_error

    cfg = DraftConfig(
        hidden=128,
        n_layer=2,
        n_head=8,
        n_head_kv=2,
        head_dim=64,
        ffn=256,
        block_size=8,
        n_target_layers=2,
        layer_types=["full", "sliding"],
        swa_window=24,
    )
    w = DraftWeights.random(cfg, seed=2)
    rng = np.random.default_rng(3)
    lanes, cap = 3, 61
    feats = [rng.standard_normal((400, cfg.fc_in)).astype(np.float32) * 10.0 ** (lane - 1) for lane in range(lanes)]
    rings = [FeatureRing(cap + 2 * cfg.block_size, cfg.fc_in) for _ in range(lanes)]
    worst = 0.0
    with w.to_backend(gpu, "f32") as bw, DraftKvCache(bw, gpu, cap, cache_type=cache_type, lanes=lanes) as multi:
        singles = [DraftKvCache(bw, gpu, cap, cache_type=cache_type) for _ in range(lanes)]
        try:
            for step in range(30):
                active = [bool(rng.random() < 0.7) for _ in range(lanes)]
                active[step % lanes] = True
                noise = [
                    rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32) if a else None for a in active
                ]
                for lane in range(lanes):
                    if active[lane]:
                        n = int(rng.integers(1, 2 * cfg.block_size)) if step else 100
                        rings[lane].append(feats[lane][rings[lane].written : rings[lane].written + n])
                got = multi.step(
                    [r if a else None for r, a in zip(rings, active)],
                    [r.written if a else None for r, a in zip(rings, active)],
                    noise,
                )
                for lane in range(lanes):
                    if not active[lane]:
                        continue
                    c = rings[lane].written
                    want = singles[lane].step(rings[lane], c, noise[lane])
                    worst = max(worst, relative_error(got[lane], want))
                    if step % 10 == 9:
                        ref = R.reference_step(w, feats[lane][:c], c, cap, noise[lane])
                        assert relative_error(got[lane], ref) <= 5e-3
        finally:
            for c in singles:
                c.close()
    parity_log("lanes vs single lane [CUDA]", cache_type, worst, "3 lanes, 30 steps")
    assert worst <= 5e-3
