"""Bytes per draft step over RPC (counted by a relay): a step sends its new features and little
else: the masks as one context row (split masks, drafter.masks), the noise block's changed row.
A graph computed again unchanged goes as ggml's recompute command (its uid: Graph.compute), and
one changed since (grown, placed again) goes whole."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv import Backend, DraftConfig, DraftKvCache, DraftWeights, FeatureRing
from pyggml_dkv.ggml import Buffer, Context, Gallocr, GGMLError, Graph, built_capabilities
from pyggml_dkv.ggml.capabilities import GRAPH_UID_FIX
from pyggml_dkv.serving.traffic import CountingRelay

SMALL = DraftConfig(
    hidden=1024, n_layer=5, n_head=16, n_head_kv=4, head_dim=64, ffn=3072, block_size=16, n_target_layers=5
)
CAP = 4096  # production geometry: the masks span 4096 + q_len + 1 key columns whatever the window


needs_uid = pytest.mark.skipif(
    GRAPH_UID_FIX not in built_capabilities(),
    reason="ggml built without ggml_graph_renew_uid: every compute sends the whole graph",
)


@needs_uid
@pytest.mark.parametrize("window", [64, pytest.param(2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("inputs", ["embed", "tokens"])
@pytest.mark.parametrize("n_new", [2, 4])
def test_small_step_sends_only_its_inputs_and_mask_changes(shared_server, window, inputs, n_new):
    cfg = SMALL
    w = DraftWeights.random(cfg, seed=0)
    feats = np.random.default_rng(1).standard_normal((window + 8 * n_new, cfg.fc_in)).astype(np.float32)
    noise = np.zeros((cfg.block_size, cfg.hidden), np.float32)
    embed = (
        np.random.default_rng(2).standard_normal((100, cfg.hidden)).astype(np.float32) if inputs == "tokens" else None
    )
    ids = np.arange(cfg.block_size, dtype=np.int32)
    with (
        CountingRelay(shared_server.port) as relay,
        Backend(f"rpc:127.0.0.1:{relay.port}") as be,
        w.to_backend(be, "f16") as bw,
        DraftKvCache(bw, be, CAP, embed_tokens=embed) as cache,
    ):
        ring = FeatureRing(CAP, cfg.fc_in)
        committed = window - 4 * n_new
        ring.append(feats[:committed])
        sent = []
        for _ in range(5):
            ring.append(feats[committed : committed + n_new])
            committed += n_new
            mark = relay.snapshot()
            if embed is None:  # the bonus token's embedding changes, the mask token's rows repeat
                noise[0] = np.random.default_rng(committed).standard_normal(cfg.hidden)
                cache.step(ring, committed, noise)
            else:
                cache.step_tokens(ring, committed, ids, output="hidden")
            sent.append(relay.since(mark)[0])
        whole_mask = cache.mask_full.nbytes
    steady = int(np.median(sent[1:]))
    payload = n_new * cfg.fc_in * 4 + (cfg.hidden * 4 if embed is None else 0)  # features, the changed noise row
    overhead = steady - payload  # masks, positions, message headers, the graph recompute command
    assert overhead < 4 * 1024 < whole_mask // 100, (steady, payload)  # measured ~2.5 KiB
    # the goal (a steady step: a round accepting 1-3 drafts); the features are 20 KiB per
    # new position (f32, as captured), so at 9 new positions a step sends ~186 KiB
    assert steady <= 100_000


def _compute_and_read(relay, graph, be, out):
    mark = relay.snapshot()
    graph.compute(be)
    value = out.numpy()  # waits for the compute: its bytes have passed the relay
    return relay.since(mark)[0], value


@needs_uid
def test_graph_changed_since_its_last_compute_is_sent_again(shared_server):
    """The uid promises the server's copy is current: a graph grown by expand or placed again by
    its allocator (here after a bigger graph made the allocator free its buffer) gets a new one,
    so the server computes the new graph, not its stale copy with freed addresses."""
    with (
        CountingRelay(shared_server.port) as relay,
        Backend(f"rpc:127.0.0.1:{relay.port}") as be,
        Context(n_tensors=2) as ctx,
        Context(n_tensors=16, graph_size=16) as g,
        Context(n_tensors=8, graph_size=8) as g2,
    ):
        a = ctx.new_tensor("f32", 64, 4)
        big = ctx.new_tensor("f32", 4096, 16)
        av = np.arange(256, dtype=np.float32).reshape(4, 64)
        with Buffer.alloc_ctx_tensors(ctx, be), Gallocr(be) as galloc:
            a.set(av)
            big.set(np.ones((16, 4096), np.float32))
            graph = Graph(g, 16)
            out = graph.expand(g.scale(g.add(a, a), 2.0))
            galloc.alloc_graph(graph)
            whole, v = _compute_and_read(relay, graph, be, out)
            np.testing.assert_array_equal(v, 4 * av)
            again, v = _compute_and_read(relay, graph, be, out)  # unchanged: the recompute command
            np.testing.assert_array_equal(v, 4 * av)
            assert again < whole - 500, (again, whole)
            a.set(av + 1)  # new contents, same graph: still a recompute
            again2, v = _compute_and_read(relay, graph, be, out)
            np.testing.assert_array_equal(v, 4 * (av + 1))
            assert again2 <= again + av.nbytes + 200, (again2, again)
            # grown: the server must see the new node
            out2 = graph.expand(g.scale(out, -1.0))
            galloc.alloc_graph(graph)
            grown, v2 = _compute_and_read(relay, graph, be, out2)
            np.testing.assert_array_equal(v2, -4 * (av + 1))
            assert grown > again + 500, (grown, again)
            # placed again: a bigger graph frees the allocator's buffer (graph detached), then
            # this graph is allocated anew and computed with no other graph in between
            big_graph = Graph(g2, 8)
            big_graph.expand(g2.scale(g2.add(big, big), 3.0))
            galloc.reserve(big_graph)
            with pytest.raises(GGMLError):
                graph.compute(be)
            galloc.alloc_graph(graph)
            a.set(av + 2)
            moved, v2 = _compute_and_read(relay, graph, be, out2)
            np.testing.assert_array_equal(v2, -4 * (av + 2))
            assert moved > again + 500, (moved, again)
