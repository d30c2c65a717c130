"""Tests that run PyTorch modules: their thread count, set for a module and put back after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def torch_threads(torch: Any, n: int) -> Iterator[None]:
    """PyTorch on `n` threads inside the block (the machine's other work keeps its cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
