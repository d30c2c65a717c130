"""Backend: a ggml compute backend ("cpu", "cuda:N", "rpc:HOST:PORT")."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..common.checks import is_int
from ._lowlevel import ffi, lib
from .capabilities import built_backends, cuda_device_count, default_n_threads
from .errors import BackendUnavailableError, GGMLError
from .owned import Owned

if TYPE_CHECKING:  # pragma: no cover
    from .graph import Graph
    from .tensor import Tensor


class Backend(Owned):
    """A ggml compute backend: "cpu", "cuda" / "cuda:N", or "rpc:HOST:PORT"."""

    def __init__(self, spec: str = "cpu", n_threads: int | None = None) -> None:
        if not isinstance(spec, str):
            raise TypeError(f"backend spec must be a string like 'cpu' or 'cuda:0', got {type(spec).__name__}")
        self.spec = spec.strip().lower()
        self.kind = self.spec.split(":", 1)[0]
        # graph computes on one backend are serialized: ggml backends are not re-entrant
        self.lock = threading.Lock()
        if self.kind == "cpu":
            if self.spec != "cpu":
                raise ValueError(f"CPU backend spec is just 'cpu', got {spec!r}")
            if n_threads is not None:
                Backend._check_n_threads(n_threads)  # before a handle exists to leak
            handle = lib.ggml_backend_cpu_init()
            if handle == ffi.NULL:
                raise GGMLError("ggml_backend_cpu_init failed")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.set_n_threads(default_n_threads() if n_threads is None else n_threads)
        elif self.kind == "cuda":
            device = self._parse_index(spec)
            if "cuda" not in built_backends():
                raise BackendUnavailableError(
                    f"{spec!r}: this ggml build has no CUDA backend; rebuild with GGML_CUDA=1 ./build_ggml.sh and reinstall")
            n = cuda_device_count()
            if n == 0:
                raise BackendUnavailableError(f"{spec!r}: ggml was built with CUDA but no CUDA device is visible (no GPU or no driver on this machine)")
            if device >= n:
                raise BackendUnavailableError(f"{spec!r}: CUDA device {device} does not exist ({n} visible)")
            handle = lib.ggml_backend_cuda_init(device)
            if handle == ffi.NULL:
                raise GGMLError(f"ggml_backend_cuda_init({device}) failed (see the pyggml_dkv.ggml log)")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.n_threads = 0
        elif self.kind == "rpc":
            endpoint = spec.split(":", 1)[1] if ":" in spec else ""
            endpoint = endpoint.removeprefix("//")
            if "rpc" not in built_backends():
                raise BackendUnavailableError(f"{spec!r}: this ggml build has no RPC backend; rebuild with GGML_RPC=1 ./build_ggml.sh")
            if ":" not in endpoint:
                raise ValueError(f"RPC backend spec must be 'rpc:HOST:PORT', got {spec!r}")
            handle = lib.ggml_backend_rpc_init(endpoint.encode(), 0)
            if handle == ffi.NULL:
                raise BackendUnavailableError(f"could not connect to the RPC server at {endpoint}")
            self._own(handle, lib.ggml_backend_free, "backend")
            self.n_threads = 0
        else:
            raise ValueError(f"unknown backend {spec!r}; expected 'cpu', 'cuda', 'cuda:N' or 'rpc:HOST:PORT'")

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
        return self.kind == "cpu"

    def close(self) -> None:
        """Free the backend. Idempotent. A graph compute running on it in another thread finishes first."""
        with self.lock:
            super().close()

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

    def compute(self, graph: "Graph") -> None:
        """Run a graph whose tensors are all allocated. The GIL is released meanwhile."""
        graph.compute(self)

    def supports(self, tensor: "Tensor") -> bool:
        return bool(lib.ggml_backend_supports_op(self.handle, tensor.ptr))

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.name
        return f"Backend({self.spec!r}, {state})"
