"""A toy target model for the examples: a small causal transformer LM in numpy with a KV cache.

It exposes what a DFlash drafter needs from a target: per processed token, the concatenated
hidden states of its captured layers (`features`, shape (n, n_captured * hidden)), plus its token
embedding and lm_head, which the drafter shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def rms_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, pos: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """NEOX RoPE of x (tokens, heads, head_dim) at integer positions (tokens,)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half) / half)
    ang = pos[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


@dataclass
class ToyTargetConfig:
    vocab: int = 512
    hidden: int = 256
    n_layer: int = 4
    n_head: int = 4
    ffn: int = 512
    captured_layers: tuple[int, ...] = (0, 1, 3)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def fc_in(self) -> int:
        return len(self.captured_layers) * self.hidden


class ToyTarget:
    """Causal LM with random weights; `forward` appends tokens to its KV cache, `truncate` rewinds it."""

    def __init__(self, cfg: ToyTargetConfig | None = None, seed: int = 0) -> None:
        self.cfg = cfg = cfg or ToyTargetConfig()
        rng = np.random.default_rng(seed)
        h = cfg.hidden

        def mat(out: int, inp: int) -> np.ndarray:
            return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

        self.embed_tokens = rng.standard_normal((cfg.vocab, h)).astype(np.float32)
        self.lm_head = mat(cfg.vocab, h) * 4.0  # peaked logits: greedy text with structure
        self.layers = [
            dict(wq=mat(h, h), wk=mat(h, h), wv=mat(h, h), wo=mat(h, h), up=mat(cfg.ffn, h), down=mat(h, cfg.ffn))
            for _ in range(cfg.n_layer)
        ]
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []
        self.truncate(0)

    @property
    def n_past(self) -> int:
        return self.k_cache[0].shape[0]

    def truncate(self, n: int) -> None:
        """Keep the first n processed tokens."""
        if n == 0 or not self.k_cache:
            shape = (0, self.cfg.n_head, self.cfg.head_dim)
            self.k_cache = [np.zeros(shape, np.float32) for _ in range(self.cfg.n_layer)]
            self.v_cache = [np.zeros(shape, np.float32) for _ in range(self.cfg.n_layer)]
            return
        self.k_cache = [k[:n] for k in self.k_cache]
        self.v_cache = [v[:n] for v in self.v_cache]

    def forward(self, tokens: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Process `tokens` after the cached ones: returns (logits (n, vocab), features (n, fc_in))."""
        cfg = self.cfg
        ids = np.asarray(tokens, dtype=np.int64)
        n, past = len(ids), self.n_past
        pos = np.arange(past, past + n)
        x = self.embed_tokens[ids]
        captured = []
        causal = np.tril(np.ones((n, past + n), dtype=bool), k=past)
        for i, L in enumerate(self.layers):
            hn = rms_norm(x)
            q = rope((hn @ L["wq"].T).reshape(n, cfg.n_head, cfg.head_dim), pos)
            k = rope((hn @ L["wk"].T).reshape(n, cfg.n_head, cfg.head_dim), pos)
            v = (hn @ L["wv"].T).reshape(n, cfg.n_head, cfg.head_dim)
            self.k_cache[i] = np.concatenate([self.k_cache[i], k])
            self.v_cache[i] = np.concatenate([self.v_cache[i], v])
            scores = np.einsum("qhd,khd->hqk", q, self.k_cache[i]) / np.sqrt(cfg.head_dim)
            scores = np.where(causal[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", probs, self.v_cache[i]).reshape(n, cfg.hidden)
            x = x + att @ L["wo"].T
            hf = rms_norm(x)
            up = hf @ L["up"].T
            x = x + (up / (1 + np.exp(-up))) @ L["down"].T
            if i in cfg.captured_layers:
                captured.append(x)
        logits = rms_norm(x) @ self.lm_head.T
        return logits.astype(np.float32), np.concatenate(captured, axis=1).astype(np.float32)

    def greedy(self, prompt: list[int], n_new: int) -> list[int]:
        """Plain greedy decoding (the ground truth speculative decoding must reproduce)."""
        self.truncate(0)
        logits, _ = self.forward(prompt)
        out = [int(np.argmax(logits[-1]))]
        while len(out) < n_new:
            logits, _ = self.forward([out[-1]])
            out.append(int(np.argmax(logits[-1])))
        return out
