"""API fuzzing of the drafter layer: every misuse ends in a Python exception that names the
problem (the contract and the harness: tests/fuzzing.py; the cases: tests/drafter/fuzz_cases.py)."""

from __future__ import annotations

import pytest

from tests.fuzzing import run_fuzz_group

pytestmark = pytest.mark.slow  # hypothesis fuzzing of the cache API: the slow tier

GROUPS = {
    "step_inputs": 150,
    "construct": 80,
    "weights_config": 150,
    "drafter": 120,
    "lifecycle": 60,
    "ring": 150,
}  # group -> examples at scale 1 (each example is one or more cases)


@pytest.mark.parametrize("group", list(GROUPS))
def test_fuzz_group(group, tmp_path):
    run_fuzz_group("tests.drafter.fuzz_cases", group, GROUPS[group], tmp_path)
