"""cffi out-of-line API build of pyggml_dkv._ggml_cffi against the ggml in pyggml_dkv/_libs.

Run by setuptools (``cffi_modules`` in setup.py). The declarations live next to this file; the
CUDA and RPC ones are added only when build_ggml.sh built those backends, so the compiler checks
exactly what the linked libraries provide.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
LIBS = HERE.parent / "_libs"
LIB_DIR = LIBS / "lib"
INCLUDE_DIR = LIBS / "include"


def built_backends() -> list[str]:
    """Optional backends present in the ggml build (besides the always-built CPU one)."""
    found = []
    if (LIB_DIR / "libggml-cuda.so").exists():
        found.append("cuda")
    if (LIB_DIR / "libggml-rpc.so").exists():
        found.append("rpc")
    return found


def make_ffibuilder() -> FFI:
    if not (LIB_DIR / "libggml.so").exists():
        raise RuntimeError(f"ggml is not built: {LIB_DIR / 'libggml.so'} is missing; run ./build_ggml.sh")
    optional = built_backends()
    cdefs = (HERE / "cdefs_core.h").read_text()
    includes = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h"]
    libraries = ["ggml", "ggml-base", "ggml-cpu"]
    for name in optional:
        cdefs += (HERE / f"cdefs_{name}.h").read_text()
        includes.append(f"ggml-{name}.h")
        libraries.append(f"ggml-{name}")
    source = "\n".join(f'#include "{h}"' for h in includes)

    ffibuilder = FFI()
    ffibuilder.cdef(cdefs)
    ffibuilder.set_source(
        "pyggml_dkv._ggml_cffi",
        source,
        include_dirs=[str(INCLUDE_DIR)],
        library_dirs=[str(LIB_DIR)],
        libraries=libraries,
        # the extension finds the ggml libraries shipped inside the package, wherever it is installed
        extra_link_args=["-Wl,-rpath,$ORIGIN/_libs/lib"],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
