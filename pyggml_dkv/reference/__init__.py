"""A pure-numpy reference of one DFlash draft step (docs/design.md, "The drafter") over an explicit
context window.

This module is the readable statement of the math: no ggml, no cache, no tricks. Every tensor is
a numpy array in row-major "one row per token" layout, i.e. the transpose of ggml's
`[ne0, ne1]` notation:

    features      (ctx_len, fc_in)           target_hidden_cat, one row per context token
    fused         (ctx_len, hidden)          step 1 (fuse)
    noise_embed   (q_len, hidden)            the draft block's token embeddings
    Q             (q_len, n_head, head_dim)
    K, V          (rows, n_head_kv, head_dim)
    weights       PyTorch (out, in) layout, so `y = x @ W.T`

Positions: context row i sits at `ctx_positions[i]` (absolute, or window-rebased: only the
differences matter for RoPE); noise row j sits at `committed + j`.

Sliding-window flavours (`swa=`), for layers whose type is "sliding":

* ``"seed"`` (default, the C++ seed's rule): the context window is anchored at `committed` and is the
  same for every query row: context key at position p is visible iff
  ``committed - eff <= p < committed`` with ``eff = swa_window if 0 < swa_window < win else win``
  (``win`` = number of context rows given). Noise keys are causal (query j sees noise 0..j).
* ``"per_row"``: what the PyTorch reference (`dflash` package, ``dflash/model.py``,
  ``_attention_mask``) does. Its sliding layers are causal (``is_causal`` defaults to
  ``layer_type == "sliding_attention"``) and every key, context or noise, is windowed per query
  row: query row j (position ``q = committed + j``) sees key position k iff
  ``k <= q and q - k < swa_window``. Context keys: ``p > committed + j - swa_window``
  (row 0 sees the last ``swa_window - 1`` context positions); noise keys: ``i <= j`` and
  ``j - i < swa_window``. (dflash's key positions are cache indices, which equal absolute
  positions because its cache holds positions 0..committed-1 contiguously.)
* ``"llama"``: what llama.cpp runs (docs/dflash2.md, section 4: "per-row window, non-causal"): its
  DFlash attention is non-causal and a sliding layer drops exactly the keys with
  ``q - k >= swa_window``, context and noise alike. Query row j (position ``q = committed + j``)
  sees context key position p iff ``q - p < swa_window``, and every noise key at or ahead of it,
  plus the noise keys behind it that are less than ``swa_window`` rows back.
* ``"off"``: sliding layers are treated exactly like full layers.

Full layers (every flavour): every given context key and every noise key is visible
(non-causal), as in dflash where full layers get no mask at all.

DFlash-2 configs (`cfg.is_dflash2`, docs/dflash2.md) wrap the attention and the MLP of every
layer in the grouped dynamic causal convolutions of `reference.dflash2` (over the noise rows, one
block; the context rows are never convolved, so the context K/V are DFlash-1's). Q, K and V of
the noise rows then come from the convolved normed input. The convolutions run in float64
whatever `dtype` is; their results are cast back to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..common.checks import is_int
from ..model.config import LAYER_TYPES, DraftConfig
from ..model.weights import DraftWeights
from .dflash2 import conv_sublayer

SwaMode = Literal["seed", "per_row", "llama", "off"]
SWA_MODES: tuple[str, ...] = ("seed", "per_row", "llama", "off")

__all__ = [
    "SWA_MODES",
    "attention",
    "context_kv",
    "decoder_layer",
    "draft_forward",
    "fuse_features",
    "lm_logits",
    "mlp",
    "mlp_normed",
    "project_kv",
    "reference_step",
    "rms_norm",
    "rope_angles",
    "rope_neox",
    "silu",
    "visibility",
    "window_positions",
    "yarn_corr_dims",
    "yarn_ramp",
]


# --------------------------------------------------------------------------------------------
# validation helpers


def _int(name: str, value: object, minimum: int | None = None) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float_array(name: str, x: object, ndim: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf")
    return arr


def _positions(name: str, pos: object, length: int | None = None) -> np.ndarray:
    arr = np.asarray(pos)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name} has {arr.shape[0]} entries, expected {length}")
    return arr.astype(np.int64)


def _dtype(dtype: npt.DTypeLike) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind != "f":
        raise ValueError(f"dtype must be a floating-point type, got {dt}")
    return dt


def _weight(w: DraftWeights, name: str, like: np.ndarray) -> np.ndarray:
    """A parameter in the compute dtype of `like`."""
    return np.asarray(w[name], dtype=like.dtype)


def _layer_weight(w: DraftWeights, layer: int, suffix: str, like: np.ndarray) -> np.ndarray:
    return _weight(w, f"layers.{layer}.{suffix}", like)


def _check_layer(cfg: DraftConfig, layer: object) -> int:
    layer = _int("layer", layer, 0)
    if layer >= cfg.n_layer:
        raise ValueError(f"layer {layer} out of range for n_layer={cfg.n_layer}")
    return layer


# --------------------------------------------------------------------------------------------
# elementwise building blocks


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * w`."""
    x = np.asarray(x)
    w = np.asarray(w, dtype=x.dtype)
    if x.ndim < 1 or w.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {w.shape} does not match the last axis of x {x.shape}")
    mean_sq = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(mean_sq + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid written through tanh so it never overflows."""
    return x * (0.5 * (1.0 + np.tanh(0.5 * x)))


# --------------------------------------------------------------------------------------------
# RoPE (NEOX) with ggml's YaRN


def yarn_corr_dims(cfg: DraftConfig) -> tuple[float, float]:
    """`ggml_rope_yarn_corr_dims` (ggml.c), evaluated in float32 as ggml does.

        corr_dim(n_rot) = n_dims * ln(n_ctx_orig / (n_rot * 2*pi)) / (2 * ln(base))
        low  = MAX(0, floor(corr_dim(beta_fast)))
        high = MIN(n_dims - 1, ceil(corr_dim(beta_slow)))

    With n_ctx_orig == 0 ggml takes ln(0) = -inf, so low = 0 and high = -inf (the C ternary
    macros are reproduced literally, including what they do with -inf / NaN). low is not clamped
    to n_dims - 1, so low > high is possible (huge n_ctx_orig vs. base); ggml's ramp is then 1
    (pure extrapolation) for every pair below low. (HF's linear_ramp_factor would give 0 there.)
    """
    f32 = np.float32
    n_dims = cfg.head_dim

    def corr_dim(n_rot: float) -> np.float32:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = f32(cfg.n_ctx_orig) / (f32(n_rot) * f32(2) * f32(math.pi))
            return f32(n_dims) * np.log(ratio) / (f32(2) * np.log(f32(cfg.rope_theta)))

    start = float(np.floor(corr_dim(cfg.beta_fast)))
    end = float(np.ceil(corr_dim(cfg.beta_slow)))
    low = 0.0 if start < 0 else start  # MAX(0, start)
    high = float(n_dims - 1) if (n_dims - 1) < end else end  # MIN(n_dims - 1, end)
    return low, high


def yarn_ramp(low: float, high: float, n_pairs: int) -> np.ndarray:
    """ggml's `rope_yarn_ramp` for pairs i = 0..n_pairs-1 (i = i0/2): 1 below `low`, 0 above `high`.

    y = (i - low) / MAX(0.001, high - low);   ramp = 1 - MIN(1, MAX(0, y))
    """
    span = high - low
    denom = 0.001 if span < 0.001 else span  # MAX(0.001f, high - low); NaN stays NaN
    with np.errstate(invalid="ignore"):
        y = (np.arange(n_pairs, dtype=np.float64) - low) / denom
        clipped = np.where(y < 0, 0.0, y)  # MAX(0, y)
        clipped = np.where(clipped > 1, 1.0, clipped)  # MIN(1, .)
    return 1.0 - clipped


def rope_angles(pos: np.ndarray, cfg: DraftConfig) -> tuple[np.ndarray, float]:
    """Rotation angles theta (tokens, head_dim/2) and the magnitude scale, as ggml's `rope_yarn`.

        theta_extrap = pos * rope_theta^(-2i/head_dim)
        theta_interp = freq_scale * theta_extrap
        ext_factor == 0:  theta = theta_interp;   mscale = attn_factor
        ext_factor != 0:  mix = ramp(i) * ext_factor
                          theta = theta_interp * (1 - mix) + theta_extrap * mix
                          mscale = attn_factor * (1 + 0.1 * ln(1 / freq_scale))
    cos and sin are both multiplied by mscale (so is the rotated vector).
    """
    pos = _positions("pos", pos)
    n_pairs = cfg.head_dim // 2
    inv_freq = float(cfg.rope_theta) ** (-2.0 * np.arange(n_pairs, dtype=np.float64) / cfg.head_dim)
    theta_extrap = pos[:, None].astype(np.float64) * inv_freq[None, :]
    theta_interp = cfg.freq_scale * theta_extrap
    mscale = float(cfg.attn_factor)
    if cfg.ext_factor != 0.0:
        mix = yarn_ramp(*yarn_corr_dims(cfg), n_pairs) * cfg.ext_factor
        theta = theta_interp * (1.0 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / cfg.freq_scale)
    else:
        theta = theta_interp
    return theta, mscale


def rope_neox(x: np.ndarray, pos: np.ndarray, cfg: DraftConfig) -> np.ndarray:
    """NEOX RoPE: pairs (i, i + head_dim/2) rotated by theta_i(pos), with ggml's YaRN.

    x: (tokens, n_heads, head_dim); pos: (tokens,) ints. Returns an array of x's dtype.
    """
    x = np.asarray(x)
    if x.ndim != 3 or x.shape[2] != cfg.head_dim:
        raise ValueError(f"rope_neox: x must be (tokens, n_heads, head_dim={cfg.head_dim}), got {x.shape}")
    pos = _positions("pos", pos, x.shape[0])
    theta, mscale = rope_angles(pos, cfg)
    cos = (np.cos(theta) * mscale)[:, None, :].astype(x.dtype)
    sin = (np.sin(theta) * mscale)[:, None, :].astype(x.dtype)
    half = cfg.head_dim // 2
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


# --------------------------------------------------------------------------------------------
# the drafter's pieces


def fuse_features(w: DraftWeights, feats: np.ndarray) -> np.ndarray:
    """Step 1 (fuse): `RMSNorm(feats @ fc.T) * hidden_norm` -> (ctx_len, hidden)."""
    cfg = w.cfg
    feats = np.asarray(feats)
    if feats.ndim != 2 or feats.shape[1] != cfg.fc_in:
        raise ValueError(f"feats must be (ctx_len, fc_in={cfg.fc_in}), got {feats.shape}")
    x = feats @ _weight(w, "fc.weight", feats).T
    return rms_norm(x, _weight(w, "hidden_norm.weight", feats), cfg.rms_eps)


def _heads(x: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    return x.reshape(x.shape[0], n_heads, head_dim)


def project_kv(w: DraftWeights, layer: int, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K and V of rows `x` (ctx_len or q_len, hidden) sitting at `positions`.

    K = RoPE(RMSNorm_per_head(x @ wk.T) * k_norm, positions); V = x @ wv.T (no norm).
    Used for both the context rows (fused features) and the noise rows (normed hidden states).
    """
    cfg = w.cfg
    layer = _check_layer(cfg, layer)
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != cfg.hidden:
        raise ValueError(f"K/V input must be (rows, hidden={cfg.hidden}), got {x.shape}")
    positions = _positions("positions", positions, x.shape[0])
    k = _heads(x @ _layer_weight(w, layer, "self_attn.k_proj.weight", x).T, cfg.n_head_kv, cfg.head_dim)
    v = _heads(x @ _layer_weight(w, layer, "self_attn.v_proj.weight", x).T, cfg.n_head_kv, cfg.head_dim)
    k = rms_norm(k, _layer_weight(w, layer, "self_attn.k_norm.weight", x), cfg.rms_eps)
    return rope_neox(k, positions, cfg), v


def context_kv(w: DraftWeights, layer: int, fused: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Context K (k_norm'd, roped at `positions`) and V of the fused features, each
    (ctx_len, n_head_kv, head_dim). Row-independent: this is what the ring cache stores."""
    return project_kv(w, layer, fused, positions)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Masked softmax attention with GQA.

    q: (q_len, n_head, hd); k, v: (n_kv_rows, n_head_kv, hd); visible: bool (q_len, n_kv_rows).
    Query head h reads K/V head h // (n_head // n_head_kv); scores are scaled by 1/sqrt(hd) and
    the softmax runs over the visible keys only. Returns (q_len, n_head, hd).
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    visible = np.asarray(visible)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"attention: q, k, v must be 3-D, got {q.shape}, {k.shape}, {v.shape}")
    q_len, n_head, hd = q.shape
    n_kv, n_head_kv, _ = k.shape
    if k.shape != v.shape or k.shape[2] != hd:
        raise ValueError(f"attention: k {k.shape} / v {v.shape} do not fit q {q.shape}")
    if n_head_kv == 0 or n_head % n_head_kv:
        raise ValueError(f"attention: n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")
    if visible.dtype != np.bool_ or visible.shape != (q_len, n_kv):
        raise ValueError(f"attention: visible must be bool ({q_len}, {n_kv}), got {visible.dtype} {visible.shape}")
    if not visible.any(axis=1).all():
        rows = np.flatnonzero(~visible.any(axis=1)).tolist()
        raise ValueError(f"attention: query row(s) {rows} see no key")

    kv_head = np.arange(n_head) // (n_head // n_head_kv)
    k, v = k[:, kv_head, :], v[:, kv_head, :]  # (n_kv, n_head, hd): GQA as head repetition
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = np.where(visible[None, :, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def window_positions(committed: int, cap: int) -> np.ndarray:
    """Absolute positions of the drafter's context window: the last min(committed, cap) before committed."""
    committed = _int("committed", committed, 1)
    cap = _int("cap", cap, 1)
    return np.arange(committed - min(committed, cap), committed, dtype=np.int64)


def visibility(
    cfg: DraftConfig,
    layer_type: str,
    ctx_positions: np.ndarray,
    committed: int,
    q_len: int,
    swa: SwaMode = "seed",
) -> np.ndarray:
    """Which keys each noise query sees: bool (q_len, ctx_len + q_len) over [context ++ noise] keys.

    Query row j sits at position committed + j; noise key i at committed + i; context key c at
    ctx_positions[c] (the caller passes only in-window rows). See the module docstring for the
    `swa` flavours; full layers (and every layer with swa="off") see everything.
    """
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {layer_type!r}")
    if swa not in SWA_MODES:
        raise ValueError(f"swa must be one of {SWA_MODES}, got {swa!r}")
    committed = _int("committed", committed, 1)
    q_len = _int("q_len", q_len, 1)
    ctx = _positions("ctx_positions", ctx_positions)
    q_pos = committed + np.arange(q_len)[:, None]  # (q_len, 1)
    noise_pos = committed + np.arange(q_len)[None, :]  # (1, q_len)

    if layer_type == "full" or swa == "off":
        return np.ones((q_len, ctx.size + q_len), dtype=bool)

    if swa == "seed":
        win = ctx.size
        eff = cfg.swa_window if 0 < cfg.swa_window < win else win
        ctx_vis = (committed - eff <= ctx) & (ctx < committed)  # same for every row
        ctx_vis = np.broadcast_to(ctx_vis[None, :], (q_len, ctx.size))
        noise_vis = noise_pos <= q_pos  # causal
    elif swa == "per_row":  # dflash's _attention_mask for a causal sliding layer

        def windowed(k_pos: np.ndarray) -> np.ndarray:
            return (k_pos <= q_pos) & (q_pos - k_pos < cfg.swa_window)

        ctx_vis = windowed(ctx[None, :])
        noise_vis = windowed(noise_pos)
    else:  # "llama": llama.cpp's non-causal attention, keys dropped by llama_hparams::is_masked_swa

        def windowed(k_pos: np.ndarray) -> np.ndarray:
            return q_pos - k_pos < cfg.swa_window

        ctx_vis = windowed(ctx[None, :])
        noise_vis = windowed(noise_pos)
    return np.concatenate([ctx_vis, noise_vis], axis=1)


def mlp_normed(w: DraftWeights, layer: int, hf: np.ndarray) -> np.ndarray:
    """SwiGLU of an already normed input: `down @ (silu(gate @ hf) * (up @ hf))`."""
    gate = hf @ _layer_weight(w, layer, "mlp.gate_proj.weight", hf).T
    up = hf @ _layer_weight(w, layer, "mlp.up_proj.weight", hf).T
    return (silu(gate) * up) @ _layer_weight(w, layer, "mlp.down_proj.weight", hf).T


def mlp(w: DraftWeights, layer: int, h: np.ndarray) -> np.ndarray:
    """SwiGLU: `down @ (silu(gate @ hf) * (up @ hf))` with `hf = RMSNorm(h) * ffn_norm`."""
    hf = rms_norm(h, _layer_weight(w, layer, "post_attention_layernorm.weight", h), w.cfg.rms_eps)
    return mlp_normed(w, layer, hf)


def _noise_attention(
    w: DraftWeights,
    layer: int,
    hn: np.ndarray,
    fused: np.ndarray,
    ctx_positions: np.ndarray,
    committed: int,
    swa: SwaMode,
) -> np.ndarray:
    """Attention incl. o_proj of the noise rows whose normed input is `hn` (q_len, hidden):
    their Q and their own K/V come from `hn`, the context K/V from the fused features."""
    cfg = w.cfg
    q_len = hn.shape[0]
    noise_pos = committed + np.arange(q_len, dtype=np.int64)
    q = _heads(hn @ _layer_weight(w, layer, "self_attn.q_proj.weight", hn).T, cfg.n_head, cfg.head_dim)
    q = rope_neox(rms_norm(q, _layer_weight(w, layer, "self_attn.q_norm.weight", hn), cfg.rms_eps), noise_pos, cfg)

    k_ctx, v_ctx = context_kv(w, layer, fused, ctx_positions)
    k_noise, v_noise = project_kv(w, layer, hn, noise_pos)
    k = np.concatenate([k_ctx, k_noise], axis=0)
    v = np.concatenate([v_ctx, v_noise], axis=0)

    visible = visibility(cfg, cfg.layer_types[layer], ctx_positions, committed, q_len, swa)
    attn = attention(q, k, v, visible).reshape(q_len, cfg.n_head * cfg.head_dim)
    return attn @ _layer_weight(w, layer, "self_attn.o_proj.weight", hn).T


def _convolved(
    w: DraftWeights, layer: int, conv: str, normed: np.ndarray, sublayer: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """DFlash-2: `sublayer` wrapped in the layer's `conv` ("attention_conv" / "mlp_conv")
    convolutions over the noise block (all rows, one block), in normed's dtype."""
    dt = normed.dtype
    out = conv_sublayer(
        normed,
        w[f"layers.{layer}.{conv}.base_kernel"],
        w[f"layers.{layer}.{conv}.kernel_projection.weight"],
        lambda x: sublayer(x.astype(dt)),  # the sublayer itself computes in the caller's dtype
        w.cfg.conv_group_size,
    )
    return out.astype(dt)


def decoder_layer(
    w: DraftWeights,
    layer: int,
    h: np.ndarray,
    fused: np.ndarray,
    ctx_positions: np.ndarray,
    committed: int,
    swa: SwaMode = "seed",
) -> np.ndarray:
    """One drafter layer on the noise block h (q_len, hidden); returns the new h.

    DFlash-2 (docs/dflash2.md, section 1): the attention and the MLP each read their normed
    input through side 0 of their convolution and write through side 1, before the residual."""
    cfg = w.cfg
    hn = rms_norm(h, _layer_weight(w, layer, "input_layernorm.weight", h), cfg.rms_eps)

    def attend(x: np.ndarray) -> np.ndarray:
        return _noise_attention(w, layer, x, fused, ctx_positions, committed, swa)

    if not cfg.is_dflash2:
        h = h + attend(hn)
        return h + mlp(w, layer, h)
    h = h + _convolved(w, layer, "attention_conv", hn, attend)
    hf = rms_norm(h, _layer_weight(w, layer, "post_attention_layernorm.weight", h), cfg.rms_eps)
    return h + _convolved(w, layer, "mlp_conv", hf, lambda x: mlp_normed(w, layer, x))


def lm_logits(out: np.ndarray, lm_head: np.ndarray, cfg: DraftConfig) -> np.ndarray:
    """`(out @ lm_head.T) * output_multiplier`, then `cap * tanh(logits / cap)` when soft-capped."""
    logits = (out @ np.asarray(lm_head, dtype=out.dtype).T) * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    return logits


def draft_forward(
    w: DraftWeights,
    feats: np.ndarray,
    ctx_positions: np.ndarray | Sequence[int],
    noise_embed: np.ndarray,
    committed: int,
    *,
    swa: SwaMode = "seed",
    lm_head: np.ndarray | None = None,
    dtype: np.dtype | type = np.float64,
) -> np.ndarray:
    """One draft step over an explicit context window.

    feats: (ctx_len, fc_in) target features of the window rows; ctx_positions: (ctx_len,) their
    positions, distinct and in [0, committed); noise_embed: (q_len, hidden); noise row j sits at
    committed + j. Returns the draft hidden states (q_len, hidden), or logits (q_len, vocab) when
    `lm_head` (vocab, hidden) is given. Everything is computed in `dtype`.
    """
    if not isinstance(w, DraftWeights):
        raise ValueError(f"w must be DraftWeights, got {type(w).__name__}")
    cfg = w.cfg
    dt = _dtype(dtype)
    if swa not in SWA_MODES:
        raise ValueError(f"swa must be one of {SWA_MODES}, got {swa!r}")
    committed = _int("committed", committed, 1)

    feats = _float_array("feats", feats, 2)
    if feats.shape[0] < 1 or feats.shape[1] != cfg.fc_in:
        raise ValueError(f"feats must be (ctx_len >= 1, fc_in={cfg.fc_in}), got {feats.shape}")
    ctx = _positions("ctx_positions", ctx_positions, feats.shape[0])
    if ctx.min() < 0 or ctx.max() >= committed:
        raise ValueError(f"ctx_positions must lie in [0, committed={committed}), got [{ctx.min()}, {ctx.max()}]")
    if np.unique(ctx).size != ctx.size:
        raise ValueError("ctx_positions must be distinct")

    noise = _float_array("noise_embed", noise_embed, 2)
    if noise.shape[0] < 1 or noise.shape[1] != cfg.hidden:
        raise ValueError(f"noise_embed must be (q_len >= 1, hidden={cfg.hidden}), got {noise.shape}")

    if lm_head is not None:
        lm_head = _float_array("lm_head", lm_head, 2)
        if lm_head.shape[1] != cfg.hidden or (cfg.vocab is not None and lm_head.shape[0] != cfg.vocab):
            vocab = cfg.vocab if cfg.vocab is not None else "vocab"
            raise ValueError(f"lm_head must be ({vocab}, hidden={cfg.hidden}), got {lm_head.shape}")

    fused = fuse_features(w, feats.astype(dt))
    h = noise.astype(dt)
    for layer in range(cfg.n_layer):
        h = decoder_layer(w, layer, h, fused, ctx, committed, swa)
    out = rms_norm(h, _weight(w, "norm.weight", h), cfg.rms_eps)
    return out if lm_head is None else lm_logits(out, lm_head.astype(dt), cfg)


def reference_step(
    w: DraftWeights,
    all_feats: np.ndarray,
    committed: int,
    cap: int,
    noise_embed: np.ndarray,
    *,
    swa: SwaMode = "seed",
    lm_head: np.ndarray | None = None,
    dtype: np.dtype | type = np.float64,
) -> np.ndarray:
    """The step the cache must reproduce: the window is the last min(committed, cap) positions
    before `committed`, at their absolute positions; all_feats (>= committed, fc_in) holds the
    features of positions 0, 1, ... ."""
    committed = _int("committed", committed, 1)
    cap = _int("cap", cap, 1)
    all_feats = np.asarray(all_feats)
    if all_feats.ndim != 2:
        raise ValueError(f"all_feats must be 2-D (positions, fc_in), got shape {all_feats.shape}")
    if all_feats.shape[0] < committed:
        raise ValueError(f"all_feats has {all_feats.shape[0]} rows, fewer than committed={committed}")
    pos = window_positions(committed, cap)
    return draft_forward(w, all_feats[pos], pos, noise_embed, committed, swa=swa, lm_head=lm_head, dtype=dtype)
