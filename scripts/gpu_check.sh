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
#   4. runs the step benchmark (qwen3-8b shape, windows 64..4096, ring cache f16/q8_0 vs one-shot)
#      with CUDA graphs (default) and without (GGML_CUDA_DISABLE_GRAPHS=1).
# Budget: 8 minutes on 16 cores; every phase prints a timestamped progress line.
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
python3 -c "import cffi, numpy, pytest" 2>/dev/null || {
    echo "gpu_check: needs python3 with cffi, numpy and pytest (pip install cffi numpy pytest)"; exit 2; }
[ -f vendor/ggml/.pyggml_dkv_source ] || { echo "gpu_check: vendor/ggml is missing: run ./build_ggml.sh on a machine with network and carry vendor/ggml"; exit 2; }

phase "1/4 building ggml with CUDA (native architecture)"
GGML_OFFLINE=1 GGML_CUDA=1 CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-native}" GGML_JOBS="$(nproc)" ./build_ggml.sh

phase "2/4 compiling the bindings"
rm -f pyggml_dkv/_ggml_cffi*.so
(cd pyggml_dkv/.. && python3 pyggml_dkv/_cffi/build.py > "$OUT/cffi_build.log" 2>&1) || { tail -n 20 "$OUT/cffi_build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import pyggml_dkv; print(pyggml_dkv.available_backends())"

phase "3/4 parity on the CUDA backend"
# keep going on failure: the benchmark figures are worth having either way
python3 -m pytest -q -p no:cacheprovider tests/ggml/test_cuda.py --junitxml="$OUT/test_cuda.xml" 2>&1 | tail -n 25 \
    || echo "gpu_check: PARITY TESTS FAILED (details above and in $OUT/test_cuda.xml)"

phase "4/4 step benchmark, CUDA graphs on, then off"
BENCH=(python3 benchmarks/bench_step.py --backend cuda:0 --configs qwen3-8b --windows 64,256,1024,2048,4096
       --no-torch --reps 20 --oneshot-reps 5)
"${BENCH[@]}" --json "$OUT/bench_cuda_graphs.json"
GGML_CUDA_DISABLE_GRAPHS=1 "${BENCH[@]}" --json "$OUT/bench_no_cuda_graphs.json"

phase "done; results in $OUT"
