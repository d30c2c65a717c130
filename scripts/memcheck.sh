#!/usr/bin/env bash
# Run a short drafter trajectory under valgrind memcheck (docs/hardening.md).
#
#   scripts/memcheck.sh                 build the valgrind-friendly ggml once, then run
#   MEMCHECK_STEPS=40 scripts/memcheck.sh
#   MEMCHECK_SCRIPT=tests/child.py scripts/memcheck.sh tests.fuzzing:child_main tests.ggml.fuzz_cases ggml_ops 100 /tmp/ops.log
#                                       (any script: here one fuzz group, 100 examples, through the test harness)
#
# valgrind cannot execute AVX-512, and the package's ggml is built with GGML_NATIVE=ON, so this
# builds a second copy of the pinned ggml (vendor/ggml) with AVX2/FMA/F16C only and debug info
# into vendor/build/cpu-memcheck-install, links a second copy of the cffi extension against it
# (ggml is linked statically into the extension), and runs the script on a copy of the package
# that holds that extension: vendor/build/cpu-memcheck-pkg, put first on PYTHONPATH. The package
# itself is not touched. Exit status: 0 clean, 99 memcheck found errors, anything else: the run failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/vendor/ggml"
BUILD="$ROOT/vendor/build/cpu-memcheck"
PREFIX="$ROOT/vendor/build/cpu-memcheck-install"
# the real interpreter, not a pyenv/venv shim script (valgrind would check the shell instead)
PYTHON="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"

[ -f "$SRC/CMakeLists.txt" ] || { echo "memcheck.sh: $SRC is missing: run ./build_ggml.sh first" >&2; exit 2; }
# what the package's own build recorded (its capabilities: the same source, so the same patches)
MAIN_RECORD="$ROOT/pyggml_dkv/_libs/include/pyggml_dkv_build.h"
[ -f "$MAIN_RECORD" ] || { echo "memcheck.sh: $MAIN_RECORD is missing: run ./build_ggml.sh first" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "memcheck.sh: valgrind not found (apt-get install valgrind)" >&2; exit 2; }

# rebuilt whenever the unpacked source changes (new pin or patches): never check stale code
SRC_ID="$(cat "$SRC/.pyggml_dkv_source" 2>/dev/null || echo custom)"
# this build's id, which ggml_commit() answers (build_ggml.sh does the same: a stand-in for git)
BUILD_ID="pyggml_dkv-$(printf '%s|memcheck' "$SRC_ID" | sha256sum | cut -c1-16)"
if [ ! -f "$PREFIX/lib/libggml-cpu.a" ] || [ "$(cat "$PREFIX/.source" 2>/dev/null)" != "$SRC_ID" ]; then
    rm -rf "$BUILD" "$PREFIX"
    mkdir -p "$(dirname "$BUILD")"
    printf '#!/bin/sh\n[ "$1" = rev-parse ] && echo %s\nexit 0\n' "$BUILD_ID" > "$BUILD.commit-stamp"
    chmod +x "$BUILD.commit-stamp"
    echo "memcheck.sh: building ggml without AVX-512 for valgrind (once; log: $BUILD.build.log)" >&2
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_SHARED_LIBS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DGGML_AVX512=OFF -DGGML_OPENMP=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF \
        -DCMAKE_INSTALL_LIBDIR=lib -DGIT_EXE="$BUILD.commit-stamp" \
        "-DGGML_CPU_DKV=$([ -d "$SRC/src/ggml-cpu/dkv" ] && echo ON || echo OFF)" \
        > "$BUILD.configure.log" 2>&1 || { tail -n 30 "$BUILD.configure.log" >&2; exit 2; }
    cmake --build "$BUILD" -j "${GGML_JOBS:-$(nproc)}" > "$BUILD.build.log" 2>&1 || { tail -n 30 "$BUILD.build.log" >&2; exit 2; }
    cmake --install "$BUILD" --prefix "$PREFIX" > "$BUILD.install.log" 2>&1 || { tail -n 20 "$BUILD.install.log" >&2; exit 2; }
    # what build_ggml.sh records next to its libraries, for the extension's build stamp
    sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$SRC/CMakeLists.txt" | paste -sd. > "$PREFIX/version"
    echo "cpu-memcheck" > "$PREFIX/variant"
    echo "$BUILD_ID" > "$PREFIX/build-id"
    sed -e "s/^#define PYGGML_DKV_GGML_VARIANT .*/#define PYGGML_DKV_GGML_VARIANT \"cpu-memcheck\"/" \
        -e "s/^#define PYGGML_DKV_GGML_BUILD_ID .*/#define PYGGML_DKV_GGML_BUILD_ID \"$BUILD_ID\"/" \
        "$MAIN_RECORD" > "$PREFIX/include/pyggml_dkv_build.h"
    printf '%s\n' -lstdc++ -lm -ldl -lpthread -fopenmp > "$PREFIX/link-args"
    echo "$SRC_ID" > "$PREFIX/.source"
fi

# the extension: relinked when ggml was rebuilt or its own sources (cdefs, custom ops) changed
EXT_ID="$SRC_ID $(cat "$ROOT"/pyggml_dkv/_cffi/*.py "$ROOT"/pyggml_dkv/_cffi/*.h "$ROOT"/pyggml_dkv/_cffi/*.c \
                  "$ROOT"/pyggml_dkv/_cffi/*.map | sha256sum | cut -c1-16)"
if [ "$(cat "$PREFIX/.ext" 2>/dev/null)" != "$EXT_ID" ]; then
    echo "memcheck.sh: linking the extension against it (log: $BUILD.cffi.log)" >&2
    rm -rf "$PREFIX/ext"
    mkdir -p "$PREFIX/ext"
    (cd "$PREFIX/ext" && PYGGML_DKV_GGML_PREFIX="$PREFIX" "$PYTHON" "$ROOT/pyggml_dkv/_cffi/build.py") \
        > "$BUILD.cffi.log" 2>&1 || { tail -n 30 "$BUILD.cffi.log" >&2; exit 2; }
    echo "$EXT_ID" > "$PREFIX/.ext"
fi

# the package's current Python code with the memcheck extension and its record of the build
PKG="$ROOT/vendor/build/cpu-memcheck-pkg"
rm -rf "$PKG"
mkdir -p "$PKG"
cp -r "$ROOT/pyggml_dkv" "$PKG/"
rm -rf "$PKG/pyggml_dkv/_libs" "$PKG"/pyggml_dkv/_ggml_cffi*
find "$PKG" -name __pycache__ -prune -exec rm -rf {} +
cp "$PREFIX"/ext/pyggml_dkv/_ggml_cffi*.so "$PKG/pyggml_dkv/"
mkdir -p "$PKG/pyggml_dkv/_libs"
cp "$PREFIX/version" "$PREFIX/variant" "$PREFIX/build-id" "$PKG/pyggml_dkv/_libs/"

cd "$ROOT"
SUPP="--suppressions=$ROOT/scripts/valgrind-python.supp"
[ "${MEMCHECK_NO_SUPP:-0}" = 1 ] && SUPP=""
exec env PYTHONMALLOC=malloc PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" \
    valgrind --tool=memcheck --error-exitcode=99 --errors-for-leak-kinds=none --leak-check=no \
    --track-origins=no --num-callers=30 ${SUPP} \
    ${VALGRIND_EXTRA:-} \
    "$PYTHON" "${MEMCHECK_SCRIPT:-$ROOT/scripts/memcheck_trajectory.py}" "$@"
