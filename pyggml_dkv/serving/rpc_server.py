"""ggml's RPC server as a program: `python -m pyggml_dkv.serving.rpc_server`.

    python -m pyggml_dkv.serving.rpc_server --host 127.0.0.1 --port 50052 --threads 4 --device cpu

A client connects with `Backend("rpc:HOST:PORT")`. The server serves one client connection at a
time; when it closes (or dies), the server frees that client's buffers and waits for the next.

- Security: ggml's RPC protocol has no authentication and no encryption. Whoever reaches the port
  can allocate memory on this machine and read or overwrite every tensor of the connected client.
  Binding to anything but a loopback address logs a loud warning; keep it on a trusted network
  (or behind an SSH tunnel).
- Thread wait policy: the server's CPU threads wait between a client's requests in OpenMP. With
  libgomp's default policy they spin for a while before sleeping; on a busy machine the spinning
  threads take the time slices of the ones that have work (steps 7-10x slower measured). So the
  server runs with OMP_WAIT_POLICY=PASSIVE unless the environment already sets it. libgomp reads
  the variable once, when it is loaded with ggml. The program therefore re-executes itself once
  with the variable in its environment (so it holds from the first instruction, whatever loads
  OpenMP, and shows in /proc/PID/environ). `serve()` called from Python sets it if ggml is not
  loaded yet, and otherwise logs a warning (start the server with `python -m ...` or
  RpcServerProcess instead).
- SIGTERM / SIGINT: logged, then the process exits with status 0 at once (ggml's server loop
  cannot be interrupted from outside; the OS closes the connection and frees everything).
- Version rule: run the server and its clients from the same pyggml_dkv version. The client
  checks the protocol version at connect and refuses a mismatch with both versions named.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any

from ..common.errors import PyggmlDkvError

log = logging.getLogger(__name__)

WAIT_POLICY = "PASSIVE"
MAX_THREADS = 512


class RpcServerError(PyggmlDkvError, RuntimeError):
    """The RPC server could not start (bad address, port in use, no such device)."""


def _check_args(host: str, port: int, threads: int, device: str) -> ipaddress.IPv4Address:
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(
            f"--host must be a dotted IPv4 address (ggml's server binds IPv4 only), got {host!r}"
        ) from None
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"--threads must be in 1..{MAX_THREADS}, got {threads!r}")
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"--device must be 'cpu' or 'cuda:N', got {device!r}")
    return address


def _set_wait_policy() -> None:
    """OMP_WAIT_POLICY=PASSIVE for this process's OpenMP, if ggml is not loaded yet."""
    current = os.environ.get("OMP_WAIT_POLICY")
    if "pyggml_dkv._ggml_cffi" in sys.modules:
        if (current or "").upper() != WAIT_POLICY:
            log.warning(
                "ggml was loaded before the RPC server started, with OMP_WAIT_POLICY=%s: its threads may spin "
                "between requests and slow a busy machine; start the server with "
                "`python -m pyggml_dkv.serving.rpc_server` instead",
                current or "(libgomp default)",
            )
        return
    if current is None:
        os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY  # putenv: libgomp reads it when ggml is loaded


def _device(spec: str) -> Any:
    from ..ggml import BackendUnavailableError, built_backends
    from ..ggml._lowlevel import ffi, lib
    from ..ggml.capabilities import ggml_kernels_only_requested

    if spec == "cpu":
        # the CPU device with our CPU_DKV buffer type as its own, where the build has it: the server
        # allocates every buffer from its device's type, so the f16 / bf16 weights a client uploads
        # sit where our narrow kernels take their products, as a local BackendWeights places them
        # (the same bits over RPC as on the local CPU). PYGGML_DKV_GGML_KERNELS_ONLY=1: ggml's CPU
        # device, as plain ggml's server (llama.cpp's ggml-rpc-server) serves it
        dev = ffi.NULL if ggml_kernels_only_requested() else lib.pyggml_dkv_cpu_dkv_device()
        if dev == ffi.NULL:
            dev = lib.ggml_backend_dev_by_name(b"CPU")
    else:
        if "cuda" not in built_backends():
            raise BackendUnavailableError(
                f"--device {spec}: this ggml build has no CUDA backend (GGML_CUDA=1 ./build_ggml.sh)"
            )
        dev = lib.ggml_backend_dev_by_name(f"CUDA{int(spec[5:])}".encode())
    if dev == ffi.NULL:
        raise BackendUnavailableError(f"--device {spec}: no such device on this machine")
    return dev


def _warn_if_exposed(address: ipaddress.IPv4Address, port: int) -> None:
    if address.is_loopback:
        return
    banner = "!" * 78
    log.warning(
        "\n%s\n! RPC server bound to %s:%d, beyond loopback.\n"
        "! ggml's RPC protocol has NO authentication and NO encryption: anyone who can reach\n"
        "! this port can use this machine's memory and device and read or change the connected\n"
        "! client's tensors. Use it only on a trusted network (or bind 127.0.0.1 + an SSH tunnel).\n%s",
        banner,
        address,
        port,
        banner,
    )


def serve(
    host: str = "127.0.0.1", port: int = 50052, threads: int = 1, device: str = "cpu", cache_dir: str | None = None
) -> None:
    """Run ggml's RPC server in this process until SIGTERM or SIGINT, then exit the process.

    Must be called from the main thread (signal handlers). Never returns normally: the process
    exits with status 0 on a signal, 1 when the server stops on its own (e.g. the port is taken)."""
    address = _check_args(host, port, threads, device)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("serve() must run in the main thread (it handles SIGTERM / SIGINT)")
    _set_wait_policy()
    from ..ggml._lowlevel import ffi, lib

    if not hasattr(lib, "ggml_backend_rpc_start_server"):
        raise RpcServerError(
            "this ggml build has no RPC backend; rebuild with GGML_RPC=1 ./build_ggml.sh and reinstall"
        )
    dev = _device(device)
    _warn_if_exposed(address, port)

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    devices = ffi.new("ggml_backend_dev_t[1]", [dev])
    endpoint = f"{address}:{port}".encode()
    cache = cache_dir.encode() if cache_dir else ffi.NULL

    def run() -> None:  # blocks in C (without the GIL) until the server fails
        lib.ggml_backend_rpc_start_server(endpoint, cache, threads, 1, devices)
        stop.set()

    log.info(
        "RPC server on %s:%d, device %s, %d thread(s), OMP_WAIT_POLICY=%s",
        address,
        port,
        device,
        threads,
        os.environ.get("OMP_WAIT_POLICY", "(libgomp default)"),
    )
    thread = threading.Thread(target=run, name="ggml-rpc-server", daemon=True)
    thread.start()
    while not stop.wait(0.5):
        pass
    if received:
        log.info("received %s: shutting down", signal.Signals(received[0]).name)
        code = 0
    else:
        log.error("the RPC server stopped (could not bind %s:%d? see above)", address, port)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the server thread is blocked in C: nothing to join; the OS frees everything


class RpcServerProcess:
    """An RPC server in a child process (`python -m pyggml_dkv.serving.rpc_server`), ready when
    the constructor returns: it has answered a protocol handshake. stop() sends SIGTERM.
    `RpcServerProcess.llama_cpp(...)` runs llama.cpp's own `ggml-rpc-server` the same way."""

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        threads: int = 1,
        device: str = "cpu",
        ready_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        _check_args(host, port, threads, device)
        cmd = [
            sys.executable,
            "-m",
            "pyggml_dkv.serving.rpc_server",
            "--host",
            host,
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--device",
            device,
        ]
        self._start(cmd, host, port, ready_timeout_s, env)

    @classmethod
    def llama_cpp(
        cls,
        binary: str | os.PathLike[str],
        port: int,
        host: str = "127.0.0.1",
        threads: int = 1,
        ready_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> RpcServerProcess:
        """llama.cpp's own `ggml-rpc-server` binary (`bash scripts/build_llama_cpp_tool.sh
        ggml-rpc-server` builds the one of the llama-cpp-python release we build on), serving its
        CPU device. It does not say what it computes on: give its Backend `device_type="cpu"`."""
        _check_args(host, port, threads, "cpu")
        path = os.fspath(binary)
        if not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise RpcServerError(f"{path!r} is not an executable file (build it: scripts/build_llama_cpp_tool.sh)")
        self = cls.__new__(cls)
        cmd = [path, "--host", host, "--port", str(port), "--threads", str(threads), "--device", "CPU"]
        self._start(cmd, host, port, ready_timeout_s, env)
        return self

    def _start(self, cmd: list[str], host: str, port: int, ready_timeout_s: float, env: dict[str, str] | None) -> None:
        self.host, self.port = host, port
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    @property
    def spec(self) -> str:
        return f"rpc:{self.host}:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self._output)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._output.append(line)

    def _wait_ready(self, timeout_s: float) -> None:
        from ..ggml import BackendUnavailableError, rpc

        endpoint = rpc.Endpoint(self.host, self.host, self.port)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RpcServerError(f"the RPC server exited with status {self.proc.returncode}:\n{self.output}")
            try:
                rpc.probe(endpoint, 1.0, self.spec)
                return
            except BackendUnavailableError:
                if time.monotonic() > deadline:
                    raise RpcServerError(
                        f"the RPC server did not answer on {endpoint} within {timeout_s:g} s:\n{self.output}"
                    ) from None
                time.sleep(0.05)

    def suspend(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: the server stalls (for tests of a frozen server). Returns once Linux reports the
        process stopped: the signal is delivered asynchronously, and a request sent in between
        could still be answered (seen once on a loaded machine)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RpcServerError(
                    f"the RPC server (pid {self.proc.pid}) has exited "
                    f"(code {self.proc.returncode}); it cannot be suspended"
                )
            try:
                with open(f"/proc/{self.proc.pid}/stat") as f:  # "pid (comm) state ...": the state follows the last ")"
                    if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                        return
            except FileNotFoundError:  # exited just now: poll() above says so next time round
                pass
            time.sleep(0.001)
        raise RpcServerError(f"the RPC server (pid {self.proc.pid}) did not stop within {timeout_s:g} s of SIGSTOP")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server dies without a goodbye."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM and wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RpcServerError(f"the RPC server ignored SIGTERM for {timeout_s:g} s; killed") from None

    def __enter__(self) -> RpcServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


def _reexec_with_wait_policy(argv: list[str]) -> None:
    """Replace this process by the same program with OMP_WAIT_POLICY set (once: only if unset)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    env = dict(os.environ, OMP_WAIT_POLICY=WAIT_POLICY)
    os.execve(
        sys.executable,
        [sys.executable, "-m", __spec__.name if __spec__ else "pyggml_dkv.serving.rpc_server", *argv],
        env,
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        _reexec_with_wait_policy(argv)
    parser = argparse.ArgumentParser(
        prog="python -m pyggml_dkv.serving.rpc_server",
        description="Serve this machine's CPU or GPU to pyggml_dkv clients over ggml RPC "
        "(no authentication, no encryption: trusted networks only).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to bind (default 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="CPU threads per graph compute (default: half the cores)",
    )
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda:N'")
    parser.add_argument(
        "--cache-dir", default=None, help="ggml's local tensor cache for large weight uploads (off by default)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        serve(args.host, args.port, args.threads, args.device, args.cache_dir)
    except (ValueError, PyggmlDkvError) as exc:
        log.error("%s", exc)
        return 2
    return 0  # pragma: no cover - serve() exits the process


if __name__ == "__main__":
    sys.exit(main())
