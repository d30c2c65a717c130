#!/usr/bin/env bash
# Build one of llama.cpp's own C++ programs from the llama-cpp-python 0.3.36 sdist on PyPI (the
# llama.cpp our host runs, the ggml we build on): `llama-server` for benchmarks/bench_server.py,
# `ggml-rpc-server` for tests/serving/test_llama_rpc_server.py. The binary is cached, keyed by
# version, target and CPU flags, so only the first call builds (llama-server ~10 minutes on 2 cores,
# ggml-rpc-server ~4). Prints the binary's path.
#
#   bash scripts/build_llama_cpp_tool.sh llama-server
#   bash scripts/build_llama_cpp_tool.sh ggml-rpc-server
#   bash scripts/build_llama_cpp_tool.sh --cached ggml-rpc-server   # the path if built, else exit 3
set -euo pipefail
VERSION=0.3.36
CACHED_ONLY=0
if [ "${1:-}" = --cached ]; then CACHED_ONLY=1; shift; fi
TARGET="${1:-}"
PYTHON="${PYTHON:-python3}"
CACHE="${PYGGML_DKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyggml_dkv}"
say() { echo "build_llama_cpp_tool.sh: $*" >&2; }

case "$TARGET" in
    llama-server) OPTIONS=(-DLLAMA_BUILD_SERVER=ON) ;;
    ggml-rpc-server) OPTIONS=(-DGGML_RPC=ON -DLLAMA_BUILD_TOOLS=ON) ;;
    *) say "usage: build_llama_cpp_tool.sh [--cached] llama-server|ggml-rpc-server"; exit 2 ;;
esac
KEY="$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12)"
# llama-server keeps its old cache folder name (no target in it), so a built one is found again
if [ "$TARGET" = llama-server ]; then OUT="$CACHE/llama-server-$VERSION-$KEY"; else OUT="$CACHE/$TARGET-$VERSION-$KEY"; fi

if [ -x "$OUT/bin/$TARGET" ]; then
    echo "$OUT/bin/$TARGET"
    exit 0
fi
[ "$CACHED_ONLY" = 0 ] || exit 3
command -v cmake >/dev/null || { say "cmake not found"; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sdist="$(PYTHON="$PYTHON" bash "$(dirname "${BASH_SOURCE[0]}")/pinned_sdist.sh")"
[ "$(basename "$sdist")" = "llama_cpp_python-$VERSION.tar.gz" ] || { say "vendor/ggml.pin names $(basename "$sdist"), not $VERSION"; exit 1; }
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$VERSION/vendor/llama.cpp"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
say "building $TARGET (log: $work/build.log)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${OPTIONS[@]}" -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON > "$work/build.log" 2>&1
cmake --build "$work/build" --target "$TARGET" -j "$(nproc)" >> "$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log" >&2; exit 1; }
mkdir -p "$OUT/bin"
cp "$work/build/bin/$TARGET" "$OUT/bin/"
echo "$OUT/bin/$TARGET"
