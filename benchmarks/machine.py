"""The machine a benchmark ran on, as every result file names it, and the process settings a
benchmark must make before its native libraries load (no imports beyond the standard library)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def early_option(argv: list[str], flag: str, default: str) -> str:
    """`flag`'s value in argv (`--flag V` or `--flag=V`) before argparse runs, else `default`."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def set_omp_wait_policy(policy: str) -> None:
    """OMP_WAIT_POLICY for this process's OpenMP runtimes (read when they load, so call this before
    importing numpy, torch or ggml): "active", "passive", or "default" (unset: OpenMP's own default,
    which spins a while and then sleeps; a llama.cpp host process runs under it)."""
    if policy.lower() not in ("active", "passive", "default"):
        raise SystemExit(f"--omp-wait-policy must be active, passive or default, got {policy!r}")
    if policy.lower() == "default":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_family_model() -> str:
    """ "family F model M" from /proc/cpuinfo: "AMD EPYC" alone does not say Zen 4 or Zen 5."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return ""
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def git_commit() -> str:
    """The checkout's commit (short), with "+dirty" when files differ from it; "" outside git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")
