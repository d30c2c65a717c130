"""What this ggml build and this machine offer: backends, devices, CPU buffer types, and which of our
fixes and kernels the build carries (built_capabilities: the extension's C query, pyggml_dkv_kernels)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _lowlevel
from ._lowlevel import ffi, lib


@dataclass(frozen=True)
class BackendInfo:
    name: str  # what Backend() accepts: "cpu", "cuda:0", "rpc"
    available: bool
    description: str
    reason: str | None = None  # why it is unavailable

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable: {self.reason}"
        return f"<{self.name}: {self.description} ({state})>"


def built_backends() -> list[str]:
    """Backends compiled into this ggml build."""
    names = ["cpu"]
    if hasattr(lib, "ggml_backend_cuda_init"):
        names.append("cuda")
    if hasattr(lib, "ggml_backend_rpc_init"):
        names.append("rpc")
    return names


def cuda_device_count() -> int:
    return int(lib.ggml_backend_cuda_get_device_count()) if hasattr(lib, "ggml_backend_cuda_init") else 0


def cuda_graph_stats(reset: bool = False) -> dict[str, int]:
    """What ggml's CUDA backend reported about CUDA graphs since the last reset: warm-ups completed
    (a graph was captured: later identical computes replay it silently), warm-up resets (the graph
    changed between computes), failed updates, graphs disabled, and "reused" (scheduler graphs with
    a uid only). All zero on other backends, or with GGML_CUDA_DISABLE_GRAPHS=1."""
    stats = dict(_lowlevel.cuda_graph_events)
    if reset:
        for key in _lowlevel.cuda_graph_events:
            _lowlevel.cuda_graph_events[key] = 0
    return stats


def available_backends() -> list[BackendInfo]:
    """What this build and this machine can run. CPU always; CUDA and RPC with the reason when not."""
    cpu_dev = lib.ggml_backend_dev_by_name(b"CPU")
    cpu_desc = ffi.string(lib.ggml_backend_dev_description(cpu_dev)).decode() if cpu_dev != ffi.NULL else "CPU"
    infos = [BackendInfo("cpu", True, cpu_desc)]
    if "cuda" not in built_backends():
        infos.append(
            BackendInfo(
                "cuda", False, "CUDA", "this ggml build has no CUDA backend (rebuild: GGML_CUDA=1 ./build_ggml.sh)"
            )
        )
    else:
        n = cuda_device_count()
        if n == 0:
            infos.append(
                BackendInfo(
                    "cuda", False, "CUDA", "built with CUDA, but no CUDA device is visible (no GPU or no driver)"
                )
            )
        for i in range(n):
            desc = ffi.new("char[256]")
            lib.ggml_backend_cuda_get_device_description(i, desc, 256)
            infos.append(BackendInfo(f"cuda:{i}", True, ffi.string(desc).decode()))
    if "rpc" in built_backends():
        infos.append(BackendInfo("rpc", True, "RPC client (Backend('rpc:HOST:PORT'))"))
    else:
        infos.append(
            BackendInfo("rpc", False, "RPC", "this ggml build has no RPC backend (rebuild: GGML_RPC=1 ./build_ggml.sh)")
        )
    return infos


def list_devices() -> list[dict[str, Any]]:
    """ggml's device registry: name, description, type and memory of every registered device."""
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append(
            {
                "name": ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                "description": ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                "type": int(lib.ggml_backend_dev_type(dev)),
                "registry": ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))).decode(),
                "memory_free": int(free[0]),
                "memory_total": int(total[0]),
            }
        )
    return out


def default_n_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


# The CPU backend's "extra" buffer types rewrite a weight matrix into the layout of a faster kernel
# as it is uploaded (AMX: int8 tiles for q8_0 / q4_0 on Xeons with AMX; CPU_DKV_REPACK: our
# AVX512-VNNI layouts; CPU_REPACK: ggml's interleaved q4_0 / q4_K). Tensors stored there can only
# be written whole and used as the matrix of a matrix product: ggml cannot read them back.
DKV_REPACK_BUFFER_TYPE = "CPU_DKV_REPACK"
REPACKING_BUFFER_TYPES = ("AMX", DKV_REPACK_BUFFER_TYPE, "CPU_REPACK")
# weight types with AMX kernels in ggml (amx/common.h: qtype_has_amx_kernels) that we can quantize
AMX_TYPES = ("q8_0", "q4_0")


def amx_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Can ggml's AMX buffer hold this tensor for its kernels? It sizes and packs every tensor as one
    2-D matrix of whole 32 x 32 blocks (32-value input blocks, 32-column output blocks)."""
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    return type_name.lower() in AMX_TYPES and ne4[0] % 32 == 0 and ne4[1] % 32 == 0 and ne4[2:] == (1, 1)


@functools.cache
def cpu_extra_buffer_types() -> dict[str, Any]:
    """Name -> buffer type of the extra buffer types this CPU offers (e.g. {"AMX": ..., "CPU_REPACK": ...})."""
    reg = lib.ggml_backend_cpu_reg()
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if fn == ffi.NULL:
        return {}
    bufts = ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(lib.ggml_backend_reg_dev_get(reg, 0))
    found: dict[str, Any] = {}
    i = 0
    while bufts != ffi.NULL and bufts[i] != ffi.NULL:
        found[ffi.string(lib.ggml_backend_buft_name(bufts[i])).decode()] = bufts[i]
        i += 1
    return found


@functools.cache
def built_capabilities() -> frozenset[str]:
    """Which of our fixes to ggml and of our kernels this build carries, by name, as the extension's
    C query pyggml_dkv_kernels() reports them (decided when the extension was compiled, from what
    build_ggml.sh applied; none for a GGML_SRC build). The names this package acts on are the
    *_KERNEL / *_FIX constants below; docs/ggml-port-plan.md says which patch or kernel file
    brings each."""
    return frozenset(name for name in ffi.string(lib.pyggml_dkv_kernels()).decode().split(",") if name)


# Fixes to ggml's own code (docs/ggml-port-plan.md, P3 / P5): a killed or frozen RPC server is a
# Python exception, not an abort or a hang; masked non-finite K/V stay out of ggml's tiled attention
RPC_ERRORS_FIX = "rpc-errors"
FA_MASKED_KEYS_FIX = "fa-masked-keys"
# a graph built once carries a uid (ggml_graph_renew_uid), so ggml's RPC client resends only
# GRAPH_RECOMPUTE for it (ggml 0.25.3 reuses a graph by uid; only its scheduler could set one)
GRAPH_UID_FIX = "graph-uid"
# ggml-cpu compiles our kernel files (kernels/) behind their own extra buffer type (P1), and
# that buffer type, "CPU_DKV", is registered (first among cpu_extra_buffer_types())
CPU_DKV_HOOK = "cpu-dkv-hook"
DKV_BUFFER_KERNEL = "dkv-buffer"
DKV_BUFFER_TYPE = "CPU_DKV"
# our repacking buffer type, "CPU_DKV_REPACK" (DKV_REPACK_BUFFER_TYPE, above): the VNNI layouts below
DKV_REPACK_KERNEL = "dkv-repack-buffer"
# ggml's node barrier spins a few pauses, then sleeps on a futex, also in OpenMP builds (P2)
BARRIER_FUTEX = "barrier-futex"
# ggml's argmax runs on every thread (whole rows each), AVX-512 compares (P8)
ARGMAX_ROWS = "argmax-rows"
# f16 weights times up to 64 f32 columns on AVX-512 FMAs (our narrow product; ggml rounds the
# columns to f16). Our narrow products (this, the bf16 and the AVX2 ones below) run for weights in
# the CPU_DKV buffer (weight_buffer: BackendWeights puts f16 / bf16 matrices there on the CPU)
F16_MATMUL_KERNEL = "mm-f16-narrow"
# the weight types our narrow products take in the CPU_DKV buffer
NARROW_WEIGHT_TYPES = ("f16", "bf16")


def ggml_kernels_only_requested() -> bool:
    """PYGGML_DKV_GGML_KERNELS_ONLY=1: place nothing in our buffer types (CPU_DKV, CPU_DKV_REPACK),
    so every op runs ggml's own CPU kernels, as on a server of plain ggml (llama.cpp's
    `ggml-rpc-server`) or for a side-by-side comparison. Read at each placement, like
    PYGGML_DKV_NO_AMX."""
    return os.environ.get("PYGGML_DKV_GGML_KERNELS_ONLY", "") not in ("", "0")


def dkv_buffer_available() -> bool:
    """True when this ggml carries our CPU_DKV extra buffer type (registered with the CPU backend)
    and PYGGML_DKV_GGML_KERNELS_ONLY is not set."""
    return DKV_BUFFER_TYPE in cpu_extra_buffer_types() and not ggml_kernels_only_requested()


def f16_matmul_kernel(ne: tuple[int, ...] = (1024, 1024), n_columns: int = 16) -> str:
    """What a product of f16 weights of shape `ne` (ggml order: inputs, outputs), stored in the
    CPU_DKV buffer, with `n_columns` f32 columns runs on here: "avx512_fma" (whole 16-input blocks,
    up to 64 columns), "avx2_fma" (CPUs without AVX-512: whole 8-input blocks, up to 64 columns) or
    "ggml" (ggml's own f16 path: the columns rounded to f16). Both of ours keep the columns f32."""
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    if ne4[2:] != (1, 1) or n_columns > 64 or not dkv_buffer_available():
        return "ggml"
    if half_matmul_avx2():
        return "avx2_fma" if ne4[0] % 8 == 0 else "ggml"
    if (
        F16_MATMUL_KERNEL in built_capabilities()
        and ne4[0] % 16 == 0
        and lib.ggml_cpu_has_avx512()
        and lib.ggml_cpu_has_f16c()
    ):
        return "avx512_fma"
    return "ggml"


# ggml's AMX kernels are only safe with our fix (P4: without it, a GCC 12 build dies with SIGILL
# at the first tile instruction; oneDNN releasing the tiles did the same)
AMX_KERNEL = "amx-tile-config"

# CPU flash attention in f32 64 x 64 tiles from 8 query rows, transposed scores (our attention
# kernel, AVX-512), for K/V in the CPU_DKV buffer (kv_buffer_type: the drafter's caches go there on
# the CPU). ggml tiles only from 64 query rows; below, its per-row kernel sums V in f16.
FA_TILED_KERNEL = "fa-tiled"


# the fewest query rows per head the tiled kernel takes
Q_TILE_ROWS_MIN = 8


def flash_attn_kernel(n_q: int, kv_type: str = "f16", dv: int = 64) -> str:
    """What a flash attention of `n_q` query rows per head over f16 / f32 K/V stored in the CPU_DKV
    buffer runs on here: "tiled" (ours: f32 tiles, 2e-6 of float64) or "ggml" (ggml's own: its tiled
    kernel from 64 rows, its per-row one below)."""
    if (
        FA_TILED_KERNEL in built_capabilities()
        and dkv_buffer_available()
        and n_q >= Q_TILE_ROWS_MIN
        and dv % 16 == 0
        and kv_type in ("f16", "f32")
        and lib.ggml_cpu_has_avx512()
    ):
        return "tiled"
    return "ggml"


# attention="bf16": ggml's precision GGML_PREC_BF16 (ggml 0.25.3 has the value, 15; our patch to
# ggml 0.10.1 added it as 16). Unpatched ggml's CPU flash attention aborts on it; with our patch
# (BF16_ATTENTION_KERNEL) it computes in f32 there, and our tiled kernel (K/V in the CPU_DKV buffer)
# runs its two products with bf16 inputs where the build has them.
BF16_ATTENTION_KERNEL = "fa-bf16"
GGML_PREC_BF16 = int(lib.GGML_PREC_BF16)


def bf16_attention_supported() -> bool:
    """True when the build's CPU flash attention takes GGML_PREC_BF16 (BF16_ATTENTION_KERNEL), so
    attention may be asked for bf16 products (bf16_attention_kernel says where they run; f32 elsewhere)."""
    return BF16_ATTENTION_KERNEL in built_capabilities()


# the tiled kernel's bf16 products with AVX512-BF16 dot products (vdpbf16ps), and on AMX-BF16 tiles
BF16_ATTENTION_AVX512_KERNEL = "fa-bf16-avx512"
BF16_ATTENTION_AMX_KERNEL = "fa-bf16-amx"


def no_amx_requested() -> bool:
    """PYGGML_DKV_NO_AMX=1: take the paths of CPUs without AMX (our patches to ggml read it too)."""
    return os.environ.get("PYGGML_DKV_NO_AMX", "") not in ("", "0")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo; empty where it cannot be read):
    what the CPU has, whatever ggml was compiled for (cpu_features)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def amx_bf16_usable() -> bool:
    """AMX-BF16 tiles on this CPU, and PYGGML_DKV_NO_AMX not set (our bf16 attention and products use them)."""
    return "amx_bf16" in cpu_flags() and not no_amx_requested()


def bf16_attention_kernel() -> str:
    """What attention="bf16" (GGML_PREC_BF16) runs its two products on here, for K/V in the CPU_DKV
    buffer (the drafter's caches), head sizes multiples of 32 and 8+ query rows: "amx" (AMX-BF16
    tiles), "avx512_bf16" (vdpbf16ps) or "f32" (no bf16 products: f32 throughout)."""
    if not bf16_attention_supported() or flash_attn_kernel(Q_TILE_ROWS_MIN) != "tiled":
        return "f32"
    kernels = built_capabilities()
    if BF16_ATTENTION_AMX_KERNEL in kernels and amx_bf16_usable():
        return "amx"
    if BF16_ATTENTION_AVX512_KERNEL in kernels and lib.ggml_cpu_has_avx512_bf16():
        return "avx512_bf16"
    return "f32"


# bf16 weights times a draft block's few columns: on AMX-BF16 tiles, else with AVX512-BF16 dot
# products (columns rounded to bf16, f32 sums) or on f32 FMAs (exact bf16 weights x f32 columns,
# f32 sums), by the CPU's vendor (bf16_products_on_fma)
BF16_MATMUL_KERNEL = "mm-bf16-dpbf16"
BF16_MATMUL_AMX_KERNEL = "mm-bf16-amx"
BF16_MATMUL_FMA_KERNEL = "mm-bf16-fma"
# f16 and bf16 weights times a few f32 columns on CPUs with AVX2 but no AVX-512 (the f16 and bf16
# FMA kernels' arithmetic in 8-wide registers)
HALF_MATMUL_AVX2_KERNEL = "mm-half-avx2"
BF16_PRODUCTS_ENV = "PYGGML_DKV_BF16_PRODUCTS"
BF16_PRODUCTS_CHOICES = ("fma", "dpbf16")


def bf16_products_requested() -> str | None:
    """PYGGML_DKV_BF16_PRODUCTS: "fma" or "dpbf16" forces how bf16 weights without AMX tiles are
    multiplied (our bf16 kernel reads it too); unset or empty: the CPU's rule. Raises ValueError on
    any other value (ggml would silently take the default)."""
    value = os.environ.get(BF16_PRODUCTS_ENV, "")
    if value == "":
        return None
    if value not in BF16_PRODUCTS_CHOICES:
        raise ValueError(
            f"{BF16_PRODUCTS_ENV}={value!r}: expected one of {', '.join(BF16_PRODUCTS_CHOICES)} (or unset)"
        )
    return value


def bf16_products_on_fma() -> bool:
    """Whether bf16 weights without AMX tiles are multiplied on f32 FMAs rather than with
    vdpbf16ps, as our bf16 kernel decides: vdpbf16ps runs at twice the FMA's multiply-adds on AMD's
    Zen 4 / Zen 5 and at half of them on Intel's Sapphire / Emerald Rapids, so AMD keeps vdpbf16ps and
    every other CPU takes the FMAs (the only choice where AVX512-BF16 is missing);
    PYGGML_DKV_BF16_PRODUCTS overrides (dpbf16 only where the CPU has it)."""
    forced = bf16_products_requested()
    if not lib.ggml_cpu_has_avx512_bf16():
        return True
    if forced is not None:
        return forced == "fma"
    return "AuthenticAMD" not in cpu_flags()


def half_matmul_avx2() -> bool:
    """True where ggml was built for AVX2 / FMA / F16C without AVX-512 and carries our 8-wide kernel
    (HALF_MATMUL_AVX2_KERNEL): f16 and bf16 weights times up to 64 f32 columns then run it."""
    return (
        HALF_MATMUL_AVX2_KERNEL in built_capabilities()
        and not lib.ggml_cpu_has_avx512()
        and bool(lib.ggml_cpu_has_avx2() and lib.ggml_cpu_has_fma() and lib.ggml_cpu_has_f16c())
    )


def bf16_matmul_kernel(ne: tuple[int, ...] = (1024, 1024), n_columns: int = 16) -> str:
    """What a product of bf16 weights of shape `ne` (ggml order: inputs, outputs), stored in the
    CPU_DKV buffer, with `n_columns` f32 columns runs on here: "amx" (AMX-BF16 tiles: whole 32-input blocks and 16-row groups, up to
    64 columns), "avx512_bf16" (vdpbf16ps: whole 32-input blocks, up to 64 columns), "avx512_fma"
    (f32 FMAs: whole 32-input blocks, up to 64 columns), "avx2_fma" (8-wide f32 FMAs on CPUs without
    AVX-512: whole 16-input blocks, up to 64 columns) or "ggml" (ggml's own bf16 path: llamafile /
    its dot products)."""
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    kernels = built_capabilities()
    if ne4[2:] != (1, 1) or n_columns > 64 or not dkv_buffer_available():
        return "ggml"
    if half_matmul_avx2():
        return "avx2_fma" if ne4[0] % 16 == 0 else "ggml"
    if ne4[0] % 32 != 0:
        return "ggml"
    dpbf16 = BF16_MATMUL_KERNEL in kernels and bool(lib.ggml_cpu_has_avx512_bf16())
    if dpbf16 and amx_bf16_usable() and BF16_MATMUL_AMX_KERNEL in kernels and ne4[1] % 16 == 0:
        return "amx"
    fma = BF16_MATMUL_FMA_KERNEL in kernels and bool(lib.ggml_cpu_has_avx512() and lib.ggml_cpu_has_f16c())
    if fma and bf16_products_on_fma():
        return "avx512_fma"
    return "avx512_bf16" if dpbf16 else "ggml"


def amx_available() -> bool:
    """True when ggml was built with (fixed) AMX kernels and this CPU and kernel let us use them."""
    if no_amx_requested() or AMX_KERNEL not in built_capabilities():
        return False
    return "AMX" in cpu_extra_buffer_types()


# q8_0 weights repacked for our AVX512-VNNI kernel in our repacking buffer (CPU_DKV_REPACK): the
# fast q8_0 path of CPUs without AMX (AMD Zen 4/5, Intel Ice Lake .. Cascade Lake with VNNI). Its
# layout groups 16 output rows, so matrices need out % 16 == 0 and in % 32 == 0 (vnni_fits).
VNNI_KERNEL = "vnni-q8_0"


def vnni_available() -> bool:
    """True when ggml carries the VNNI q8_0 kernel (VNNI_KERNEL) in our CPU_DKV_REPACK buffer type
    and was compiled for AVX512-VNNI (and PYGGML_DKV_GGML_KERNELS_ONLY is not set)."""
    return (
        not ggml_kernels_only_requested()
        and VNNI_KERNEL in built_capabilities()
        and bool(lib.ggml_cpu_has_avx512_vnni())
        and DKV_REPACK_BUFFER_TYPE in cpu_extra_buffer_types()
    )


# Wide q8_0 products (from 64 rows: a bulk append's, the one-shot graph's context rows) of the
# VNNI layout on AMX-INT8 tiles (kernels/mm-amx-q8_0.cpp): one repacked copy of a matrix
# serves a step's few rows on VNNI and a prompt's hundreds on AMX, with the same bits.
Q8_0_AMX_KERNEL = "mm-amx-q8_0"


def q8_0_wide_on_our_amx() -> bool:
    """True when our q8_0 VNNI layout multiplies its wide products on AMX tiles here (the kernel
    built, the VNNI kernel available, AMX usable and not vetoed by PYGGML_DKV_NO_AMX)."""
    return vnni_available() and Q8_0_AMX_KERNEL in built_capabilities() and amx_available()


# ggml's own kernels in the CPU_REPACK buffer on x86 (src/ggml-cpu/repack.cpp,
# ggml_repack_get_optimal_repack_type): 4-bit weights interleaved 8 output rows at a time, multiplied
# with the activations quantized to q8_0 / q8_K (AVX2, AVX-512 where built for it). llama.cpp puts
# these types there by default; without them a q4 drafter ran at less than half llama.cpp's speed.
# Type -> the CPU feature ggml asks for. (ggml has such kernels for iq4_nl, mxfp4 and q2_K too; no
# drafter format of ours produces them, so they are not vouched for here.)
GGML_REPACK_TYPES = {"q4_0": "avx2", "q4_k": "avx2"}


def ggml_repack_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Does ggml's CPU_REPACK buffer have one of its own layouts (GGML_REPACK_TYPES) for this tensor on
    this CPU: a 2-D matrix of a listed type, whole 8-row groups, the CPU feature present? Any tensor
    placed there without a layout would crash ggml on upload."""
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    feature = GGML_REPACK_TYPES.get(type_name.lower())
    return (
        feature is not None
        and ne4[1] % 8 == 0
        and ne4[2:] == (1, 1)
        and bool(getattr(lib, f"ggml_cpu_has_{feature}")())
        and "CPU_REPACK" in cpu_extra_buffer_types()
    )


# Our other layouts for that VNNI scheme, in the same buffer (CPU_DKV_REPACK): q6_K (the head and some matrices of
# Q4_K_M drafters; the codes one per byte), q4_K (most of a Q4_K_M drafter's matrices), q5_K and
# q4_0. Each takes 2-D matrices of whole blocks and 16-row groups; other whole 8-row groups of
# q4_0 / q4_K go to ggml's own AVX2 layouts (its CPU_REPACK buffer).
Q6_VNNI_KERNEL = "vnni-q6_k"
Q4_VNNI_KERNEL = "vnni-q4_k"
Q5_VNNI_KERNEL = "vnni-q5_k"
Q4_0_VNNI_KERNEL = "vnni-q4_0"
# type -> (kernel, values per block)
VNNI_LAYOUTS = {
    "q8_0": (VNNI_KERNEL, 32),
    "q4_0": (Q4_0_VNNI_KERNEL, 32),
    "q6_k": (Q6_VNNI_KERNEL, 256),
    "q4_k": (Q4_VNNI_KERNEL, 256),
    "q5_k": (Q5_VNNI_KERNEL, 256),
}


def vnni_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Has this tensor the shape our VNNI layouts take (VNNI_LAYOUTS: a listed type, 2-D, whole
    blocks, 16-row groups), whatever this CPU and build offer?"""
    type_name = type_name.lower()
    if type_name not in VNNI_LAYOUTS:
        return False
    ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
    return ne4[0] % VNNI_LAYOUTS[type_name][1] == 0 and ne4[1] % 16 == 0 and ne4[2:] == (1, 1)


def vnni_repack_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Can our CPU_DKV_REPACK buffer hold this tensor for one of our VNNI kernels here: vnni_fits,
    the type's kernel built, AVX512-VNNI?"""
    return vnni_fits(type_name, ne) and vnni_available() and VNNI_LAYOUTS[type_name.lower()][0] in built_capabilities()


def cpu_repack_buffer(type_name: str, ne: tuple[int, ...]) -> str | None:
    """The repacking CPU buffer type (no AMX) this tensor goes to here: CPU_DKV_REPACK for one of our
    VNNI kernels (vnni_repack_fits), else CPU_REPACK for ggml's own interleaved q4_0 / q4_K ones
    (ggml_repack_fits), else None. Type names in any case ("q4_k", "q4_K")."""
    if vnni_repack_fits(type_name, ne):
        return DKV_REPACK_BUFFER_TYPE
    if ggml_repack_fits(type_name, ne):
        return "CPU_REPACK"
    return None


def cpu_repack_kernel(type_name: str, ne: tuple[int, ...]) -> str | None:
    """The kernel this tensor would be laid out for here in a repacking CPU buffer (cpu_repack_buffer),
    in words, or None when neither holds it: one of our VNNI kernels (VNNI_LAYOUTS, CPU_DKV_REPACK),
    else ggml's own interleaved ones for q4_0 / q4_K (CPU_REPACK). Type names in any case."""
    type_name = type_name.lower()
    if vnni_repack_fits(type_name, ne):
        return f"{type_name.replace('_k', '_K')} VNNI ({VNNI_LAYOUTS[type_name][0]})"
    if ggml_repack_fits(type_name, ne):
        return f"ggml's {type_name.replace('_k', '_K')} 8x8 ({GGML_REPACK_TYPES[type_name].upper()})"
    return None


def cpu_repack_fits(type_name: str, ne: tuple[int, ...]) -> bool:
    """Will a repacking CPU buffer (CPU_DKV_REPACK or CPU_REPACK) lay this tensor out for a kernel
    here (cpu_repack_buffer)?"""
    return cpu_repack_buffer(type_name, ne) is not None


def cpu_repack_takes(buffer: str) -> str:
    """What the `buffer` repacking CPU buffer ("CPU_DKV_REPACK", "CPU_REPACK") takes on this CPU, in
    words (for error messages)."""
    if buffer == DKV_REPACK_BUFFER_TYPE:
        kinds = [
            f"{t} with whole {block}-value blocks and 16-row groups (VNNI)"
            for t, (kernel, block) in VNNI_LAYOUTS.items()
            if vnni_available() and kernel in built_capabilities()
        ]
    else:
        kinds = [
            f"{t} with whole 8-row groups"
            for t, feature in GGML_REPACK_TYPES.items()
            if getattr(lib, f"ggml_cpu_has_{feature}")()
        ]
    return "2-D matrices of " + (", or ".join(kinds) if kinds else "no type")


def cpu_features() -> dict[str, bool]:
    """The SIMD features ggml's CPU backend was compiled for (GGML_NATIVE: those of the build machine),
    and whether AMX is usable now (amx_available: also honours PYGGML_DKV_NO_AMX)."""
    names = ("avx2", "fma", "f16c", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx_int8")
    found = {n: bool(getattr(lib, f"ggml_cpu_has_{n}")()) for n in names}
    found["amx_usable"] = amx_available()
    return found


def version() -> str:
    return ffi.string(lib.ggml_version()).decode()


def load_ggml_matmul_tiles() -> bool:
    """Load the AMX tile configuration ggml's AMX matmuls expect on the calling thread; False (and
    nothing done) where the CPU or kernel offers no AMX tiles.

    For hosts: ggml's matmuls (llama.cpp's too) load it once per thread and trust it after, while
    other code on the same thread may release or replace the tiles (oneDNN, i.e. PyTorch's bf16
    matmuls, releases them; llama.cpp's next batched decode then died of SIGILL). Our own ggml
    needs no call: it reloads its tiles before each use."""
    return bool(lib.pyggml_dkv_load_ggml_matmul_tiles())


def amx_tile_data_in_use() -> bool:
    """Has the calling thread run AMX tile instructions (and not released the tiles since)? False
    where the CPU or kernel offers no AMX tiles. For tests that a product really ran on tiles where
    its bits cannot tell (the q8_0 VNNI layout's AMX products give the VNNI ones' bits): ggml's CPU
    backend computes on the calling thread with one thread."""
    return bool(lib.pyggml_dkv_amx_tile_data_in_use())
