"""Child-process cases for tests/test_private_ggml.py (this module must not load the extension:
the cases change what the package expects before the extension is imported)."""

from __future__ import annotations

from pathlib import Path

from pyggml_dkv._cffi.stamp import BuildStamp


def import_with_expected(version: str, build_id: str, out_path: str) -> None:
    """Make the package expect another ggml version or build id (when given), then import."""
    import pyggml_dkv._cffi.stamp as stamp

    real = stamp.expected_build()
    fake = BuildStamp(version or real.version, real.variant, build_id or real.build_id)
    stamp.expected_build = lambda *args: fake
    try:
        import pyggml_dkv.ggml  # noqa: F401
    except ImportError as exc:
        Path(out_path).write_text(f"ImportError: {exc}")
    else:
        Path(out_path).write_text("imported")
