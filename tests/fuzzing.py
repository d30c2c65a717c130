"""API fuzzing harness: each group of cases runs in its own child interpreter (tests.child), so
a segfault or a ggml abort fails that group's test instead of killing the test run.

The contract checked for every case (the groups live in tests/<layer>/fuzz_cases.py):

* a misuse raises ValueError, TypeError or RuntimeError (GGMLError is a RuntimeError), never
  anything else, and the message contains a word naming the problem;
* a valid call that looks unusual (non-contiguous, read-only, float16/float64, numpy ints,
  lists) succeeds and gives the same result as the plain call;
* after a failed call the object still works: a valid step gives the same result as a fresh cache;
* failed constructors leak nothing (`live_objects()` is unchanged).

The child drives hypothesis directly, writes each case to a log file before running it (so a
crash names the case that caused it), prints ``cases tried: N`` and exits 0; the parent asserts
both. Knobs: PYGGML_DKV_FUZZ_SCALE (multiplies the examples per group, default 1),
PYGGML_DKV_FUZZ_RANDOM=1 (random instead of derandomized hypothesis runs).
"""

from __future__ import annotations

import gc
import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.child import run_in_child

ALLOWED = (ValueError, TypeError, RuntimeError)
TRIED: dict[str, int] = {}  # group -> cases tried, printed in the test summary (conftest)


def scale() -> float:
    return float(os.environ.get("PYGGML_DKV_FUZZ_SCALE", "1"))


# ============================================================================ parent side


def run_fuzz_group(module: str, group: str, examples: int, tmp_path: Path) -> None:
    """Run one group in a child; assert it finished cleanly and tried enough cases."""
    log = tmp_path / f"{group}.log"
    proc = run_in_child("tests.fuzzing:child_main", module, group, str(examples), str(log))
    last = log.read_text().splitlines()[-5:] if log.exists() else []
    report = (
        f"exit {proc.returncode}\nlast cases:\n"
        + "\n".join(last)
        + f"\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    kind = f"crashed: signal {-proc.returncode}" if proc.returncode < 0 else "error"
    assert proc.returncode == 0, f"fuzz group {group!r} failed ({kind})\n{report}"
    m = re.search(r"cases tried: (\d+)", proc.stdout)
    assert m, report
    TRIED[group] = int(m.group(1))
    assert TRIED[group] >= examples * min(1.0, scale()), report


# ============================================================================ child side


class FuzzRun:
    """What a group's cases use: the hypothesis settings, case logging and the error contract."""

    def __init__(self, examples: int, log_path: str) -> None:
        self.n_examples = max(1, int(examples * scale()))
        self.log = open(log_path, "w")  # noqa: SIM115 (held by the run, closed when it ends)
        self.stats: dict[str, int] = {"cases": 0, "errors": 0}

    def fuzz(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        from hypothesis import HealthCheck, settings

        return settings(
            max_examples=self.n_examples,
            deadline=None,
            database=None,
            print_blob=True,
            derandomize=not os.environ.get("PYGGML_DKV_FUZZ_RANDOM"),
            suppress_health_check=list(HealthCheck),
        )(fn)

    def case(self, desc: str) -> None:
        self.stats["cases"] += 1
        self.log.write(desc[:300] + "\n")
        self.log.flush()

    def expect_error(self, fn: Callable[[], Any], words: Any, desc: str = "") -> BaseException:
        """fn() must raise an allowed exception whose message contains one of `words`."""
        self.case(f"expect error {words}: {desc}")
        try:
            fn()
        except ALLOWED as exc:
            msg = str(exc).lower()
            if not any(w.lower() in msg for w in words):
                raise AssertionError(f"{desc}: {type(exc).__name__}({exc}) does not name the problem {words}") from exc
            self.stats["errors"] += 1
            return exc
        except BaseException as exc:
            raise AssertionError(
                f"{desc}: raised {type(exc).__name__}({exc}), not ValueError/TypeError/RuntimeError"
            ) from exc
        raise AssertionError(f"{desc}: no exception (expected one naming {words})")


def objects() -> dict[str, int]:
    """The ggml handles alive now (after a collection)."""
    from pyggml_dkv import live_objects

    gc.collect()
    return {k: v for k, v in live_objects().items() if v}


def poke(a: np.ndarray, i: int, j: int, value: float) -> np.ndarray:
    out = np.array(a, dtype=np.float32, copy=True)
    out[i, j] = value
    return out


def variant(x: np.ndarray, kind: str) -> Any:
    """Valid but unusual spellings of the array x."""
    if kind == "f16":
        return x.astype(np.float16)
    if kind == "f64":
        return x.astype(np.float64)
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "strided":
        return np.repeat(x, 2, axis=1)[:, ::2]
    if kind == "readonly":
        y = x.copy()
        y.flags.writeable = False
        return y
    return x.tolist()


def short(obj: dict[str, Any]) -> str:
    text = repr({k: (f"array{getattr(v, 'shape', '')}" if hasattr(v, "shape") else v) for k, v in obj.items()})
    return text[:160]


def strategies() -> Any:
    """(bad_dtypes, small_shapes, not_ints): the hypothesis strategies every layer's groups share."""
    from hypothesis import strategies as st

    bad_dtypes = st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64, object])
    small_shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
    not_ints = st.one_of(
        st.booleans(),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.none(),
        st.just(np.float32(5.0)),
        st.just([5]),
        st.just(np.array([5])),
    )
    return bad_dtypes, small_shapes, not_ints


def child_main(module_name: str, group: str, examples: str, log_path: str) -> int:
    """Run `group` of tests.<layer>.fuzz_cases: its function gets a FuzzRun; the module's
    teardown() must leave no ggml object alive."""
    module = importlib.import_module(module_name)
    run = FuzzRun(int(examples), log_path)
    getattr(module, group)(run)
    module.teardown()
    left = objects()
    assert not left, f"ggml objects left alive: {left}"
    print(
        f"group {group}: cases tried: {run.stats['cases']} (errors raised: {run.stats['errors']}, "
        f"examples: {run.n_examples})",
        flush=True,
    )
    return 0
