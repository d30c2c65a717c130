"""Backend: a ggml compute backend ("cpu", "cuda:N", "rpc:HOST:PORT")."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ..common.checks import is_int
from . import rpc
from ._lowlevel import ffi, lib
from .capabilities import bf16_products_requested, built_backends, cuda_device_count, default_n_threads
from .errors import BackendUnavailableError, GGMLError, RemoteBackendError
from .owned import Owned

if TYPE_CHECKING:  # pragma: no cover
    from .graph import Graph
    from .tensor import Tensor


_log = logging.getLogger(__name__)


class Backend(Owned):
    """A ggml compute backend: "cpu", "cuda" / "cuda:N", or "rpc:HOST:PORT"."""

    _rpc_init_lock = threading.Lock()

    def __init__(
        self,
        spec: str = "cpu",
        n_threads: int | None = None,
        timeout_s: float | None = None,
        device_type: str | None = None,
    ) -> None:
        """`timeout_s` (RPC only, default rpc.DEFAULT_TIMEOUT_S): how long any one send or receive
        to the server may take (and the connect and handshake) before the backend is failed with
        RemoteBackendError. A graph compute is answered by the next download, so it must be longer
        than the slowest step.

        `device_type` (RPC only): what the server computes on, "cpu" or "gpu", for a server that
        does not say (llama.cpp's own `ggml-rpc-server`; ours does). Graphs choose their CPU-only
        shapes (the GQA fold) from it; unknown counts as a GPU. A server that says otherwise is
        refused."""
        if not isinstance(spec, str):
            raise TypeError(f"backend spec must be a string like 'cpu' or 'cuda:0', got {type(spec).__name__}")
        self.spec = spec.strip().lower()
        self.kind = self.spec.split(":", 1)[0]
        # graph computes on one backend are serialized: ggml backends are not re-entrant
        self.lock = threading.Lock()
        self.device_type: str | None = None  # what computes: "cpu", "gpu", ...; None if unknown
        self.rpc_endpoint: rpc.Endpoint | None = None
        self.rpc_server: rpc.ServerInfo | None = None
        if timeout_s is not None and self.kind != "rpc":
            raise ValueError(f"timeout_s applies to RPC backends only, not {spec!r}")
        if device_type is not None:
            if self.kind != "rpc":
                raise ValueError(f"device_type applies to RPC backends only, not {spec!r}")
            if device_type not in rpc.DECLARABLE_DEVICE_TYPES:
                raise ValueError(f"device_type must be one of {rpc.DECLARABLE_DEVICE_TYPES}, got {device_type!r}")
        if self.kind == "cpu":
            if self.spec != "cpu":
                raise ValueError(f"CPU backend spec is just 'cpu', got {spec!r}")
            if n_threads is not None:
                Backend._check_n_threads(n_threads)  # before a handle exists to leak
            bf16_products_requested()  # a misspelt PYGGML_DKV_BF16_PRODUCTS: ggml would ignore it
            handle = lib.ggml_backend_cpu_init()
            if handle == ffi.NULL:
                raise GGMLError("ggml_backend_cpu_init failed")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.set_n_threads(default_n_threads() if n_threads is None else n_threads)
            self.device_type = "cpu"
        elif self.kind == "cuda":
            device = self._parse_index(spec)
            if "cuda" not in built_backends():
                raise BackendUnavailableError(
                    f"{spec!r}: this ggml build has no CUDA backend; rebuild with GGML_CUDA=1 ./build_ggml.sh and reinstall"
                )
            n = cuda_device_count()
            if n == 0:
                raise BackendUnavailableError(
                    f"{spec!r}: ggml was built with CUDA but no CUDA device is visible (no GPU or no driver on this machine)"
                )
            if device >= n:
                raise BackendUnavailableError(f"{spec!r}: CUDA device {device} does not exist ({n} visible)")
            handle = lib.ggml_backend_cuda_init(device)
            if handle == ffi.NULL:
                raise GGMLError(f"ggml_backend_cuda_init({device}) failed (see the pyggml_dkv.ggml log)")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.n_threads = 0
            self.device_type = "gpu"
        elif self.kind == "rpc":
            self._init_rpc(spec, n_threads, timeout_s, device_type)
        else:
            raise ValueError(f"unknown backend {spec!r}; expected 'cpu', 'cuda', 'cuda:N' or 'rpc:HOST:PORT'")

    def _init_rpc(self, spec: str, n_threads: int | None, timeout_s: float | None, declared: str | None) -> None:
        host, port = rpc.parse_spec(self.spec)
        if n_threads is not None:
            raise ValueError(f"{spec!r}: the server's thread count is set where it runs (--threads), not here")
        if timeout_s is None:
            timeout_s = rpc.DEFAULT_TIMEOUT_S
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0.001 <= timeout_s <= 3600:
            raise ValueError(f"timeout_s must be a number of seconds in [0.001, 3600], got {timeout_s!r}")
        if "rpc" not in built_backends():
            raise BackendUnavailableError(
                f"{spec!r}: this ggml build has no RPC backend; rebuild with GGML_RPC=1 ./build_ggml.sh"
            )
        endpoint = rpc.resolve(host, port, spec)
        rpc.open_endpoints.claim(endpoint, self, spec)  # before any connection: a second one would hang
        try:
            info = rpc.probe(endpoint, timeout_s, spec)
            if declared is not None and info.device_type not in (None, declared):
                raise ValueError(
                    f"{spec!r}: device_type={declared!r} was given, but the server says it computes on "
                    f"{info.device_type!r}"
                )
            with Backend._rpc_init_lock:  # the timeout applies to the connection ggml opens next
                if hasattr(lib, "ggml_backend_rpc_set_timeout_ms"):  # our RPC error patch; else no timeout
                    lib.ggml_backend_rpc_set_timeout_ms(max(1, round(timeout_s * 1000)))
                handle = lib.ggml_backend_rpc_init(str(endpoint).encode(), 0)
            if handle == ffi.NULL:
                raise BackendUnavailableError(
                    f"RPC server {endpoint} ({spec!r}) answered the handshake, then ggml could not "
                    "use it (see the pyggml_dkv.ggml log)"
                )
        except BaseException:
            rpc.open_endpoints.release(endpoint, self)
            raise
        self._own(handle, lib.ggml_backend_free, "backend")
        self.n_threads = 0
        self.rpc_endpoint, self.rpc_server, self.timeout_s = endpoint, info, timeout_s
        self.device_type = info.device_type or declared
        if self.device_type is None:
            _log.warning(
                "RPC server %s did not say what device it computes on (not a pyggml_dkv server?): "
                "treated as a GPU, so CPU-only graph choices stay off (Backend(..., device_type='cpu') "
                "declares a CPU server)",
                endpoint,
            )

    @staticmethod
    def _check_n_threads(n_threads: object) -> None:
        if not is_int(n_threads) or not 1 <= n_threads <= 512:
            raise ValueError(f"n_threads must be an int in [1, 512], got {n_threads!r}")

    @staticmethod
    def _parse_index(spec: str) -> int:
        parts = spec.split(":")
        if len(parts) == 1:
            return 0
        if len(parts) == 2 and parts[1].isdigit():
            return int(parts[1])
        raise ValueError(f"bad device spec {spec!r}; expected 'cuda' or 'cuda:N'")

    @property
    def handle(self) -> Any:
        self._check_open()
        return self._handle

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_backend_name(self.handle)).decode()

    @property
    def is_cpu(self) -> bool:
        """This process's CPU backend (threads, host buffer types such as AMX)."""
        return self.kind == "cpu"

    @property
    def computes_on_cpu(self) -> bool:
        """The graph runs on a CPU: this process's, or an RPC server's CPU. Graph-shape choices
        made for CPU kernels (e.g. the GQA fold) depend on this, not on is_cpu."""
        return self.device_type == "cpu"

    @property
    def failed(self) -> bool:
        """An RPC backend whose connection failed (server gone, stalled past the timeout, bad
        reply). Nothing computed on it since can be trusted; it never recovers: re-create it."""
        return (
            self.kind == "rpc"
            and not self.closed
            and hasattr(lib, "ggml_backend_rpc_failed")
            and bool(lib.ggml_backend_rpc_failed(self._handle))
        )

    def check_connection(self) -> None:
        """Raise RemoteBackendError if this is an RPC backend whose connection failed."""
        if self.failed:
            raise RemoteBackendError(
                f"the connection to RPC server {self.rpc_endpoint} ({self.spec!r}) failed: the server exited, "
                f"stalled for over {self.timeout_s:g} s or replied malformed (see the pyggml_dkv.ggml log). "
                "Results since are lost; re-create the Backend and everything built on it"
            )

    def close(self) -> None:
        """Free the backend. Idempotent. A graph compute running on it in another thread finishes first."""
        with self.lock:
            super().close()
            if self.rpc_endpoint is not None:
                rpc.open_endpoints.release(self.rpc_endpoint, self)

    def set_n_threads(self, n_threads: int) -> None:
        if not self.is_cpu:
            raise GGMLError(f"thread count applies to the CPU backend only, not {self.spec}")
        Backend._check_n_threads(n_threads)
        lib.ggml_backend_cpu_set_n_threads(self.handle, n_threads)
        self.n_threads = n_threads

    @property
    def buffer_type(self) -> Any:
        return lib.ggml_backend_get_default_buffer_type(self.handle)

    def synchronize(self) -> None:
        lib.ggml_backend_synchronize(self.handle)

    def compute(self, graph: Graph) -> None:
        """Run a graph whose tensors are all allocated. The GIL is released meanwhile."""
        graph.compute(self)

    def supports(self, tensor: Tensor) -> bool:
        return bool(lib.ggml_backend_supports_op(self.handle, tensor.ptr))

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.name
        return f"Backend({self.spec!r}, {state})"
