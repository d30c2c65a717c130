#!/usr/bin/env bash
# Build llama.cpp's own C++ `llama-server` from the llama-cpp-python 0.3.36 sdist on PyPI (the
# llama.cpp our host runs), for benchmarks/bench_server.py. ~10 minutes on 2 cores the first time,
# then instant: the binary is cached, keyed by version and CPU flags. Prints the binary's path.
#
#   bash scripts/build_llama_server.sh            # -> .../llama-server
set -euo pipefail
VERSION=0.3.36
PYTHON="${PYTHON:-python3}"
CACHE="${PYGGML_DKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyggml_dkv}"
KEY="$(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12)"
OUT="$CACHE/llama-server-$VERSION-$KEY"
say() { echo "build_llama_server.sh: $*" >&2; }

if [ -x "$OUT/bin/llama-server" ]; then
    echo "$OUT/bin/llama-server"
    exit 0
fi
command -v cmake >/dev/null || { say "cmake not found"; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
say "downloading the llama-cpp-python $VERSION sdist"
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION" \
    2> "$work/pip.log" || true
sdist="$(ls "$work"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
[ -n "$sdist" ] || { tail -n 5 "$work/pip.log" >&2; say "pip could not download the sdist"; exit 1; }
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
say "building llama-server (log: $work/build.log; ~10 minutes on 2 cores)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON > "$work/build.log" 2>&1
cmake --build "$work/build" --target llama-server -j "$(nproc)" >> "$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log" >&2; exit 1; }
mkdir -p "$OUT/bin"
cp "$work/build/bin/llama-server" "$OUT/bin/"
echo "$OUT/bin/llama-server"
