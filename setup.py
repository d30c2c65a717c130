"""Builds ggml (through build_ggml.sh) when its static libraries are missing, then the cffi extension."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def ensure_ggml_built() -> None:
    if (ROOT / "pyggml_dkv" / "_libs" / "lib" / "libggml.a").exists():
        return
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.check_call(["bash", str(ROOT / "build_ggml.sh")], env=env)


ensure_ggml_built()
setup(cffi_modules=["pyggml_dkv/_cffi/build.py:ffibuilder"])
