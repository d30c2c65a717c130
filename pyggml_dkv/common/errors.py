"""The base of every exception this package raises on purpose.

`except PyggmlDkvError` catches them all; each specific error also derives from the built-in
exception it refines (ValueError, RuntimeError, ...) so existing `except ValueError` code keeps
working.
"""

from __future__ import annotations


class PyggmlDkvError(Exception):
    """Base class of pyggml_dkv's own exceptions."""
