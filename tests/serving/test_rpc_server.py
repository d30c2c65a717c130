"""The server program: wait policy, SIGTERM, argument checks, the warning beyond loopback."""

from __future__ import annotations

import ipaddress
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pyggml_dkv.serving import RpcServerProcess, rpc_server


def test_server_runs_with_a_passive_wait_policy(server):
    env = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    assert b"OMP_WAIT_POLICY=PASSIVE" in env


def test_an_explicit_wait_policy_is_kept(free_port):
    import os

    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE")
    with RpcServerProcess(free_port(), env=env) as srv:
        assert b"OMP_WAIT_POLICY=ACTIVE" in Path(f"/proc/{srv.proc.pid}/environ").read_bytes().split(b"\0")


def test_sigterm_exits_cleanly_and_logs_it(server):
    assert server.stop() == 0
    server._reader.join(5)
    assert "received SIGTERM: shutting down" in server.output
    assert "Traceback" not in server.output


def test_suspend_returns_stopped_or_raises(free_port):
    """suspend() returns only once the server is stopped (SIGSTOP arrives asynchronously), and a
    server that cannot be stopped (here: already gone) is an error naming why, not a silent return."""
    with RpcServerProcess(free_port(), threads=1) as srv:
        srv.suspend()
        state = Path(f"/proc/{srv.proc.pid}/stat").read_text().rpartition(")")[2].split()[0]
        assert state in ("T", "t")
        srv.resume()
        with pytest.raises(rpc_server.RpcServerError, match="did not stop within 0 s of SIGSTOP"):
            srv.suspend(timeout_s=0)  # no time to see it stopped
        srv.resume()
        srv.proc.kill()
        srv.proc.wait(10)
        with pytest.raises(rpc_server.RpcServerError, match=r"has exited \(code -9\); it cannot be suspended"):
            srv.suspend(timeout_s=0.5)


def test_port_in_use_is_a_clean_failure(server):
    out = subprocess.run(
        [sys.executable, "-m", "pyggml_dkv.serving.rpc_server", "--port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "could not bind" in out.stderr


@pytest.mark.parametrize(
    "args", [["--host", "localhost"], ["--host", "::1"], ["--port", "70000"], ["--threads", "0"], ["--device", "gpu"]]
)
def test_bad_arguments_exit_2_without_a_traceback(args):
    out = subprocess.run(
        [sys.executable, "-m", "pyggml_dkv.serving.rpc_server", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr


def test_loud_warning_beyond_loopback_only(caplog):
    with caplog.at_level(logging.WARNING, logger=rpc_server.__name__):
        rpc_server._warn_if_exposed(ipaddress.IPv4Address("127.0.0.1"), 5000)
        assert not caplog.records
        rpc_server._warn_if_exposed(ipaddress.IPv4Address("0.0.0.0"), 5000)  # not bound: the check only
    assert "NO authentication and NO encryption" in caplog.text


def test_llama_cpp_server_needs_an_executable(tmp_path, free_port):
    """RpcServerProcess.llama_cpp names a missing or non-executable binary before starting anything."""
    not_executable = tmp_path / "ggml-rpc-server"
    not_executable.write_text("#!/bin/sh\n")
    for binary in (tmp_path / "missing", not_executable, tmp_path):
        with pytest.raises(rpc_server.RpcServerError, match="is not an executable file"):
            RpcServerProcess.llama_cpp(binary, free_port())
    with pytest.raises(ValueError, match="--port"):
        RpcServerProcess.llama_cpp(not_executable, 0)
