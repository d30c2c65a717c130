"""A live server (python -m pyggml_dkv.serve) on a loopback port, started by the tests themselves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

for module in ("fastapi", "uvicorn", "sse_starlette", "openai", "llama_cpp"):
    pytest.importorskip(module, reason='the server tests need the server extra: pip install -e ".[server]"')

from tests.hosts.hosts_helpers import THREADS, smollm2_path  # noqa: E402

API_KEY = "test-key"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp: Path, *extra: str, timeout: float = 120.0) -> Server:
    """The server as a child process; returns once /health answers (or fails with its log)."""
    import httpx

    smollm2_path()  # skips the test when the model cannot be had
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "pyggml_dkv.serve",
        "--port",
        str(port),
        "--threads",
        str(max(THREADS, 1)),
        "--log-level",
        "info",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_text()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not answer within {timeout} s:\n{server.log_text()[-3000:]}")


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """SmolLM2 + the shipped drafter, 4 requests at once, a queue of 16, an API key."""
    srv = start_server(
        tmp_path_factory.mktemp("serve"),
        "--parallel",
        "4",
        "--ctx-size",
        "512",
        "--max-queue",
        "16",
        "--api-key",
        API_KEY,
    )
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


@pytest.fixture
def client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
