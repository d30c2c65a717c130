# Sourced by build_ggml.sh when GGML_CUDA=1: find the CUDA toolkit and cuBLAS, pick GPU
# architectures, and append the CMake arguments of a CUDA build to CMAKE_ARGS and what the
# extension must link for it (CUDA runtime, cuBLAS, driver) to LINK_ARGS.
#
# cuBLAS is taken, in order, from: $CUBLAS_ROOT; the toolkit itself; an `nvidia` pip package
# already installed in this Python (PyTorch's CUDA wheels bring one); vendor/cuda-deps; or else it
# is installed there from the `nvidia-cublas` wheel on PyPI (headers + libraries are inside).
# Without a driver library (libcuda.so) ggml is built with GGML_CUDA_NO_VMM, which does not link it.

cuda_die() { echo "build_ggml.sh: CUDA: $*" >&2; exit 1; }

cuda_find_toolkit() {
    local nvcc_path
    if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
        nvcc_path="$CUDA_HOME/bin/nvcc"
    elif command -v nvcc >/dev/null; then
        nvcc_path="$(command -v nvcc)"
    elif [ -x /usr/local/cuda/bin/nvcc ]; then
        nvcc_path=/usr/local/cuda/bin/nvcc
    else
        cuda_die "nvcc not found: install the CUDA toolkit or set CUDA_HOME"
    fi
    NVCC="$(readlink -f "$nvcc_path")"
    CUDA_TOOLKIT="$(cd "$(dirname "$NVCC")/.." && pwd)"
    if [ ! -f "$CUDA_TOOLKIT/include/cuda_runtime.h" ]; then
        # nvcc may be a wrapper script: ask the real one where its toolkit is
        local top
        top="$("$nvcc_path" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)"
        [ -n "$top" ] && CUDA_TOOLKIT="$(cd "$top" && pwd)" && NVCC="$CUDA_TOOLKIT/bin/nvcc"
    fi
    [ -f "$CUDA_TOOLKIT/include/cuda_runtime.h" ] || cuda_die "no cuda_runtime.h under $CUDA_TOOLKIT (set CUDA_HOME to the toolkit)"
    CUDA_VERSION="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')"
    CUDA_MAJOR="${CUDA_VERSION%%.*}"
    [ -n "$CUDA_MAJOR" ] || cuda_die "could not read the CUDA version from $NVCC --version"
    # the runtime library ggml links (libcudart) must be in the toolkit
    CUDART_DIR=""
    for d in "$CUDA_TOOLKIT/lib64" "$CUDA_TOOLKIT/lib" "$CUDA_TOOLKIT"/targets/*/lib /usr/local/cuda/lib64; do
        if [ -e "$d/libcudart.so" ]; then CUDART_DIR="$d"; break; fi
    done
    [ -n "$CUDART_DIR" ] || cuda_die "libcudart.so not found under $CUDA_TOOLKIT (incomplete toolkit?)"
}

# Sets CUBLAS_INCLUDE and CUBLAS_LIB (a directory holding libcublas.so.N and libcublasLt.so.N).
cuda_find_cublas() {
    local candidates=()
    [ -n "${CUBLAS_ROOT:-}" ] && candidates+=("$CUBLAS_ROOT")
    candidates+=("$CUDA_TOOLKIT" "$CUDA_TOOLKIT/targets/x86_64-linux" "$CUDA_TOOLKIT/targets/sbsa-linux")
    local site
    site="$("$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null || true)"
    while IFS= read -r s; do
        [ -n "$s" ] && candidates+=("$s/nvidia/cu$CUDA_MAJOR" "$s/nvidia/cublas")
    done <<< "$site"
    candidates+=("$VENDOR/cuda-deps/nvidia/cu$CUDA_MAJOR" "$VENDOR/cuda-deps/nvidia/cublas")
    for c in "${candidates[@]}"; do
        if [ -f "$c/include/cublas_v2.h" ]; then
            for l in "$c/lib64" "$c/lib"; do
                if compgen -G "$l/libcublas.so*" >/dev/null && compgen -G "$l/libcublasLt.so*" >/dev/null; then
                    CUBLAS_INCLUDE="$c/include"; CUBLAS_LIB="$l"; return 0
                fi
            done
        fi
    done
    return 1
}

cuda_install_cublas_wheel() {
    [ "${GGML_OFFLINE:-0}" = 1 ] && cuda_die "cuBLAS not found and GGML_OFFLINE=1; set CUBLAS_ROOT to a directory with include/cublas_v2.h and lib/libcublas.so*"
    local spec="nvidia-cublas>=$CUDA_MAJOR.0,<$((CUDA_MAJOR + 1))"
    [ "$CUDA_MAJOR" -lt 13 ] && spec="nvidia-cublas-cu$CUDA_MAJOR"
    echo "build_ggml.sh: CUDA: cuBLAS is not in the toolkit; installing $spec into vendor/cuda-deps" >&2
    "$PYTHON" -m pip install --quiet --no-deps --target "$VENDOR/cuda-deps" "$spec" \
        || cuda_die "could not pip install $spec (no network?); set CUBLAS_ROOT instead"
}

cuda_pick_architectures() {
    if [ -n "${CUDA_ARCHITECTURES:-}" ]; then
        CUDA_ARCHS="$CUDA_ARCHITECTURES"
    elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        CUDA_ARCHS="native"   # a GPU is visible: build for exactly it
    else
        CUDA_ARCHS="90"       # no GPU here: Hopper (H100/H200), override with CUDA_ARCHITECTURES
    fi
}

cuda_configure() {
    cuda_find_toolkit
    cuda_find_cublas || { cuda_install_cublas_wheel; cuda_find_cublas || cuda_die "cuBLAS still not found after installing the wheel"; }
    # wheels ship only versioned sonames: give the linker the unversioned names next to them
    local link_dir="$VENDOR/cuda-deps/link"
    mkdir -p "$link_dir"
    for name in cublas cublasLt; do
        local so
        so="$(ls "$CUBLAS_LIB"/lib$name.so* 2>/dev/null | sort | head -n 1)"
        [ -n "$so" ] || cuda_die "lib$name.so* missing in $CUBLAS_LIB"
        ln -sf "$so" "$link_dir/lib$name.so"
    done
    cuda_pick_architectures
    local vmm=OFF
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && [ ! -e "$CUDA_TOOLKIT/lib64/stubs/libcuda.so" ]; then
        vmm=ON   # no driver library to link: ggml's VMM pool needs it, the plain pool does not
    fi
    echo "build_ggml.sh: CUDA $CUDA_VERSION at $CUDA_TOOLKIT, cuBLAS from $CUBLAS_LIB, architectures $CUDA_ARCHS, NO_VMM=$vmm" >&2
    CMAKE_ARGS+=(
        -DGGML_CUDA=ON
        -DGGML_CUDA_NO_VMM="$vmm"
        -DGGML_CUDA_NCCL=OFF
        -DCMAKE_CUDA_COMPILER="$NVCC"
        -DCUDAToolkit_ROOT="$CUDA_TOOLKIT"
        -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS"
        -DCUDA_cublas_LIBRARY="$link_dir/libcublas.so"
        -DCUDA_cublasLt_LIBRARY="$link_dir/libcublasLt.so"
        "-DCMAKE_CUDA_FLAGS=-I$CUBLAS_INCLUDE"
        "-DCMAKE_CXX_FLAGS=-I$CUBLAS_INCLUDE"
    )
    # the static libggml-cuda.a leaves the CUDA runtime and cuBLAS shared: the extension links
    # them and finds them where they are, wherever the package is installed
    LINK_ARGS+=(
        "-L$link_dir" "-L$CUDART_DIR" -lcublas -lcublasLt -lcudart
        "-Wl,-rpath,$CUBLAS_LIB" "-Wl,-rpath,$CUDART_DIR"
    )
    if [ "$vmm" = OFF ]; then
        # ggml's VMM pool calls the driver API: link the driver (its stub when the toolkit has one;
        # the real libcuda.so.1 is loaded at run time)
        local driver="$CUDA_TOOLKIT/lib64/stubs/libcuda.so"
        [ -e "$driver" ] || driver="$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so.* => //p' | head -n 1)"
        LINK_ARGS+=("$driver")
    fi
}
