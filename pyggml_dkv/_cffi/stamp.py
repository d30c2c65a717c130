"""The import-time check that the extension runs the ggml this package was built for.

build_ggml.sh records in pyggml_dkv/_libs which ggml it built (`version`: the version pinned in
vendor/ggml.pin, or that of a GGML_SRC tree; `variant`; `patches`: the vendor/patches applied).
The Python layer trusts those files (bf16_attention_supported(), amx_available()), so they must
describe the code that actually runs. _cffi/build.py compiles the same three facts into the
extension when it links ggml in, and ggml answers its own version at run time. A stale extension
(ggml rebuilt, extension not) or a ggml other than ours answering our calls (what happened when
ggml was a shared library next to llama.cpp's) then fails at import instead of computing with
the wrong kernels.

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
    """Which ggml: its version, the build variant (cpu, cpu-rpc, cpu-cuda, ...) and our patches."""

    version: str
    variant: str
    patches: tuple[str, ...]

    def __str__(self) -> str:
        patches = ", ".join(self.patches) if self.patches else "no patches"
        return f"ggml {self.version} ({self.variant}; {patches})"


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def expected_build(libs_dir: Path = LIBS_DIR) -> BuildStamp:
    """What the package was built for, as build_ggml.sh recorded it in pyggml_dkv/_libs."""
    version = _read_lines(libs_dir / "version")
    variant = _read_lines(libs_dir / "variant")
    return BuildStamp(
        version[0] if version else "(not recorded)",
        variant[0] if variant else "(not recorded)",
        tuple(_read_lines(libs_dir / "patches")),
    )


def extension_build(ffi: Any, lib: Any) -> BuildStamp:
    """What the extension was compiled with (its baked-in stamp)."""
    patches = ffi.string(lib.pyggml_dkv_built_patches()).decode()
    return BuildStamp(
        ffi.string(lib.pyggml_dkv_built_ggml_version()).decode(),
        ffi.string(lib.pyggml_dkv_built_variant()).decode(),
        tuple(p for p in patches.split(",") if p),
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
    running = ffi.string(lib.ggml_version()).decode()
    if running != built.version:
        raise ImportError(
            f"pyggml_dkv's extension was built with ggml {built.version}, but the ggml answering its "
            f"calls is version {running}: another ggml in this process took its place. Rebuild: pip install -e ."
        )
    return built
