#!/usr/bin/env bash
# Print the path of the llama-cpp-python source distribution the project pins (vendor/ggml.pin),
# fetched once into vendor/downloads/ and checked against the pin's sha256. Everything that needs
# llama.cpp's sources takes them from this one file: build_ggml.sh (our ggml is its
# vendor/llama.cpp/ggml; it fetches into the same folder itself), install_llama_cpp.sh (the wheel
# and llama.cpp's converter) and build_llama_cpp_tool.sh (llama-server, ggml-rpc-server).
#
#   sdist="$(bash scripts/llama_cpp_sdist.sh)"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
say() { echo "llama_cpp_sdist.sh: $*" >&2; }

# shellcheck source=/dev/null
. "$ROOT/vendor/ggml.pin"
DOWNLOADS="$ROOT/vendor/downloads"
SDIST="$DOWNLOADS/$GGML_SDIST_FILE"
if [ ! -f "$SDIST" ]; then
    [ "${GGML_OFFLINE:-0}" = 1 ] && { say "GGML_OFFLINE=1 but $SDIST is missing"; exit 1; }
    say "downloading $GGML_PYPI_REQUIREMENT (source distribution) into vendor/downloads"
    mkdir -p "$DOWNLOADS"
    # pip may fail to prepare the sdist's metadata after the file arrived: the file is what counts
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$DOWNLOADS" "$GGML_PYPI_REQUIREMENT" \
        2> "$DOWNLOADS/pip.log" || [ -f "$SDIST" ] || { tail -n 5 "$DOWNLOADS/pip.log" >&2; exit 1; }
fi
got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
if [ "$got" != "$GGML_SDIST_SHA256" ]; then
    mv -f "$SDIST" "$SDIST.rejected"
    say "sha256 mismatch for $GGML_SDIST_FILE: expected $GGML_SDIST_SHA256, got $got (moved aside to $SDIST.rejected)"
    exit 1
fi
echo "$SDIST"
