#!/usr/bin/env bash
# Install llama-cpp-python (the version the `llama` extra pins) built so that llama.cpp's AMX
# kernels work, into the active Python environment.
#
#   bash scripts/install_llama_cpp.sh          # then: pip install -e ".[llama]" finds it installed
#
# It also extracts llama.cpp's HF -> GGUF converter from the same sdist into the cache (below).
#
# Why: llama-cpp-python builds llama.cpp from source for the build machine (GGML_NATIVE). On a Xeon
# with AMX, GCC 12 compiles llama.cpp's own tile-config setup (ggml-cpu/amx/mmq.cpp,
# ggml_tile_config_init) without the stores of the tile rows and widths: `_tile_loadconfig` is
# declared to read 8 bytes of the 64-byte config, so dead-store elimination drops the rest and
# `ldtilecfg` loads an empty palette. Its first batched product of q4_0 / q4_1 / q8_0 / K-quant
# weights then dies with SIGILL (the bug our ggml patch 0002 fixes in our own copy). `-fno-dse`
# keeps those stores (checked in the disassembly). It only keeps stores GCC would drop as dead
# (its effect on llama.cpp's speed was not measured), and is passed on every machine, so the
# wheel is the same recipe everywhere.
#
# pip's wheel cache is keyed by the sdist alone, not by the build flags, so it could hand back a
# wheel built without them (or for another CPU: the build is native). The wheel is therefore built
# once into our own cache, keyed by version, flags, compiler and CPU flags, and installed from there:
# the first run takes ~9 minutes on 2 cores, later ones seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
VERSION="$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
[ -n "$VERSION" ] || { echo "install_llama_cpp.sh: no llama-cpp-python pin found in pyproject.toml" >&2; exit 1; }
FLAGS="-fno-dse"

CACHE="${PYGGML_DKV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyggml_dkv}"
cpu_flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)"
compiler="$(${CXX:-c++} --version 2>/dev/null | head -n 1 || echo unknown)"
KEY="$(printf '%s\n' "$VERSION" "$FLAGS" "$compiler" "$cpu_flags" "$("$PYTHON" -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-16)"
WHEELS="$CACHE/wheels/llama-cpp-python-$VERSION-$KEY"

say() { echo "install_llama_cpp.sh: $*" >&2; }

# The llama-cpp-python sdist, fetched once (scripts/pinned_sdist.sh: vendor/downloads/, where
# build_ggml.sh takes our ggml from): the wheel and the converter below come from it.
fetch_sdist() {
    SDIST="$(PYTHON="$PYTHON" bash "$ROOT/scripts/pinned_sdist.sh")" || return 1
    [ "$(basename "$SDIST")" = "llama_cpp_python-$VERSION.tar.gz" ] \
        || { say "vendor/ggml.pin names $(basename "$SDIST"), pyproject.toml llama-cpp-python $VERSION: make them agree"; return 1; }
}

# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py),
# from the same sdist, for tests/model/test_gguf_convert.py: the installed wheel does not ship it.
# 2 MB of the 76 MB sdist, extracted once into the cache. Not fatal: without it that test skips.
CONVERTER="$CACHE/llama.cpp-src-$VERSION"
extract_converter() {
    local tmp top
    tmp="$(mktemp -d)"
    top="llama_cpp_python-$VERSION/vendor/llama.cpp"
    fetch_sdist &&
        tar -xzf "$SDIST" -C "$tmp" --wildcards \
            "$top/convert_hf_to_gguf.py" "$top/conversion/*" "$top/gguf-py/*" &&
        rm -rf "$CONVERTER" && mkdir -p "$(dirname "$CONVERTER")" && mv "$tmp/$top" "$CONVERTER"
    local status=$?
    rm -rf "$tmp"
    return $status
}
if [ ! -f "$CONVERTER/convert_hf_to_gguf.py" ]; then
    say "extracting llama.cpp's converter from the llama-cpp-python $VERSION sdist into $CONVERTER"
    extract_converter || say "could not extract llama.cpp's converter (tests/model/test_gguf_convert.py will skip)"
fi

if "$PYTHON" - "$VERSION" "$WHEELS" <<'EOF'
import importlib.metadata as md, sys
version, wheels = sys.argv[1], sys.argv[2]
try:
    dist = md.distribution("llama_cpp_python")
except md.PackageNotFoundError:
    sys.exit(1)
# our marker in its dist-info names the cached build it came from; any other build (e.g. one from
# pip's own cache) is replaced
ok = dist.version == version and (dist.read_text("pyggml_dkv_build") or "").strip() == wheels.split("/")[-1]
sys.exit(0 if ok else 1)
EOF
then
    say "llama-cpp-python $VERSION from $WHEELS is already installed"
    exit 0
fi

shopt -s nullglob
wheel=("$WHEELS"/llama_cpp_python-*.whl)
if [ ${#wheel[@]} -eq 0 ]; then
    say "building llama-cpp-python $VERSION with $FLAGS (llama.cpp from source: ~9 minutes on 2 cores)"
    fetch_sdist
    mkdir -p "$WHEELS.tmp"
    CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS=$FLAGS -DCMAKE_CXX_FLAGS=$FLAGS" \
        "$PYTHON" -m pip wheel --quiet --no-deps --no-cache-dir -w "$WHEELS.tmp" "$SDIST"
    rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    wheel=("$WHEELS"/llama_cpp_python-*.whl)
fi
"$PYTHON" -m pip install --quiet --force-reinstall --no-deps "${wheel[0]}"
"$PYTHON" -m pip install --quiet "llama-cpp-python==$VERSION"  # its dependencies (numpy, jinja2, ...)
# mark the install as this build (a file in its dist-info), so a later run knows it
"$PYTHON" - "$VERSION" "$WHEELS" <<'EOF'
import importlib.metadata as md, pathlib, sys
dist = md.distribution("llama_cpp_python")
info = pathlib.Path(dist.locate_file(dist._path))  # its .dist-info directory
(info / "pyggml_dkv_build").write_text(pathlib.Path(sys.argv[2]).name + "\n")
EOF
say "installed llama-cpp-python $VERSION built with $FLAGS"
