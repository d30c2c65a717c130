"""cffi out-of-line API build of pyggml_dkv._ggml_cffi with the ggml in pyggml_dkv/_libs linked in.

Run by setuptools (``cffi_modules`` in setup.py). The declarations live next to this file; the
CUDA and RPC ones are added only when build_ggml.sh built those backends, so the compiler checks
exactly what the linked libraries provide.

ggml is linked statically and kept private: every symbol of the static libraries becomes local
(``--exclude-libs,ALL``) and the version script ``exports.map`` exports only the module's init
function. A process that also loads llama.cpp's own ggml (same SONAMEs, same symbol names, other
version) then cannot bind either library to the other's functions. The build stamp (ggml version,
variant, build id) and the capability query (kernels.c: which of our fixes and kernels the build
carries) are compiled into the extension from _libs/include/pyggml_dkv_build.h, which build_ggml.sh
writes; pyggml_dkv._cffi.stamp checks the stamp at import.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
# PYGGML_DKV_GGML_PREFIX: link another build_ggml.sh-style prefix (scripts/memcheck.sh uses it)
LIBS = Path(os.environ.get("PYGGML_DKV_GGML_PREFIX", HERE.parent / "_libs")).resolve()
LIB_DIR = LIBS / "lib"
INCLUDE_DIR = LIBS / "include"
EXPORTS_MAP = HERE / "exports.map"
# C compiled into the extension next to ggml: custom ops (ggml_custom_4d) the Python layer builds,
# the AMX tile helper a llama.cpp host calls, and the capability query with the build stamp
OP_SOURCES = [HERE / "screened_argmax.c", HERE / "dynamic_conv.c", HERE / "amx_tiles.c", HERE / "kernels.c"]
# static libraries: dependents before what they use (the group below tolerates any order anyway)
CORE_LIBRARIES = ["ggml", "ggml-cpu", "ggml-base"]


def built_backends() -> list[str]:
    """Optional backends present in the ggml build (besides the always-built CPU one)."""
    return [name for name in ("cuda", "rpc") if (LIB_DIR / f"libggml-{name}.a").exists()]


def read_lines(name: str) -> list[str]:
    """Non-empty lines of a file build_ggml.sh wrote into the prefix ([] when it is absent)."""
    path = LIBS / name
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def source_path(path: Path) -> str:
    """A C source as setuptools takes it: relative to the working directory, setup.py's (it refuses
    absolute paths); a compile run from elsewhere (scripts/memcheck.sh) gets the absolute path."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def make_ffibuilder() -> FFI:
    if not (LIB_DIR / "libggml.a").exists():
        raise RuntimeError(f"ggml is not built: {LIB_DIR / 'libggml.a'} is missing; run ./build_ggml.sh")
    if not (INCLUDE_DIR / "pyggml_dkv_build.h").exists() or not read_lines("variant"):
        raise RuntimeError(
            f"{LIBS} lacks the build record (include/pyggml_dkv_build.h, variant): rebuild ggml with ./build_ggml.sh"
        )
    optional = built_backends()
    cdefs = (HERE / "cdefs_core.h").read_text()
    includes = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h"]
    libraries = list(CORE_LIBRARIES)
    for name in optional:
        cdefs += (HERE / f"cdefs_{name}.h").read_text()
        includes.append(f"ggml-{name}.h")
        libraries.insert(0, f"ggml-{name}")
    if "rpc" in optional and "GGML_RPC_FAILURES_ARE_ERRORS" in (INCLUDE_DIR / "ggml-rpc.h").read_text():
        # our RPC error patch (failures as errors, not aborts); an unpatched ggml aborts instead
        cdefs += (HERE / "cdefs_rpc_errors.h").read_text()
    if "ggml_graph_renew_uid" in (INCLUDE_DIR / "ggml.h").read_text():
        # our graph-uid patch: a graph built once is recomputed by its uid (RPC: GRAPH_RECOMPUTE)
        cdefs += (HERE / "cdefs_graph_uid.h").read_text()
    source = "\n".join(f'#include "{h}"' for h in [*includes, "custom_ops.h"]) + "\n"
    # kernels.c reports the RPC fix only where the RPC backend was built
    macros = [("PYGGML_DKV_WITH_RPC", "1")] if "rpc" in optional else []
    archives = [str(LIB_DIR / f"lib{name}.a") for name in libraries]
    # an ASan build of ggml (GGML_SANITIZE=address) instruments our own C too (the custom ops)
    sanitize = (
        ["-fsanitize=address", "-fno-omit-frame-pointer"] if "asan" in read_lines("variant")[0].split("-") else []
    )

    ffibuilder = FFI()
    ffibuilder.cdef(cdefs)
    ffibuilder.set_source(
        "pyggml_dkv._ggml_cffi",
        source,
        sources=[source_path(p) for p in OP_SOURCES],
        include_dirs=[str(INCLUDE_DIR), str(HERE)],  # HERE: custom_ops.h
        define_macros=macros,
        extra_compile_args=sanitize,
        # relink whenever ggml was rebuilt, even when the generated C source is unchanged
        depends=[
            *archives,
            str(LIBS / "link-args"),
            str(EXPORTS_MAP),
            *map(str, OP_SOURCES),
            str(HERE / "custom_ops.h"),
            str(INCLUDE_DIR / "pyggml_dkv_build.h"),
        ],
        extra_link_args=[
            "-Wl,--start-group",
            *archives,
            "-Wl,--end-group",
            # ggml's symbols stay inside the extension: hidden, and only PyInit_* exported
            "-Wl,--exclude-libs,ALL",
            f"-Wl,--version-script={EXPORTS_MAP}",
            # what ggml needs from the system (libstdc++, libgomp, CUDA runtime, ...), shared
            *read_lines("link-args"),
        ],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
