"""DeltaUpload: the device always ends up holding the last array, sending only what changed."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.ggml import Backend, Buffer, Context
from pyggml_dkv.ggml.delta import DeltaUpload


def masks(rng, rows=64, cols=1056, steps=40):
    """A sliding window of visible columns, like an attention mask over a ring of key slots."""
    neg = np.float16(-np.inf)
    for step in range(steps):
        lo, n = (step * 9) % cols, 200 + step % 50
        live = np.zeros(cols, bool)
        live[(lo + np.arange(n)) % cols] = True
        m = np.where(live, np.float16(0), neg)[None, :].repeat(rows, 0)
        if rng.random() < 0.1:
            m[rng.integers(rows), rng.integers(cols)] = np.float16(1.5)  # a lone change
        yield m


@pytest.mark.parametrize("where", ["cpu", "rpc"])
def test_device_holds_every_array_and_little_is_sent(cpu, shared_server, where):
    backend = cpu if where == "cpu" else Backend(shared_server.spec)
    ctx = Context(n_tensors=2)
    t = ctx.new_tensor("f16", 1056, 64)
    buf = Buffer.alloc_ctx_tensors(ctx, backend)
    up = DeltaUpload(t, enabled=True)
    assert DeltaUpload.for_tensor(t).enabled == (where == "rpc")
    rng = np.random.default_rng(0)
    sent = []
    for i, m in enumerate(masks(rng)):
        up.upload(m)
        assert np.array_equal(t.numpy(), m.astype(np.float32)), f"step {i}"
        sent.append(up.bytes_sent)
    assert sent[0] == t.nbytes
    assert max(sent[1:]) < t.nbytes // 4  # 9 columns in, 9 out per row
    for overwrite in (
        lambda: t.set(np.zeros((64, 1056), np.float32)),  # writes through the binding
        lambda: t.set_bytes(np.zeros(16, np.uint8), offset=t.nbytes - 16),
        lambda: t.fill(7),
        lambda: buf.clear(0),
    ):
        assert up.knows_device
        overwrite()
        assert not up.knows_device
        up.upload(m)  # the same array as last time: must still reach the device whole
        assert up.bytes_sent == t.nbytes and np.array_equal(t.numpy(), m.astype(np.float32))
    for _ in range(3):  # an unchanged upload sends nothing, and the next one still knows the device
        up.upload(m)
        assert up.bytes_sent == 0
    buf.close()
    if where == "rpc":
        backend.close()


def test_many_scattered_changes_fall_back_to_one_upload(cpu):
    ctx = Context(n_tensors=1)
    t = ctx.new_tensor("f32", 512, 8)
    buf = Buffer.alloc_ctx_tensors(ctx, cpu)
    up = DeltaUpload(t, enabled=True)
    a = np.zeros((8, 512), np.float32)
    up.upload(a)
    a[:, ::16] = 1  # a change every 64 bytes: runs would cost more than the whole
    up.upload(a)
    assert up.runs_sent == 1 and up.bytes_sent == t.nbytes
    up.upload(a)
    assert up.bytes_sent == 0
    assert np.array_equal(t.numpy(), a)
    buf.close()
