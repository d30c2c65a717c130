"""Builds ggml through build_ggml.sh (at once when nothing changed), then the cffi extension."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def ensure_ggml_built() -> None:
    # always asked: build_ggml.sh returns in well under a second when the source and options
    # (GGML_RPC, GGML_CUDA, GGML_SRC, ...) are those of the last build, and rebuilds otherwise
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.check_call(["bash", str(ROOT / "build_ggml.sh")], env=env)


ensure_ggml_built()
setup(cffi_modules=["pyggml_dkv/_cffi/build.py:ffibuilder"])
