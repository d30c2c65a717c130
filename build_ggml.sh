#!/usr/bin/env bash
# Fetch the pinned ggml release, verify it, and build it as position-independent static
# libraries into pyggml_dkv/_libs/ (lib/*.a + include/). The cffi extension links them in and
# exports nothing of ggml, so it can live in a process that also loads llama.cpp's own ggml
# (README: "Inside a llama.cpp host"). Nothing under _libs/lib is shipped or loaded at run time.
#
#   ./build_ggml.sh                 CPU backend (native SIMD)
#   GGML_CUDA=1 ./build_ggml.sh     + CUDA backend (cuBLAS from the toolkit or the nvidia-cublas wheel)
#   GGML_RPC=0 ./build_ggml.sh      without the RPC backend (built by default)
#   GGML_SRC=/path ./build_ggml.sh  build a ggml checkout of your own instead of the pin
#   GGML_PATCHES=none ./build_ggml.sh  build the pinned ggml without our patches and kernels (default:
#                                      all, i.e. vendor/patches/ggml-$GGML_VERSION/*.patch, and
#                                      kernels/ copied into src/ggml-cpu/dkv/, GGML_CPU_DKV=ON)
#
# Other knobs: CUDA_ARCHITECTURES (default: native when a GPU is visible, else 90),
# GGML_BUILD_TYPE (Release), GGML_JOBS (nproc), GGML_SANITIZE=address (ASan build),
# GGML_OFFLINE=1 (never touch the network: the sdist must already be in vendor/downloads/ or in
# one of the pin's GGML_SDIST_SEARCH_DIRS).
#
# Idempotent: a second run with the same source and options returns in well under a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENDOR="$ROOT/vendor"
PREFIX="$ROOT/pyggml_dkv/_libs"
PYTHON="${PYTHON:-python3}"

die() { echo "build_ggml.sh: error: $*" >&2; exit 1; }
say() { echo "build_ggml.sh: $*" >&2; }

# shellcheck source=/dev/null
. "$VENDOR/ggml.pin"

# ---------------------------------------------------------------- source
fetch_pinned_source() {
    local dest="$VENDOR/ggml" stamp="$VENDOR/ggml/.pyggml_dkv_source"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$SOURCE_ID" ] \
        && { [ -z "${GGML_SDIST_LICENSE:-}" ] || [ -f "$dest/LICENSE" ]; }; then
        return
    fi
    # the pinned sdist, fetched once for everything that needs llama.cpp's sources (scripts/pinned_sdist.sh)
    local sdist
    sdist="$(PYTHON="$PYTHON" bash "$ROOT/scripts/pinned_sdist.sh")" || die "could not get the pinned sdist (above)"
    say "unpacking ggml $GGML_VERSION into vendor/ggml"
    local tmp
    tmp="$(mktemp -d "$VENDOR/unpack.XXXXXX")"
    tar -xzf "$sdist" -C "$tmp" "$GGML_SDIST_SUBDIR"
    if [ -n "${GGML_SDIST_LICENSE:-}" ] && [ ! -f "$tmp/$GGML_SDIST_SUBDIR/LICENSE" ]; then
        tar -xzf "$sdist" -C "$tmp" "$GGML_SDIST_LICENSE"
        cp "$tmp/$GGML_SDIST_LICENSE" "$tmp/$GGML_SDIST_SUBDIR/LICENSE"
    fi
    local p
    [ ${#PATCHES[@]} -eq 0 ] || command -v patch >/dev/null || die "patch not found (apt-get install patch)"
    for p in "${PATCHES[@]}"; do
        say "applying $(basename "$p")"
        patch -s -p1 --fuzz=0 -d "$tmp/$GGML_SDIST_SUBDIR" < "$p" \
            || { rm -rf "$tmp"; die "patch $(basename "$p") does not apply to ggml $GGML_VERSION (GGML_PATCHES=none builds it unpatched)"; }
    done
    # our kernel files, behind the series' hook (GGML_CPU_DKV, ggml-cpu's extra buffer types)
    if [ ${#KERNELS[@]} -gt 0 ]; then
        grep -q GGML_USE_CPU_DKV "$tmp/$GGML_SDIST_SUBDIR/src/ggml-cpu/ggml-cpu.cpp" \
            || { rm -rf "$tmp"; die "kernels/ needs the hook patch (GGML_CPU_DKV) in vendor/patches/ggml-$GGML_VERSION"; }
        mkdir -p "$tmp/$GGML_SDIST_SUBDIR/src/ggml-cpu/dkv"
        cp "${KERNELS[@]}" "$tmp/$GGML_SDIST_SUBDIR/src/ggml-cpu/dkv/"
    fi
    # llama.cpp's copy of ggml lacks ggml.pc.in, which ggml's CMakeLists configures when it is the
    # top-level project; we delete the pkg-config file after the install anyway, so a stub will do
    [ -f "$tmp/$GGML_SDIST_SUBDIR/ggml.pc.in" ] \
        || echo "# pkg-config file not shipped in the llama.cpp copy of ggml (build_ggml.sh)" > "$tmp/$GGML_SDIST_SUBDIR/ggml.pc.in"
    # The build folder's objects are judged by time stamps, and tar restores the archive's (2022):
    # after a switch of patch series a file patched before would look older than its object and
    # never be recompiled. So a file whose content changed against the previous tree is stamped
    # now, one that did not keeps the previous tree's stamp (no needless rebuild).
    local new="$tmp/$GGML_SDIST_SUBDIR" f
    if [ -d "$dest" ]; then
        while IFS= read -r -d '' f; do
            if [ -f "$dest/$f" ] && cmp -s "$dest/$f" "$new/$f"; then
                touch -r "$dest/$f" "$new/$f"
            else
                touch "$new/$f"
            fi
        done < <(cd "$new" && find . -type f -print0)
    else
        find "$new" -type f -exec touch {} +
    fi
    rm -rf "$dest"
    mv "$tmp/$GGML_SDIST_SUBDIR" "$dest"
    rm -rf "$tmp"
    echo "$SOURCE_ID" > "$stamp"
}

# our small patches to the pinned source (vendor/patches/README.md), one series per pinned release
# (vendor/patches/ggml-<version>/; older series are kept beside it for reference, never applied);
# part of the source identity. GGML_PATCHES=none builds the pinned release as it is (the port to a
# new release starts there).
PATCH_DIR="$VENDOR/patches/ggml-$GGML_VERSION"
case "${GGML_PATCHES:-all}" in
    all)  shopt -s nullglob
          PATCHES=("$PATCH_DIR"/*.patch)
          KERNELS=("$ROOT"/kernels/*.c "$ROOT"/kernels/*.cpp "$ROOT"/kernels/*.h)
          shopt -u nullglob ;;
    none) PATCHES=(); KERNELS=() ;;
    *)    die "GGML_PATCHES=${GGML_PATCHES} (expected all or none)" ;;
esac
SOURCE_ID="$GGML_SDIST_SHA256"
if [ ${#PATCHES[@]} -gt 0 ] || [ ${#KERNELS[@]} -gt 0 ]; then
    SOURCE_ID="$SOURCE_ID+$( (cat "${PATCHES[@]}" /dev/null; for k in "${KERNELS[@]}"; do basename "$k"; cat "$k"; done) | sha256sum | cut -c1-16)"
else
    SOURCE_ID="$SOURCE_ID+unpatched"
fi

if [ -n "${GGML_SRC:-}" ]; then
    SRC="$(cd "$GGML_SRC" 2>/dev/null && pwd)" || die "GGML_SRC=$GGML_SRC is not a directory"
    [ -f "$SRC/include/ggml.h" ] && [ -f "$SRC/CMakeLists.txt" ] || die "GGML_SRC=$SRC does not look like a ggml tree (no include/ggml.h or CMakeLists.txt)"
    SRC_ID="custom:$SRC"
    [ ${#PATCHES[@]} -gt 0 ] && say "note: vendor/patches/ggml-$GGML_VERSION is not applied to GGML_SRC (ggml's own kernels and bugs)"
else
    fetch_pinned_source
    SRC="$VENDOR/ggml"
    SRC_ID="pin:$SOURCE_ID"
fi

# what each applied patch brings: its header names it on one line "Pyggml-Dkv-Capability: NAME"
# (a git trailer); each kernel .c / .cpp file on one line "// Pyggml-Dkv-Capability: NAME". The
# names become macros of _libs/include/pyggml_dkv_build.h, which the extension's capability query
# (pyggml_dkv/_cffi/kernels.c) is compiled from; nothing reads these files later. A GGML_SRC
# build carries none.
CAPABILITIES=()
capability_of() {  # file, line prefix
    local cap
    cap="$(sed -n "s|^$2Pyggml-Dkv-Capability: \([a-z0-9][a-z0-9_-]*\)\$|\1|p" "$1")"
    [ -n "$cap" ] && [ "$(printf '%s\n' "$cap" | wc -l)" = 1 ] \
        || die "$(basename "$1") must name what it brings on exactly one line '$2Pyggml-Dkv-Capability: name' (a-z, 0-9, _ and -)"
    CAPABILITIES+=("$cap")
}
if [ "${SRC_ID#custom:}" = "$SRC_ID" ]; then
    for p in "${PATCHES[@]}"; do
        capability_of "$p" ""
    done
    for k in "${KERNELS[@]}"; do
        case "$k" in *.h) ;; *) capability_of "$k" "// " ;; esac
    done
fi

# ---------------------------------------------------------------- toolchain
command -v cmake >/dev/null || die "cmake not found (apt-get install cmake, or pip install cmake)"
command -v "${CC:-cc}" >/dev/null || die "no C compiler found (apt-get install build-essential)"
command -v "${CXX:-c++}" >/dev/null || die "no C++ compiler found (apt-get install g++)"

CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE="${GGML_BUILD_TYPE:-Release}"
    # static and -fPIC: linked into the extension, whose symbols stay private (no SONAME that a
    # llama.cpp in the same process could match, no ggml_* symbol it could bind to)
    -DBUILD_SHARED_LIBS=OFF
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON
    -DGGML_NATIVE=ON
    # llamafile's tinyBLAS kernels for the products neither AMX nor our f16 kernel takes
    # (f32, bf16, q8_0 off AMX: ~1.5x at a draft block's 16-50 rows; wide one-shot products)
    -DGGML_LLAMAFILE=ON
    -DGGML_BUILD_TESTS=OFF
    -DGGML_BUILD_EXAMPLES=OFF
    -DGGML_CCACHE=OFF
    -DCMAKE_INSTALL_LIBDIR=lib
)
VARIANT="cpu"
# our kernel files (kernels/, copied into src/ggml-cpu/dkv/ of the pinned source)
if [ ${#KERNELS[@]} -gt 0 ] && [ "${SRC_ID#custom:}" = "$SRC_ID" ]; then
    CMAKE_ARGS+=(-DGGML_CPU_DKV=ON)
fi
# what the extension must link besides the static ggml libraries (written to _libs/link-args for
# pyggml_dkv/_cffi/build.py): shared system and toolkit libraries, which are safe to share
LINK_ARGS=(-lstdc++ -lm -ldl -lpthread)

if [ "${GGML_SANITIZE:-}" = address ]; then
    CMAKE_ARGS+=(-DGGML_SANITIZE_ADDRESS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo)
    LINK_ARGS+=(-fsanitize=address)   # the instrumented ggml needs the ASan runtime (preloaded at run time)
    VARIANT="$VARIANT-asan"
fi

if [ "${GGML_RPC:-1}" = 1 ]; then
    # RDMA off: ggml turns it on wherever it finds libibverbs, and the extension would then need
    # -libverbs at link and load time (seen on the GPU machine); our RPC client speaks TCP
    CMAKE_ARGS+=(-DGGML_RPC=ON -DGGML_RPC_RDMA=OFF)
    VARIANT="$VARIANT-rpc"
fi

if [ "${GGML_CUDA:-0}" = 1 ]; then
    # shellcheck source=/dev/null
    . "$ROOT/scripts/cuda_env.sh"
    cuda_configure   # appends to CMAKE_ARGS and LINK_ARGS, or dies naming what is missing
    VARIANT="$VARIANT-cuda"
fi

# ---------------------------------------------------------------- build
BUILD="$VENDOR/build/$VARIANT"
STAMP="$PREFIX/.build-stamp"
# The build's identity, which ggml itself answers at run time: ggml's CMakeLists asks git for the
# commit that ggml_commit() returns (vendor/ggml sits inside our own git checkout, so that was our
# HEAD, "-dirty" or not). A stand-in for git answers "pyggml_dkv-<id>" instead, <id> a hash of the
# source (pin + patch series), variant and options. The import-time check compares it with the
# id recorded here (_libs/build-id): llama.cpp's ggml in the same process reports the same
# version as ours, but not this.
BUILD_ID="pyggml_dkv-$(printf '%s|%s|%s|%s' "$SRC_ID" "$VARIANT" "${CMAKE_ARGS[*]}" "${CAPABILITIES[*]}" | sha256sum | cut -c1-16)"
COMMIT_STAMP="$VENDOR/build/$VARIANT.commit-stamp"
CMAKE_ARGS+=(-DGIT_EXE="$COMMIT_STAMP")
KEY="$SRC_ID|$VARIANT|${CMAKE_ARGS[*]}|$BUILD_ID"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && [ -f "$PREFIX/lib/libggml.a" ] \
   && [ "${SRC_ID#custom:}" = "$SRC_ID" ]; then
    say "ggml $GGML_VERSION ($VARIANT) is up to date in pyggml_dkv/_libs"
    exit 0
fi

mkdir -p "$VENDOR/build"
printf '#!/bin/sh\n# build_ggml.sh: answers ggml'"'"'s CMakeLists in place of git (rev-parse: the commit; diff-index: clean)\n[ "$1" = rev-parse ] && echo %s\nexit 0\n' \
    "$BUILD_ID" > "$COMMIT_STAMP"
chmod +x "$COMMIT_STAMP"
say "configuring ggml ($VARIANT) in vendor/build/$VARIANT"
cmake -S "$SRC" -B "$BUILD" "${CMAKE_ARGS[@]}" > "$BUILD.configure.log" 2>&1 \
    || { tail -n 30 "$BUILD.configure.log" >&2; die "cmake configure failed (full log: $BUILD.configure.log)"; }
JOBS="${GGML_JOBS:-$(nproc)}"
say "compiling with $JOBS jobs (log: $BUILD.build.log)"
start=$(date +%s)
cmake --build "$BUILD" -j "$JOBS" > "$BUILD.build.log" 2>&1 \
    || { grep -m 20 -iE "error" "$BUILD.build.log" >&2 || tail -n 30 "$BUILD.build.log" >&2; die "compilation failed (full log: $BUILD.build.log)"; }
rm -rf "$PREFIX"
cmake --install "$BUILD" --prefix "$PREFIX" > "$BUILD.install.log" 2>&1 \
    || { tail -n 20 "$BUILD.install.log" >&2; die "cmake install failed"; }
rm -rf "$PREFIX/lib/cmake" "$PREFIX/lib/pkgconfig"
# ggml's CPU backend uses OpenMP when the compiler has it (libgomp stays a shared library)
if grep -q '^GGML_OPENMP_ENABLED:INTERNAL=ON' "$BUILD/CMakeCache.txt"; then
    LINK_ARGS+=(-fopenmp)
fi
printf '%s\n' "${LINK_ARGS[@]}" > "$PREFIX/link-args"
# the ggml version the sources say they are (ggml_version() must answer it at run time)
tree_version() {
    local part v=""
    for part in MAJOR MINOR PATCH; do
        v="$v.$(sed -n "s/^set(GGML_VERSION_$part \([0-9]*\))/\1/p" "$SRC/CMakeLists.txt" | head -n 1)"
    done
    echo "${v#.}"
}
BUILT_VERSION="$(tree_version)"
if [ "${SRC_ID#custom:}" = "$SRC_ID" ] && [ "$BUILT_VERSION" != "$GGML_VERSION" ]; then
    die "vendor/ggml says it is ggml $BUILT_VERSION, but vendor/ggml.pin pins $GGML_VERSION"
fi
echo "$BUILT_VERSION" > "$PREFIX/version"
echo "$VARIANT" > "$PREFIX/variant"
echo "$BUILD_ID" > "$PREFIX/build-id"
# what this build is and carries, for the extension's C (pyggml_dkv/_cffi/kernels.c, build.py)
{
    echo "/* Written by build_ggml.sh: which ggml build this is and what of ours it carries."
    echo "   pyggml_dkv/_cffi/kernels.c answers it through pyggml_dkv_kernels(). */"
    echo "#define PYGGML_DKV_GGML_VERSION \"$BUILT_VERSION\""
    echo "#define PYGGML_DKV_GGML_VARIANT \"$VARIANT\""
    echo "#define PYGGML_DKV_GGML_BUILD_ID \"$BUILD_ID\""
    echo "#define PYGGML_DKV_BUILD_CAPABILITIES \"$(IFS=,; echo "${CAPABILITIES[*]}")\""
    for cap in "${CAPABILITIES[@]}"; do
        echo "#define PYGGML_DKV_HAS_$(echo "$cap" | tr 'a-z-' 'A-Z_') 1"
    done
} > "$PREFIX/include/pyggml_dkv_build.h"
echo "$KEY" > "$STAMP"   # last: an interrupted build is never taken as up to date
say "built ggml $BUILT_VERSION ($VARIANT) in $(( $(date +%s) - start ))s into pyggml_dkv/_libs"
