"""ggml's node barrier (P2, barrier-futex): a waiting thread sleeps instead of spinning."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pyggml_dkv.ggml import built_capabilities
from pyggml_dkv.ggml.capabilities import BARRIER_FUTEX
from tests.child import run_in_child

pytestmark = pytest.mark.slow  # a thread-barrier stress run: the slow tier


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the futex barrier is Linux-only")
def test_waiting_thread_sleeps_in_graph_barriers():
    """With our barrier (P2; old patches 0005 and 0014) a thread waiting at a node's barrier
    spins a few pauses and then sleeps (256-4096 pauses, adapted: back to 256 after every wait
    that ended asleep, so a thread whose waits are long, like this graph's, spins 256), even
    under OMP_WAIT_POLICY=ACTIVE (which makes `omp barrier` spin without end: on a shared machine
    that burns the time slices a descheduled partner needs, see benchmarks/README.md). A graph of
    single-threaded nodes then costs one core, not two."""
    if BARRIER_FUTEX not in built_capabilities():
        pytest.skip(f"ggml built without our barrier ({BARRIER_FUTEX}: its barrier is `omp barrier`)")
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE", OPENBLAS_NUM_THREADS="1")
    proc = run_in_child("tests.ggml.barrier_child:run", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ok"], "argmax results differ from numpy"
    assert got["wall"] > 0.02, got  # long enough to tell one busy core from two
    # the computing thread is busy all along; a spinning partner would double the process's CPU time
    assert got["cpu"] < 1.4 * got["wall"], got
