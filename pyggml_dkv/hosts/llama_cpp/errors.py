"""Exceptions of the llama.cpp host."""

from __future__ import annotations

from ...common.errors import PyggmlDkvError


class HostError(PyggmlDkvError, RuntimeError):
    """The llama.cpp host cannot do what was asked (bad input, closed host, llama.cpp failure)."""


class HostClosedError(HostError):
    """The host (or its target) was closed."""


class IncompatibleDrafterError(HostError, ValueError):
    """The drafter does not fit the target: hidden size, layer count, layer ids or vocab differ."""
