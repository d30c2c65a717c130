#!/usr/bin/env bash
# Print the path of the source distribution vendor/ggml.pin names (llama-cpp-python's, whose
# vendor/llama.cpp/ggml is our ggml), fetched once into vendor/downloads/ and checked against the
# pin's sha256. Everything that needs llama.cpp's sources takes them from this one file:
# build_ggml.sh (our ggml), install_llama_cpp.sh (the llama-cpp-python wheel, llama.cpp's
# converter) and build_llama_cpp_tool.sh (llama-server, ggml-rpc-server).
#
#   sdist="$(bash scripts/pinned_sdist.sh)"
#
# Before asking pip it looks in the pin's GGML_SDIST_SEARCH_DIRS (a copy downloaded elsewhere);
# GGML_OFFLINE=1 never touches the network. Exit status 1 with a message on stderr when the file
# cannot be had or its sha256 differs (it is then moved aside to *.rejected).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
say() { echo "pinned_sdist.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

# shellcheck source=/dev/null
. "$ROOT/vendor/ggml.pin"
DOWNLOADS="$ROOT/vendor/downloads"
SDIST="$DOWNLOADS/$GGML_SDIST_FILE"
mkdir -p "$DOWNLOADS"
for dir in ${GGML_SDIST_SEARCH_DIRS:-}; do
    if [ ! -f "$SDIST" ] && [ -f "$dir/$GGML_SDIST_FILE" ]; then
        say "using $dir/$GGML_SDIST_FILE"
        cp "$dir/$GGML_SDIST_FILE" "$SDIST.part" && mv "$SDIST.part" "$SDIST"
    fi
done
if [ ! -f "$SDIST" ]; then
    [ "${GGML_OFFLINE:-0}" = 1 ] && die "GGML_OFFLINE=1 but $SDIST is missing; copy it there or unset GGML_OFFLINE"
    say "downloading $GGML_PYPI_REQUIREMENT (source distribution) with pip into vendor/downloads"
    # pip may fail to prepare the sdist's metadata (inside an isolated build, without its build
    # requirements) after the file arrived: the file is what counts
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
            -d "$DOWNLOADS" "$GGML_PYPI_REQUIREMENT" 2> "$DOWNLOADS/pip.log" \
        || "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            -d "$DOWNLOADS" "$GGML_PYPI_REQUIREMENT" 2>> "$DOWNLOADS/pip.log" \
        || [ -f "$SDIST" ] \
        || { tail -n 5 "$DOWNLOADS/pip.log" >&2; die "pip could not download $GGML_PYPI_REQUIREMENT (no network or no PyPI?). Full log: $DOWNLOADS/pip.log"; }
    [ -f "$SDIST" ] || die "pip ran but $SDIST did not appear (see $DOWNLOADS/pip.log)"
fi
got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
if [ "$got" != "$GGML_SDIST_SHA256" ]; then
    mv -f "$SDIST" "$SDIST.rejected"
    die "sha256 mismatch for $GGML_SDIST_FILE: expected $GGML_SDIST_SHA256, got $got (moved aside to $SDIST.rejected)"
fi
echo "$SDIST"
