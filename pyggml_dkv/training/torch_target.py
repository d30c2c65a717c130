"""A LLaMA-architecture target (SmolLM2) in PyTorch, read from its GGUF: self-distilled data at GPU scale.

The host pipeline (data.py) captures features through llama.cpp on the CPU, a few hundred tokens
a second. On a GPU this module runs the same weights (dequantized from the GGUF, q/k rows
unpermuted, NEOX RoPE: the same function as llama.cpp's interleaved RoPE on permuted rows) in
float32, batched: generation with a static KV cache and left-padded prompts, and a teacher-forced
pass returning the features of the drafter's target layers (`l_out-i`: the residual stream after
decoder layer i, what our llama.cpp capture reads) and the target's argmax at every position.

It is not llama.cpp. llama.cpp's CPU backend multiplies a quantized weight by activations it first
rounds to 8-bit blocks, and keeps K/V in float16; this module emulates both roundings
(`emulate_q8`) but not llama.cpp's order of summation, so features differ in their last digits
(median relative error 1.8% against the host's capture, SmolLM2 Q4_1) and near-tied argmaxes can
differ (98% agree): tests/training/test_gpu_path.py measures both against the host. Drafters
trained on its data are measured with the host's own features (evaluate.py) before anything ships.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from .model import unpermute_llama_qk


@dataclass
class LlamaShape:
    n_layer: int
    hidden: int
    n_head: int
    n_head_kv: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head


class TorchLlama:
    """The target's weights on `device` and its forward pass (no autograd: a frozen teacher)."""

    def __init__(
        self,
        shape: LlamaShape,
        tensors: dict[str, torch.Tensor],
        device: str | torch.device,
        quantized: frozenset[str] = frozenset(),
    ) -> None:
        self.shape = shape
        self.emulate_q8 = True  # round activations as llama.cpp does before quantized products
        self.quantized = quantized  # the weights the GGUF stores quantized (their products round x)
        self.device = torch.device(device)
        self.w = {k: v.to(self.device) for k, v in tensors.items()}
        hd = shape.head_dim
        self.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))

    @classmethod
    def from_gguf(cls, path: str, device: str | torch.device = "cpu") -> TorchLlama:
        """Read and dequantize a llama GGUF with the `gguf` package alone (no ggml: this runs on
        machines where our extension is not built)."""
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import dequantize

        if not Path(path).is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        reader = GGUFReader(path, "r")
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: architecture {arch!r}, this module runs 'llama' targets")
        infos = {t.name: t for t in reader.tensors}

        def value(key: str, default=None):
            v = meta.get(f"llama.{key}", default)
            if v is None:
                raise ValueError(f"{path}: no llama.{key} in the metadata")
            return v

        def array(name: str) -> np.ndarray:
            t = infos[name]
            shape = tuple(int(n) for n in reversed(t.shape))
            return np.array(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)  # a writable copy

        shape = LlamaShape(
            n_layer=int(value("block_count")),
            hidden=int(value("embedding_length")),
            n_head=int(value("attention.head_count")),
            n_head_kv=int(value("attention.head_count_kv")),
            ffn=int(value("feed_forward_length")),
            vocab=int(infos["token_embd.weight"].shape[1]),
            rope_theta=float(value("rope.freq_base", 10000.0)),
            rms_eps=float(value("attention.layer_norm_rms_epsilon")),
        )
        if int(value("rope.dimension_count", shape.head_dim)) != shape.head_dim:
            raise ValueError(f"{path}: partial RoPE is not supported")

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(array(name))

        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
        output = "output.weight" if "output.weight" in infos else "token_embd.weight"  # tied
        quantized = {
            ours
            for ours, theirs in [("output", output)]
            + [
                (f"blk.{i}.{n}", f"blk.{i}.{n}.weight")
                for i in range(shape.n_layer)
                for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
            ]
            if infos[theirs].tensor_type not in plain
        }
        tensors = {"token_embd": t("token_embd.weight"), "output_norm": t("output_norm.weight")}
        tensors["output"] = t(output) if output != "token_embd.weight" else tensors["token_embd"]
        for i in range(shape.n_layer):
            p = f"blk.{i}."
            tensors[p + "attn_q"] = torch.from_numpy(
                np.ascontiguousarray(unpermute_llama_qk(array(p + "attn_q.weight"), shape.n_head))
            )
            tensors[p + "attn_k"] = torch.from_numpy(
                np.ascontiguousarray(unpermute_llama_qk(array(p + "attn_k.weight"), shape.n_head_kv))
            )
            for name in ("attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm"):
                tensors[p + name] = t(p + name + ".weight")
        return cls(shape, tensors, device, frozenset(quantized))

    # --- pieces -------------------------------------------------------------------------------

    def _mm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W.T as llama.cpp's CPU backend computes a quantized product: x rounded to 8-bit
        blocks of 32 (q8_1 / q8_0: scale amax / 127 kept in float16), then an exact-ish dot."""
        if self.emulate_q8 and name in self.quantized and x.shape[-1] % 32 == 0:
            blocks = x.reshape(*x.shape[:-1], -1, 32)
            d = blocks.abs().amax(-1, keepdim=True) / 127.0
            q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1.0), 0.0)
            q = torch.sign(q) * torch.floor(q.abs() + 0.5)  # roundf: half away from zero
            x = (q * d.half().float()).reshape(x.shape)
        return x @ self.w[name].T

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.rms_eps) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.double()[..., None] * self.inv_freq.to(positions.device)  # (B, T, hd/2)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos().float()[:, None], ang.sin().float()[:, None]  # (B, 1, T, hd)

    # --- forward ------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        cache: KVCache | None = None,
        slot0: int = 0,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final hidden states (B, T, hidden) after the output norm, and the residual stream
        after each layer in `capture`. `visible` (B, T, S) says which keys each query sees: the
        S = slot0 + T cache slots with a cache, else the T tokens themselves."""
        s = self.shape
        b, n = tokens.shape
        x = F.embedding(tokens, self.w["token_embd"])
        cos, sin = self._cos_sin(positions)
        mask = visible[:, None]
        captured = []
        for i in range(s.n_layer):
            p = f"blk.{i}."
            h = self._norm(x, self.w[p + "attn_norm"])
            q = (self._mm(h, p + "attn_q")).view(b, n, s.n_head, s.head_dim).transpose(1, 2)
            k = (self._mm(h, p + "attn_k")).view(b, n, s.n_head_kv, s.head_dim).transpose(1, 2)
            v = (self._mm(h, p + "attn_v")).view(b, n, s.n_head_kv, s.head_dim).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if self.emulate_q8:  # llama.cpp keeps K/V in float16 and rounds Q to float16 for K.Q
                q, k, v = q.half().float(), k.half().float(), v.half().float()
            if cache is not None:
                k, v = cache.write(i, slot0, k, v)
            rep = s.n_head // s.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(s.head_dim))
            x = x + self._mm(att.transpose(1, 2).reshape(b, n, s.hidden), p + "attn_output")
            h = self._norm(x, self.w[p + "ffn_norm"])
            x = x + self._mm(F.silu(self._mm(h, p + "ffn_gate")) * self._mm(h, p + "ffn_up"), p + "ffn_down")
            if i in capture:
                captured.append(x)
        return self._norm(x, self.w["output_norm"]), captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._mm(hidden, "output")


class KVCache:
    """Per-layer K/V for `batch` sequences of up to `slots` positions (filled left to right)."""

    def __init__(self, model: TorchLlama, batch: int, slots: int) -> None:
        s = model.shape
        shape = (s.n_layer, batch, s.n_head_kv, slots, s.head_dim)
        self.k = torch.zeros(shape, device=model.device)
        self.v = torch.zeros(shape, device=model.device)

    def write(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = slot0 + k.shape[2]
        self.k[layer, :, :, slot0:end] = k
        self.v[layer, :, :, slot0:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def left_pad(prompts: list[np.ndarray], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (B, T), valid (B, T)) with each prompt right-aligned."""
    width = max(p.size for p in prompts)
    tokens = np.full((len(prompts), width), pad, np.int64)
    valid = np.zeros((len(prompts), width), bool)
    for r, p in enumerate(prompts):
        tokens[r, width - p.size :] = p
        valid[r, width - p.size :] = True
    return tokens, valid


@torch.no_grad()
def generate(
    model: TorchLlama,
    prompts: list[np.ndarray],
    max_new: int,
    eog: set[int],
    *,
    temperature: float | list[float] = 0.0,
    sample_first: int | None = None,
    generator: torch.Generator | None = None,
) -> list[np.ndarray]:
    """Continue every prompt, batched: up to `max_new` tokens each, stopping after (and keeping)
    an end-of-generation token. temperature 0 is greedy; with `sample_first`, only the first
    that many tokens are sampled and the rest greedy (the data's "warm" kind). Returns the new
    tokens of each prompt."""
    dev = model.device
    tok_np, valid_np = left_pad(prompts)
    b, t0 = tok_np.shape
    tokens = torch.from_numpy(tok_np).to(dev)
    valid = torch.from_numpy(valid_np).to(dev)
    slots = t0 + max_new
    key_valid = torch.zeros((b, slots), dtype=torch.bool, device=dev)
    key_valid[:, :t0] = valid
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    causal = torch.ones((t0, t0), dtype=torch.bool, device=dev).tril()
    visible = causal[None] & valid[:, None, :]
    visible |= torch.eye(t0, dtype=torch.bool, device=dev)[None]  # padded queries see themselves (no NaN)
    cache = KVCache(model, b, slots)
    hidden, _ = model.forward(tokens, positions, visible, cache, 0)
    last = hidden[:, -1]
    next_pos = positions[:, -1] + 1
    out = torch.zeros((b, max_new), dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    lengths = torch.zeros(b, dtype=torch.long, device=dev)
    eog_t = torch.tensor(sorted(eog), device=dev)
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(b)
    for step in range(max_new):
        logits = model.logits(last)
        sampled = temps > 0
        if sample_first is not None and step >= sample_first:
            sampled = torch.zeros_like(sampled)
        nxt = logits.argmax(-1)
        if bool(sampled.any()):
            probs = torch.softmax(logits / temps.clamp_min(1e-6)[:, None], dim=-1)
            draw = torch.multinomial(probs, 1, generator=generator)[:, 0]
            nxt = torch.where(sampled, draw, nxt)
        out[:, step] = nxt
        lengths += (~done).long()
        done |= torch.isin(nxt, eog_t)
        if bool(done.all()) or step == max_new - 1:
            break
        slot = t0 + step
        key_valid[:, slot] = True
        hidden, _ = model.forward(nxt[:, None], next_pos[:, None], key_valid[:, None, : slot + 1], cache, slot)
        last = hidden[:, -1]
        next_pos = next_pos + 1
    out_np, len_np = out.cpu().numpy(), lengths.cpu().numpy()
    return [out_np[r, : len_np[r]].copy() for r in range(b)]


@torch.no_grad()
def features_and_argmax(
    model: TorchLlama, sequences: list[np.ndarray], layers: tuple[int, ...], feature_dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    """Teacher-forced pass over whole sequences (right-padded, batched): per sequence its features
    (n, len(layers) * hidden) on the model's device and the target's argmax after each prefix (n,)."""
    dev = model.device
    width = max(s.size for s in sequences)
    b = len(sequences)
    tok = np.zeros((b, width), np.int64)
    for r, s in enumerate(sequences):
        tok[r, : s.size] = s
    tokens = torch.from_numpy(tok).to(dev)
    positions = torch.arange(width, device=dev)[None].expand(b, width)
    visible = torch.ones((width, width), dtype=torch.bool, device=dev).tril()[None].expand(b, width, width)
    hidden, captured = model.forward(tokens, positions, visible, capture=layers)
    feats = torch.cat(captured, dim=-1).to(feature_dtype)
    argmax = model.logits(hidden).argmax(-1).cpu().numpy()
    return (
        [feats[r, : s.size] for r, s in enumerate(sequences)],
        [argmax[r, : s.size].astype(np.int32) for r, s in enumerate(sequences)],
    )
