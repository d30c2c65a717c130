"""The ggml layer's exceptions."""

from __future__ import annotations

from ..common.errors import PyggmlDkvError


class GGMLError(PyggmlDkvError, RuntimeError):
    """A ggml call failed (allocation, compute, closed object, ...)."""


class BackendUnavailableError(GGMLError):
    """The requested backend is not built into this ggml or has no device on this machine."""


class RemoteBackendError(GGMLError):
    """The connection to an RPC server failed mid-use (server gone, stalled, malformed reply).
    The Backend stays failed and everything on it is lost: re-create them."""
