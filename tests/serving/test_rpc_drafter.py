"""DraftKvCache on an RPC server: bit-identical to the local CPU, and failures that end in
exceptions (never an abort or a hang) with the cache refusing further steps."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv.ggml import RemoteBackendError

CAP = 96


def trajectory(cfg: DraftConfig, n_steps: int, seed: int = 3):
    """(committed, noise) per step: 1..8 new positions each, so the ring and cache wrap."""
    rng = np.random.default_rng(seed)
    committed = 0
    for step in range(n_steps):
        committed += 1 + step % 8
        yield committed, rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)


def run(
    backend: Backend,
    w: DraftWeights,
    feats: np.ndarray,
    dtype: str,
    n_steps: int,
    swa: str = "seed",
    split: list | None = None,
):
    cfg = w.cfg
    ring = FeatureRing(2 * CAP, cfg.fc_in)
    outs = []
    # the server's buffers are plain ggml buffers (no AMX / VNNI repacking): the local side keeps
    # its weights plain too, so both run the very same kernels
    with (
        w.to_backend(backend, dtype, repack=False) as bw,
        DraftKvCache(bw, backend, CAP, cache_type="f16", swa=swa) as c,
    ):
        fold = c.fold_gqa
        if split is not None:
            split.extend(sorted(c.memory.mask_parts))
        written = 0
        for committed, noise in trajectory(cfg, n_steps):
            ring.append(feats[written:committed])
            written = committed
            outs.append(c.step(ring, committed, noise))
    return fold, outs


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])  # weights; the cache is f16
def test_rpc_cpu_is_bit_identical_to_local_cpu(cpu, shared_server, dtype):
    cfg = DraftConfig.toy()  # 4 query heads over 2 K/V heads: the CPU-only GQA fold applies
    w = DraftWeights.random(cfg, seed=1)
    n_steps = 60  # committed reaches ~270: the 96-slot cache wraps twice
    feats = np.random.default_rng(2).standard_normal((300, cfg.fc_in)).astype(np.float32)
    fold_local, local = run(cpu, w, feats, dtype, n_steps)
    with Backend(shared_server.spec) as remote:
        fold_remote, over_rpc = run(remote, w, feats, dtype, n_steps)
    assert fold_local and fold_remote  # the remote CPU keeps the CPU graph
    for step, (a, b) in enumerate(zip(local, over_rpc)):
        assert np.array_equal(a, b), f"step {step} differs"


def test_logits_over_rpc_are_downloaded(cpu, shared_server):
    """Logits on the server are downloaded (a local CPU cache computes them into the array it returns
    instead, Tensor.place_in): the same values to the bit, a new array every step."""
    from pyggml_dkv.drafter.backend_weights import upload_matrix

    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=1)
    lm = np.random.default_rng(5).standard_normal((40, cfg.hidden)).astype(np.float32)
    feats = np.random.default_rng(2).standard_normal((120, cfg.fc_in)).astype(np.float32)
    outs = {}
    for name in ("local", "rpc"):
        with contextlib.ExitStack() as stack:
            backend = cpu if name == "local" else stack.enter_context(Backend(shared_server.spec))
            bw = stack.enter_context(w.to_backend(backend, "f16", repack=False))
            head, head_buf = upload_matrix(backend, lm, "f16", "lm_head")
            stack.enter_context(head_buf)
            c = stack.enter_context(DraftKvCache(bw, backend, CAP, cache_type="f16", lm_head=head))
            assert c.logits.in_host_memory == (name == "local")
            ring = FeatureRing(2 * CAP, cfg.fc_in)
            ring.append(feats)
            noise = np.full((cfg.block_size, cfg.hidden), 0.25, np.float32)
            outs[name] = [c.step(ring, committed, noise) for committed in (60, 70)]
    for a, b in zip(outs["local"], outs["rpc"]):
        assert a.shape == (cfg.block_size, 40) and np.array_equal(a, b)
    assert outs["rpc"][0] is not outs["rpc"][1]


@pytest.mark.parametrize("swa", ["seed", "per_row"])
def test_split_masks_over_rpc_are_bit_identical_to_whole_masks(cpu, shared_server, swa):
    """Over RPC a mask whose context columns are one row for all query rows is a base + a row
    added on the device; locally it is uploaded whole. Sliding layers: split under "seed" only."""
    cfg = DraftConfig.toy(layer_types=["sliding", "full"], swa_window=10)
    w = DraftWeights.random(cfg, seed=5)
    feats = np.random.default_rng(6).standard_normal((300, cfg.fc_in)).astype(np.float32)
    local_split, remote_split = [], []
    _, local = run(cpu, w, feats, "f16", 40, swa, local_split)
    with Backend(shared_server.spec) as remote:
        _, over_rpc = run(remote, w, feats, "f16", 40, swa, remote_split)
    assert local_split == [] and remote_split == (["mask_full", "mask_swa"] if swa == "seed" else ["mask_full"])
    for step, (a, b) in enumerate(zip(local, over_rpc)):
        assert np.array_equal(a, b), f"step {step} differs"


def test_split_masks_survive_a_buffer_clear(cpu, shared_server):
    """Clearing the cache's buffer between steps (as a C-style host may) wipes a split mask's base
    on the server too: the next step must send it again, not compute on a zeroed base."""
    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=8)
    feats = np.random.default_rng(9).standard_normal((200, cfg.fc_in)).astype(np.float32)

    def run_with_clear(backend: Backend) -> tuple[list[str], list[np.ndarray]]:
        ring = FeatureRing(2 * CAP, cfg.fc_in)
        outs, written = [], 0
        with w.to_backend(backend, "f16", repack=False) as bw, DraftKvCache(bw, backend, CAP) as c:
            for step, (committed, noise) in enumerate(trajectory(cfg, 12)):
                ring.append(feats[written:committed])
                written = committed
                if step == 6:
                    c.mem_buf.clear(0)  # K/V and every input zeroed, on both sides alike
                outs.append(c.step(ring, committed, noise))
            return sorted(c.memory.mask_parts), outs

    local_split, local = run_with_clear(cpu)
    with Backend(shared_server.spec) as remote:
        remote_split, over_rpc = run_with_clear(remote)
    assert local_split == [] and remote_split == ["mask_full"]
    for step, (a, b) in enumerate(zip(local, over_rpc)):
        assert np.array_equal(a, b, equal_nan=True), f"step {step} differs"


def start_cache(backend: Backend, timeout_steps: int = 5):
    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=0)
    bw = w.to_backend(backend, "f32")
    cache = DraftKvCache(bw, backend, CAP, cache_type="f16")
    feats = np.random.default_rng(0).standard_normal((400, cfg.fc_in)).astype(np.float32)
    ring = FeatureRing(2 * CAP, cfg.fc_in)
    steps = trajectory(cfg, 100)
    written = 0

    def step():
        nonlocal written
        committed, noise = next(steps)
        ring.append(feats[written:committed])
        written = committed
        return cache.step(ring, committed, noise)

    for _ in range(timeout_steps):
        step()
    return bw, cache, step


@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_server_failure_mid_trajectory_is_an_exception_and_the_cache_stays_refused(server, failure):
    backend = Backend(server.spec, timeout_s=1.5)
    bw, cache, step = start_cache(backend)
    if failure == "killed":
        server.kill()
    else:
        server.suspend()
    t0 = time.monotonic()
    with pytest.raises(RemoteBackendError):
        step()
    assert time.monotonic() - t0 < 5
    for _ in range(2):  # refused at once, until re-created
        t1 = time.monotonic()
        with pytest.raises(RemoteBackendError, match="re-create"):
            step()
        assert time.monotonic() - t1 < 0.5
    if failure == "frozen":
        server.resume()
    cache.close()
    bw.close()
    backend.close()


def test_a_new_server_and_backend_after_a_failure_work(server, free_port):
    from pyggml_dkv.serving import RpcServerProcess

    backend = Backend(server.spec, timeout_s=1.5)
    bw, cache, step = start_cache(backend, 2)
    server.kill()
    with pytest.raises(RemoteBackendError):
        step()
    cache.close()
    bw.close()
    backend.close()
    with RpcServerProcess(free_port(), threads=1) as again, Backend(again.spec) as b2:
        bw2, cache2, step2 = start_cache(b2, 3)
        assert np.isfinite(step2()).all()
        cache2.close()
        bw2.close()


@pytest.mark.parametrize("signal_name", ["kill", "suspend"])
def test_server_failing_while_steps_are_in_flight(server, signal_name):
    """The server dies or freezes at a random point of a step (upload, compute or download)."""
    import threading

    backend = Backend(server.spec, timeout_s=1.5)
    bw, cache, step = start_cache(backend, 1)
    failed_at = []
    timer = threading.Timer(0.05, lambda: (failed_at.append(time.monotonic()), getattr(server, signal_name)()))
    timer.start()
    with pytest.raises(RemoteBackendError):
        for _ in range(10_000):
            step()
    raised_at = time.monotonic()
    timer.join()
    assert failed_at and raised_at - failed_at[0] < 5
    server.resume()
    cache.close()
    bw.close()
    backend.close()


def test_inputs_written_directly_between_steps_are_not_lost(cpu, shared_server):
    """The C-style API writes cache.inp_embed itself; step() must not trust its record of the device."""
    cfg = DraftConfig.toy()
    w = DraftWeights.random(cfg, seed=4)
    feats = np.random.default_rng(5).standard_normal((40, cfg.fc_in)).astype(np.float32)
    a, b = (np.random.default_rng(s).standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32) for s in (6, 7))

    def run(backend):
        ring = FeatureRing(64, cfg.fc_in)
        ring.append(feats)
        with w.to_backend(backend, "f32") as bw, DraftKvCache(bw, backend, 48) as c:
            first = c.step(ring, 30, a)
            c.inp_embed.set(b)
            c.mask_full.fill(0)  # a mask written behind the cache's back too
            return first, c.step(ring, 32, a)

    with Backend(shared_server.spec) as remote:
        over_rpc = run(remote)
    local = run(cpu)
    assert all(np.array_equal(x, y) for x, y in zip(local, over_rpc))


@pytest.mark.parametrize("swa", ["seed", "per_row"])
def test_lanes_over_rpc_are_bit_identical_to_local_lanes(cpu, shared_server, swa):
    """Lanes on an RPC server (split masks: a context row and a base per lane plane; each lane's
    inputs uploaded through its own views): bit for bit the local CPU's lanes, with lanes idling,
    rewinding and resetting on the way."""
    cfg = DraftConfig(
        hidden=64,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        ffn=96,
        block_size=4,
        n_target_layers=2,
        layer_types=["full", "sliding"],
        swa_window=6,
    )
    w = DraftWeights.random(cfg, seed=4)
    rng = np.random.default_rng(5)
    feats = [rng.standard_normal((300, cfg.fc_in)).astype(np.float32) * 10.0 ** (lane - 1) for lane in range(3)]
    plan = []  # (active lanes, committed per lane, noise per lane, lane to reset or None)
    committed = [0, 0, 0]
    for step in range(40):
        active = [bool(rng.random() < 0.7) for _ in range(3)]
        active[step % 3] = True
        for lane in range(3):
            if active[lane]:
                back = step % 7 == 6 and committed[lane] > 10
                committed[lane] = committed[lane] - 3 if back else committed[lane] + int(rng.integers(1, 9))
        noise = [rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32) for _ in range(3)]
        plan.append((active, list(committed), noise, 1 if step == 20 else None))

    def run_lanes(backend: Backend) -> list:
        outs = []
        rings = [FeatureRing(2 * CAP, cfg.fc_in) for _ in range(3)]
        with (
            w.to_backend(backend, "f16", repack=False) as bw,
            DraftKvCache(bw, backend, CAP, cache_type="f16", swa=swa, lanes=3) as c,
        ):
            for active, com, noise, reset in plan:
                if reset is not None:
                    c.reset(reset)
                for lane in range(3):
                    if active[lane]:
                        rings[lane].write(
                            min(rings[lane].written, com[lane]),
                            feats[lane][min(rings[lane].written, com[lane]) : com[lane]],
                        )
                got = c.step(
                    [r if a else None for r, a in zip(rings, active)],
                    [x if a else None for x, a in zip(com, active)],
                    [n if a else None for n, a in zip(noise, active)],
                )
                outs.append([None if g is None else g.copy() for g in got])
            split = sorted(c.memory.mask_parts)
        return outs, split

    local, split_local = run_lanes(cpu)
    with Backend(shared_server.spec) as remote:
        over_rpc, split_remote = run_lanes(remote)
    assert split_local == [] and split_remote  # over RPC the masks travel split
    for step, (a, b) in enumerate(zip(local, over_rpc)):
        for lane in range(3):
            assert (a[lane] is None) == (b[lane] is None)
            assert a[lane] is None or np.array_equal(a[lane], b[lane]), f"step {step} lane {lane} differs"


def test_dflash2_over_rpc_equals_local_cpu(cpu, shared_server):
    """A DFlash-2 drafter on an RPC server: its convolutions are built from ggml's standard ops
    there (a custom op cannot travel), the local CPU runs the custom op; hidden states, the
    selector's lattice and its walk's ids are bit for bit the local ones (both sum the taps in
    the same order, with the same roundings)."""
    cfg = DraftConfig.toy(
        vocab=200, block_size=8, conv_kernel_size=3, conv_group_size=32, selector_rank=32, selector_top_k=4
    )
    w = DraftWeights.random(cfg, seed=3)
    rng = np.random.default_rng(3)
    embed = (rng.standard_normal((200, cfg.hidden)) * 0.5).astype(np.float32)
    head = (rng.standard_normal((200, cfg.hidden)) / np.sqrt(cfg.hidden) * 4).astype(np.float32)
    feats = rng.standard_normal((200, cfg.fc_in)).astype(np.float32)
    tokens = rng.integers(0, 200, size=(30, cfg.block_size)).astype(np.int32)

    def run_tokens(backend: Backend) -> list:
        out = []
        with (
            w.to_backend(backend, "f32", repack=False) as bw,
            DraftKvCache(bw, backend, CAP, cache_type="f32", lm_head=head, embed_tokens=embed) as c,
        ):
            ring = FeatureRing(2 * CAP, cfg.fc_in)
            written = 0
            for (committed, _), toks in zip(trajectory(cfg, len(tokens)), tokens):
                ring.append(feats[written:committed])
                written = committed
                ids = c.step_tokens(ring, committed, toks, output="ids")[1:].copy()
                hidden = c.hidden_states.numpy().copy()
                lattice = c.step_tokens(ring, committed, toks, output="lattice")
                out.append((ids, hidden, lattice))
        return out

    local = run_tokens(cpu)
    with Backend(shared_server.spec) as remote:
        over_rpc = run_tokens(remote)
    for step, ((ids_a, h_a, lat_a), (ids_b, h_b, lat_b)) in enumerate(zip(local, over_rpc)):
        np.testing.assert_array_equal(ids_a, ids_b, err_msg=f"step {step}")
        np.testing.assert_array_equal(h_b, h_a, err_msg=f"step {step}")
        np.testing.assert_array_equal(lat_a.candidates, lat_b.candidates)
        np.testing.assert_array_equal(lat_b.scores, lat_a.scores)
