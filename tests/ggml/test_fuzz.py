"""API fuzzing of the ggml layer: every misuse ends in a Python exception that names the
problem (the contract and the harness: tests/fuzzing.py; the cases: tests/ggml/fuzz_cases.py)."""

from __future__ import annotations

import pytest

from tests.fuzzing import run_fuzz_group

pytestmark = pytest.mark.slow  # hypothesis fuzzing of the ops: the slow tier

GROUPS = {"ggml_api": 150, "ggml_ops": 400}  # group -> examples at scale 1 (each example is one or more cases)


@pytest.mark.parametrize("group", list(GROUPS))
def test_fuzz_group(group, tmp_path):
    run_fuzz_group("tests.ggml.fuzz_cases", group, GROUPS[group], tmp_path)
