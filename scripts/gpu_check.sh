#!/usr/bin/env bash
# One-shot check on a lent GPU machine (H200-class, 16 cores, nvcc, PyTorch, NO network).
#
#   ./scripts/gpu_check.sh            # writes gpu_check.log + JSON into $OUT (default ./gpu_check_out)
#
# Needs, from this machine: the repository and vendor/ggml (the pinned source build_ggml.sh
# unpacked; with the device tool: carry ["vendor/ggml"]). On the GPU machine it
#   1. builds ggml with CUDA for the local GPU (cuBLAS from the toolkit or PyTorch's nvidia wheels),
#   2. compiles the bindings in place (cffi + a C compiler; no pip, no network),
#   3. runs the parity tests on the CUDA backend (tests/ggml/test_cuda.py),
#   4. runs the step benchmark (qwen3-8b shape, windows 64/1024/4096, ring cache f16/q8_0 vs one-shot)
#      with CUDA graphs (default) and without (GGML_CUDA_DISABLE_GRAPHS=1),
#   5. times lanes on the GPU (benchmarks/bench_lanes.py, small shape, our side only).
# Budget: 8 minutes on 16 cores; every phase prints a timestamped progress line, and each benchmark
# phase is cut at PHASE_LIMIT seconds (default 100) so the figures of the others still come back.
# Python packages missing on the GPU machine (cffi, pycparser) can travel as wheels in .whl/
# (carry [".whl"]); they are installed into /tmp/site.
# Dry-run here (no GPU, CUDA_ARCHITECTURES=90): phases 1-3 pass (GPU tests skip), phase 4 stops
# with BackendUnavailableError, as it must without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
t0=$(date +%s)
phase() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

phase "machine: $(nproc) cores; $(nvidia-smi -L 2>/dev/null | head -n 2 | tr '\n' ' ')"
if ! python3 -c "import cffi" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import cffi, numpy, pytest" 2>/dev/null || {
    echo "gpu_check: needs python3 with cffi, numpy and pytest (pip install cffi numpy pytest)"; exit 2; }
[ -f vendor/ggml/.pyggml_dkv_source ] || { echo "gpu_check: vendor/ggml is missing: run ./build_ggml.sh on a machine with network and carry vendor/ggml"; exit 2; }

PHASE_LIMIT="${PHASE_LIMIT:-100}"
phase "1/5 building ggml with CUDA (native architecture)"
GGML_OFFLINE=1 GGML_CUDA=1 CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-native}" GGML_JOBS="$(nproc)" ./build_ggml.sh

phase "2/5 compiling the bindings"
rm -f pyggml_dkv/_ggml_cffi*.so
(cd pyggml_dkv/.. && python3 pyggml_dkv/_cffi/build.py > "$OUT/cffi_build.log" 2>&1) || { tail -n 20 "$OUT/cffi_build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import pyggml_dkv; print(pyggml_dkv.available_backends())"

phase "3/5 parity on the CUDA backend (lanes included)"
# keep going on failure: the benchmark figures are worth having either way
python3 -m pytest -q -p no:cacheprovider tests/ggml/test_cuda.py --junitxml="$OUT/test_cuda.xml" 2>&1 | tail -n 25 \
    || echo "gpu_check: PARITY TESTS FAILED (details above and in $OUT/test_cuda.xml)"

GPU_CHECK_SKIP="${GPU_CHECK_SKIP:-}"  # e.g. "4": phases to leave out (a rerun within a short lease)
if [[ "$GPU_CHECK_SKIP" != *4* ]]; then
phase "4/5 step benchmark, CUDA graphs on, then off"
BENCH=(python3 benchmarks/bench_step.py --backend cuda:0 --configs qwen3-8b --windows 64,1024,4096
       --no-torch --reps 10 --oneshot-reps 3)
timeout "$PHASE_LIMIT" "${BENCH[@]}" --json "$OUT/bench_cuda_graphs.json" || echo "gpu_check: phase 4 (graphs on) stopped: $?"
GGML_CUDA_DISABLE_GRAPHS=1 timeout "$PHASE_LIMIT" "${BENCH[@]}" --json "$OUT/bench_no_cuda_graphs.json" \
    || echo "gpu_check: phase 4 (graphs off) stopped: $?"
fi

phase "5/5 lanes on CUDA: N lanes vs N single-lane steps (small shape, f16)"
timeout "$PHASE_LIMIT" python3 benchmarks/bench_lanes.py --drafters random-small --no-llama --backend cuda:0 --dtype f16 \
    --lanes 1,2,4,8 --windows 64,1024,4096 --reps 6 --rounds 1 --json "$OUT/bench_lanes_cuda.json" \
    || echo "gpu_check: phase 5 stopped: $?"

phase "done; results in $OUT"
