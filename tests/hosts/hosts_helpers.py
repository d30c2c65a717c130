"""Shared pieces of the llama.cpp host tests (not collected: no test_ prefix)."""

from __future__ import annotations

import os

import numpy as np
import pytest

THREADS = int(os.environ.get("PYGGML_DKV_TEST_THREADS", "1"))
PROMPTS = (
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a child.",
)


def smollm2_path():
    from pyggml_dkv.hosts.smollm2 import ModelUnavailableError, smollm2_gguf

    try:
        return smollm2_gguf()
    except ModelUnavailableError as exc:  # offline without a cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rope_norm(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i+1). x (n, heads, head_dim)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-np.arange(0, d, 2) / d)  # (n, d/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def llama_layer(gguf, il: int, x: np.ndarray) -> np.ndarray:
    """Decoder layer `il` of a llama-architecture GGUF in float64 numpy, over a whole causal
    sequence at positions 0..n-1: x (n, hidden) in, layer output (n, hidden) out."""
    arch = gguf.arch_value
    eps = float(arch("attention.layer_norm_rms_epsilon"))
    n_head, n_kv = int(arch("attention.head_count")), int(arch("attention.head_count_kv"))
    base = float(arch("rope.freq_base"))

    def w(name: str) -> np.ndarray:
        return gguf.array(f"blk.{il}.{name}.weight").astype(np.float64)

    x = x.astype(np.float64)
    n, hidden = x.shape
    hd = hidden // n_head
    pos = np.arange(n, dtype=np.float64)
    h = rms_norm(x, w("attn_norm"), eps)
    q = rope_norm((h @ w("attn_q").T).reshape(n, n_head, hd), pos, base)
    k = rope_norm((h @ w("attn_k").T).reshape(n, n_kv, hd), pos, base)
    v = (h @ w("attn_v").T).reshape(n, n_kv, hd)
    group = n_head // n_kv
    causal = np.tril(np.ones((n, n), dtype=bool))
    att = np.empty((n, n_head, hd))
    for head in range(n_head):
        kv = head // group
        s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        att[:, head] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv]
    x = x + att.reshape(n, hidden) @ w("attn_output").T
    f = rms_norm(x, w("ffn_norm"), eps)
    g = f @ w("ffn_gate").T
    return x + ((g / (1 + np.exp(-g))) * (f @ w("ffn_up").T)) @ w("ffn_down").T


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
