"""The import-time check that the extension runs the ggml this package was built for.

build_ggml.sh records in pyggml_dkv/_libs which ggml it built (`version`: the version pinned in
vendor/ggml.pin, or that of a GGML_SRC tree; `variant`; `build-id`: "pyggml_dkv-<hash>" of the
source, patch series, variant and options) and writes the same three facts into
_libs/include/pyggml_dkv_build.h, from which the extension's C (kernels.c) is compiled. The build
id is also what ggml itself answers at run time: build_ggml.sh makes it ggml's commit string
(ggml_commit()). A stale extension (ggml rebuilt, extension not) or a ggml other than ours answering
the extension's calls (what happened when ggml was a shared library next to llama.cpp's, which
reports the same version as ours now) then fails at import instead of computing with the wrong
kernels.

This module needs no extension to import, so a test can replace `expected_build` before the
extension is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIBS_DIR = Path(__file__).resolve().parent.parent / "_libs"


@dataclass(frozen=True)
class BuildStamp:
    """Which ggml: its version, the build variant (cpu, cpu-rpc, cpu-cuda, ...) and its build id."""

    version: str
    variant: str
    build_id: str

    def __str__(self) -> str:
        return f"ggml {self.version} ({self.variant}; build {self.build_id})"


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def expected_build(libs_dir: Path = LIBS_DIR) -> BuildStamp:
    """What the package was built for, as build_ggml.sh recorded it in pyggml_dkv/_libs."""
    version, variant, build_id = (_read_lines(libs_dir / name) for name in ("version", "variant", "build-id"))
    return BuildStamp(*(lines[0] if lines else "(not recorded)" for lines in (version, variant, build_id)))


def extension_build(ffi: Any, lib: Any) -> BuildStamp:
    """What the extension was compiled with (its baked-in stamp)."""
    return BuildStamp(
        ffi.string(lib.pyggml_dkv_built_ggml_version()).decode(),
        ffi.string(lib.pyggml_dkv_built_variant()).decode(),
        ffi.string(lib.pyggml_dkv_built_ggml_build_id()).decode(),
    )


def check_extension(ffi: Any, lib: Any) -> BuildStamp:
    """Raise ImportError unless the extension and the ggml answering its calls are the recorded build."""
    expected = expected_build()
    built = extension_build(ffi, lib)
    if built != expected:
        raise ImportError(
            f"pyggml_dkv's extension was built with {built}, but the package expects {expected} "
            f"(recorded in {LIBS_DIR}). Rebuild: pip install -e . (after ./build_ggml.sh)."
        )
    running = ffi.string(lib.ggml_commit()).decode()
    if running != built.build_id:
        raise ImportError(
            f"pyggml_dkv's extension was built with ggml build {built.build_id}, but the ggml answering its "
            f"calls is build {running!r} (ggml {ffi.string(lib.ggml_version()).decode()}): another ggml in this "
            "process took its place. Rebuild: pip install -e ."
        )
    return built
