"""The llama.cpp host tests need llama_cpp loaded in the test process. While pyggml_dkv ships
shared ggml libraries whose SONAMEs clash with llama-cpp-python's (coexist.py), loading both in one
pytest process would break whichever loads second; then this folder's tests run in a child
pytest process of their own (test_hosts_isolated.py), where our ggml is never loaded."""

from __future__ import annotations

import os
from pathlib import Path

from pyggml_dkv.hosts.llama_cpp.coexist import coexistence_problem

PROBLEM = coexistence_problem()
IN_CHILD = os.environ.get("PYGGML_DKV_HOSTS_CHILD") == "1"

if PROBLEM and not IN_CHILD:
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_hosts_isolated.py"]
