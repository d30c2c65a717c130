"""Every misuse of the ggml layer that ggml itself would answer with an abort (or silent garbage)
raises a Python exception instead. Each case (tests/ggml/error_cases.py) runs in a child
interpreter, so a case that kills its process is reported as a CRASH, and the remaining cases
go on in a fresh child."""

from __future__ import annotations

import pytest

from tests.child import run_in_child

# the parent reads the registry (names, expected exceptions); only the children run the cases
from tests.ggml import error_cases


def run_isolated(group: str, names: list[str]) -> dict[str, tuple[str, str]]:
    """name -> (exception type name or NOERROR or CRASH(rc=..), message) for each case of `group`."""
    results: dict[str, tuple[str, str]] = {}
    pending = list(names)
    while pending:
        proc = run_in_child("tests.ggml.error_cases:run_cases", group, *pending)
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = line.split(" ", 1)[1]
            elif line.startswith("RESULT "):
                _, name, exc, *msg = line.split(" ", 3)
                results[name] = (exc, msg[0] if msg else "")
                started = None
        if proc.returncode != 0 or started is not None:
            victim = started if started is not None else next(n for n in pending if n not in results)
            tail = " | ".join(proc.stderr.strip().splitlines()[-6:])
            results[victim] = (f"CRASH(rc={proc.returncode})", tail)
        pending = [n for n in pending if n not in results]
    return results


@pytest.fixture(scope="module")
def isolated_results():
    cache: dict[str, dict[str, tuple[str, str]]] = {}

    def get(group: str) -> dict[str, tuple[str, str]]:
        if group not in cache:
            cache[group] = run_isolated(group, list(error_cases.GROUPS[group]))
        return cache[group]

    return get


def check(results: dict[str, tuple[str, str]], group: str, name: str) -> None:
    expected = error_cases.GROUPS[group][name][0]
    got, msg = results[name]
    assert not got.startswith("CRASH"), f"{name}: the process died (ggml abort?): {msg}"
    assert got == expected, f"{name}: expected {expected}, got {got}: {msg}"
    if expected != "NOERROR":
        assert msg, f"{name}: {got} without a message"


@pytest.mark.parametrize("name", list(error_cases.GROUPS["tensor"]))
def test_tensor_and_context_errors(isolated_results, name):
    check(isolated_results("tensor"), "tensor", name)


@pytest.mark.parametrize("name", list(error_cases.GROUPS["ops"]))
def test_op_precondition_errors(isolated_results, name):
    check(isolated_results("ops"), "ops", name)


@pytest.mark.parametrize("name", list(error_cases.GROUPS["lifecycle"]))
def test_lifecycle_errors(isolated_results, name):
    check(isolated_results("lifecycle"), "lifecycle", name)


def test_isolation_harness_reports_a_crash():
    """The harness itself: an abort is reported as CRASH and later cases still run."""
    results = run_isolated("harness", ["ok", "abort", "after"])
    assert results["ok"][0] == "NOERROR"
    assert results["abort"][0].startswith("CRASH")
    assert results["after"] == ("ValueError", "still running")
