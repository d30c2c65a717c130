"""Runs this folder's tests in a child pytest process when our ggml cannot share a process with
llama.cpp's (see conftest.py); skipped when it can (the tests then run here directly)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyggml_dkv.hosts.llama_cpp.coexist import coexistence_problem

PROBLEM = coexistence_problem()
IN_CHILD = os.environ.get("PYGGML_DKV_HOSTS_CHILD") == "1"

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(IN_CHILD or PROBLEM is None, reason="the host tests run in this process")
def test_host_tests_in_a_child_process() -> None:
    # find, never import: loading llama_cpp here, next to our ggml, is what this runner avoids
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("the llama.cpp host needs llama-cpp-python (pip install -e '.[llama]')")
    env = dict(os.environ, PYGGML_DKV_HOSTS_CHILD="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE)],
                          cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=1800)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
