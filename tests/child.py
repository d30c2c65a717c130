"""The one way tests run code in a child interpreter: an importable function, by name.

A crash (segfault, ggml abort) or a process-wide state (exit handlers, environment variables
read at start-up, libraries loaded into the process) then affects that test alone. The parent
calls `run_in_child("tests.pkg.module:function", *args)`; the child runs
`python -X faulthandler -m tests.child tests.pkg.module:function args...`, calls the function
with the string arguments, and exits with its return value (0 for None).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_child(
    target: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `target` ("module:function") with `args` in a fresh interpreter; returns the process."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "tests.child", target, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        cwd=ROOT,
    )


def main(argv: list[str]) -> int:
    module_name, _, function_name = argv[0].partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(*argv[1:])
    return int(result or 0)


if __name__ == "__main__":
    if not __package__:  # run as a script (scripts/memcheck.sh): the package copy on PYTHONPATH stays first
        sys.path.append(str(ROOT))
    sys.exit(main(sys.argv[1:]))
