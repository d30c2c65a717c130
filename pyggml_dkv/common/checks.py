"""Argument checks shared by every layer: validate in Python before anything reaches C."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, TypeGuard

import numpy as np


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """A Python or numpy integer, and not a bool (True would otherwise count as 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]; TypeError for a non-integer, ValueError out of range."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise ValueError(f"{name} must be in {bounds}, got {v}")
    return v


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """`value` if it is one of `choices`, else a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def is_real(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """A Python or numpy int or float, and not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
