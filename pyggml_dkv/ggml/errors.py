"""The ggml layer's exceptions."""

from __future__ import annotations

from ..common.errors import PyggmlDkvError


class GGMLError(PyggmlDkvError, RuntimeError):
    """A ggml call failed (allocation, compute, closed object, ...)."""


class BackendUnavailableError(GGMLError):
    """The requested backend is not built into this ggml or has no device on this machine."""
