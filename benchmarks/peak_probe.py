"""Measured peak rate of the SIMD instructions the CPU kernels use (for bench_step.py's roofline).

The roofline of a step should be the time the kernels' own instructions need, not numpy's f32 SGEMM
rate: on a CPU without AMX the q8_0 products run on AVX512-VNNI (vpdpbusd: 64 int8 multiply-adds),
attention on f32 FMAs (vfmadd231ps: 16) or, with attention="bf16", on AVX512-BF16 (vdpbf16ps: 32).
Each probe runs 12 independent accumulator chains of one instruction on registers only (no memory
traffic, latency hidden), on `threads` threads at once, and reports multiply-adds per second summed
over the threads: the ceiling a kernel made of that instruction can reach on this machine now.

The probes are compiled at first use with cffi and the system C compiler (as the package itself is);
where that fails, or the CPU lacks AVX-512, they return None and bench_step.py falls back to the
numpy matmul rate.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

_SRC = r"""
#include <immintrin.h>
#define CHAINS(T) T a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11
#define KEEP __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11))
#define STEP(OP) a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5); \
                 a6 = OP(a6); a7 = OP(a7); a8 = OP(a8); a9 = OP(a9); a10 = OP(a10); a11 = OP(a11); KEEP

__attribute__((target("avx512f,avx512vnni")))
static int probe_vnni_impl(long n) {
    CHAINS(__m512i);
    const __m512i b = _mm512_set1_epi32(0x01010101), c = _mm512_set1_epi32(0x01020304);
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm512_setzero_si512();
#define OPV(x) _mm512_dpbusd_epi32(x, b, c)
    for (long i = 0; i < n; i++) { STEP(OPV); }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a11));
}

__attribute__((target("avx512f")))
static float probe_fma_impl(long n) {
    CHAINS(__m512);
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm512_set1_ps(1.0f);
#define OPF(x) _mm512_fmadd_ps(x, b, c)
    for (long i = 0; i < n; i++) { STEP(OPF); }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a11));
}

__attribute__((target("avx512f,avx512bf16")))
static float probe_bf16_impl(long n) {
    CHAINS(__m512);
    const __m512bh b = (__m512bh) _mm512_set1_epi32(0x3f803f80), c = (__m512bh) _mm512_set1_epi32(0x33d633d6);
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = _mm512_set1_ps(1.0f);
#define OPB(x) _mm512_dpbf16_ps(x, b, c)
    for (long i = 0; i < n; i++) { STEP(OPB); }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a11));
}

int probe_vnni(long n) { return probe_vnni_impl(n); }
float probe_fma(long n) { return probe_fma_impl(n); }
float probe_bf16(long n) { return probe_bf16_impl(n); }

/* reads n bytes (a multiple of 128, 32-byte aligned) once, four 32-byte loads per step folded into
   four accumulators: a read stream, which is what a step does to its weights and K/V */
__attribute__((target("avx2")))
static int probe_read_impl(const char * p, long n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (long i = 0; i < n; i += 128) {
        /* as the kernels do, ask 4 KB ahead as well as the hardware prefetchers (~7% more here) */
        _mm_prefetch(p + i + 4096, _MM_HINT_T0);
        _mm_prefetch(p + i + 4096 + 64, _MM_HINT_T0);
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *) (p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *) (p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *) (p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *) (p + i + 96)));
    }
    const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return _mm256_extract_epi32(a, 0) ^ _mm256_extract_epi32(a, 7);
}

int probe_read(const char * p, long n) { return probe_read_impl(p, n); }

/* the same probes timed inside C (seconds of the loop alone): PeakSampler's rates between timed
   steps are then free of the thread start-up a Python-side timer would add to a short probe */
#include <time.h>
static double probe_now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static volatile float probe_sink;
double timed_vnni(long n) { const double t = probe_now(); probe_sink = (float) probe_vnni_impl(n); return probe_now() - t; }
double timed_fma(long n) { const double t = probe_now(); probe_sink = probe_fma_impl(n); return probe_now() - t; }
double timed_bf16(long n) { const double t = probe_now(); probe_sink = probe_bf16_impl(n); return probe_now() - t; }
double timed_read(const char * p, long n) { const double t = probe_now(); probe_sink = (float) probe_read_impl(p, n); return probe_now() - t; }
"""

# instruction -> (C function, multiply-adds per instruction, /proc/cpuinfo flags it needs)
PROBES = {
    "vpdpbusd": ("probe_vnni", 64, ("avx512f", "avx512_vnni")),
    "vfmadd231ps": ("probe_fma", 16, ("avx512f",)),
    "vdpbf16ps": ("probe_bf16", 32, ("avx512f", "avx512_bf16")),
}

_lib = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _load():  # noqa: ANN202
    global _lib
    if _lib is None:
        from cffi import FFI

        ffi = FFI()
        ffi.cdef(
            "int probe_vnni(long n); float probe_fma(long n); float probe_bf16(long n); "
            "int probe_read(const char * p, long n); double timed_vnni(long n); double timed_fma(long n); "
            "double timed_bf16(long n); double timed_read(const char * p, long n);"
        )
        ffi.set_source("_pyggml_dkv_peak_probe", _SRC, extra_compile_args=["-O2"])
        tmp = tempfile.mkdtemp(prefix="peak_probe_")
        path = ffi.compile(tmpdir=tmp, verbose=False)
        import importlib.util

        spec = importlib.util.spec_from_file_location("_pyggml_dkv_peak_probe", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        _lib = mod.lib
    return _lib


def probe_peaks(threads: int, trials: int = 3, seconds: float = 0.05) -> dict[str, float | None]:
    """instruction -> best of `trials` rates in G multiply-adds / s over `threads` threads (None:
    the CPU lacks the instruction or the probe could not be built)."""
    flags = _cpu_flags()
    out: dict[str, float | None] = {name: None for name in PROBES}
    try:
        lib = _load()
    except Exception:  # noqa: BLE001 - no compiler / cffi: the caller falls back
        return out
    for name, (fn, macs, need) in PROBES.items():
        if not all(f in flags for f in need):
            continue
        func = getattr(lib, fn)
        n = 1000
        while True:  # size one call to ~`seconds` on one thread
            t = time.perf_counter()
            func(n)
            if time.perf_counter() - t > seconds / 4 or n > 10**9:
                break
            n *= 4
        best = 0.0
        for _ in range(trials):
            # cffi releases the GIL during the call: the threads run concurrently
            ts = [threading.Thread(target=func, args=(n,)) for _ in range(threads)]
            t = time.perf_counter()
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            best = max(best, threads * n * 12 * macs / (time.perf_counter() - t) / 1e9)
        out[name] = best
    return out


def _read_buffer(lib, threads: int, mib: int) -> tuple:  # noqa: ANN001
    """A `mib` MiB buffer for the read probe, its pages faulted in: (the array, which must stay
    referenced while the C loads read it; (pointer, bytes) of the whole, 64-byte aligned; one
    (pointer, bytes) part per thread, multiples of 128 bytes)."""
    import numpy as np
    from cffi import FFI

    ffi = FFI()
    n = mib * 2**20
    raw = np.ones(n + 64, dtype=np.uint8)
    start = raw.ctypes.data + (-raw.ctypes.data) % 64  # the loads are aligned ones
    part = n // threads // 128 * 128
    whole = (ffi.cast("const char *", start), n)
    lib.probe_read(*whole)
    return raw, whole, [(ffi.cast("const char *", start + i * part), part) for i in range(threads)]


def probe_read_bandwidth(threads: int, trials: int = 5, mib: int = 512) -> list[float] | None:
    """GB/s of reading a `mib` MiB buffer once, split over `threads` threads (per trial the best of
    that and one thread, as bench_step's copy probe), or None where the probe cannot be built or the
    CPU lacks AVX2. This is the rate the roofline charges a step's bytes at: weights and K/V are
    read, nothing is written back (a copy's rate, which also writes, is another quantity)."""
    if "avx2" not in _cpu_flags():
        return None
    try:
        lib = _load()
    except Exception:  # noqa: BLE001 - no compiler / cffi: the caller falls back
        return None
    raw, whole, parts = _read_buffer(lib, threads, mib)
    n, part = whole[1], parts[0][1]
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        lib.probe_read(*whole)
        one = n / (time.perf_counter() - t)
        ts = [threading.Thread(target=lib.probe_read, args=args) for args in parts]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        many = threads * part / (time.perf_counter() - t)
        out.append(max(one, many) / 1e9)
    return out  # (`raw` stays referenced, so alive, until here: the C loads read its memory)


class PeakSampler:
    """The instruction peaks and the read stream, probed briefly between timed steps.

    A shared VM's speed moves within seconds (twice as fast or slow for a while); peaks probed
    only before and after a run then charge a step timed in a slow spell against a fast spell's
    peak. bench_step takes one sample per repetition, in the rotation of the systems it times, so
    the roofline of a window uses the peaks of the same moments as its steps, by the same
    statistic (the median). Each probe is sized once to ~`seconds` on one thread and timed inside
    C; the rate is summed over the threads, each running its own copy at once. The read probe
    reads a `read_mib` MiB buffer (larger than the last-level caches here), split over the
    threads, once per sample."""

    def __init__(self, threads: int, seconds: float = 0.002, read_mib: int = 512) -> None:
        self.threads = threads
        self._lib = None
        self._sizes: dict[str, tuple[object, int, int]] = {}  # instruction -> (timed fn, n, macs/instr)
        self._read: list[tuple[object, int]] = []
        self._buf = None
        try:
            lib = _load()
        except Exception:  # noqa: BLE001 - no compiler / cffi: no samples
            return
        self._lib = lib
        flags = _cpu_flags()
        for name, (fn, macs, need) in PROBES.items():
            if not all(f in flags for f in need):
                continue
            timed = getattr(lib, "timed_" + fn.removeprefix("probe_"))
            n = 1000
            while timed(n) < seconds and n < 10**9:
                n *= 2
            self._sizes[name] = (timed, n, macs)
        if "avx2" in flags:
            self._buf, _, self._read = _read_buffer(lib, threads, read_mib)  # _buf kept: the C loads read it

    @property
    def available(self) -> bool:
        return bool(self._sizes)

    def _concurrent(self, fn, args_per_thread: list[tuple]) -> list[float]:  # noqa: ANN001
        """fn(*args) on one thread each, at once; each call's own seconds."""
        out = [0.0] * len(args_per_thread)

        def run(i: int) -> None:
            out[i] = fn(*args_per_thread[i])

        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(args_per_thread))]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        return out

    def sample(self) -> dict[str, float]:
        """instruction -> G multiply-adds / s now, and "read_gbs" -> GB/s now (where probed)."""
        out: dict[str, float] = {}
        for name, (timed, n, macs) in self._sizes.items():
            secs = self._concurrent(timed, [(n,)] * self.threads)
            out[name] = sum(n * 12 * macs / s for s in secs) / 1e9
        if self._read:
            secs = self._concurrent(self._lib.timed_read, self._read)  # type: ignore[union-attr]
            out["read_gbs"] = sum(nb / s for (_, nb), s in zip(self._read, secs)) / 1e9
        return out

    def close(self) -> None:
        self._buf = None
        self._read = []


if __name__ == "__main__":
    import sys

    th = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for k, v in probe_peaks(th).items():
        print(f"{k:12s} {'-' if v is None else f'{v:.1f} G multiply-adds/s'} ({th} threads)")
    rd = probe_read_bandwidth(th)
    print(f"{'read':12s} {'-' if rd is None else f'{max(rd):.1f} GB/s'} ({th} threads)")
