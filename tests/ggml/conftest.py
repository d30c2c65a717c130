"""Fixtures of the ggml layer's tests."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.ggml import Backend
from tests.ggml.helpers import RNG_SEED


@pytest.fixture(scope="module")
def be():
    backend = Backend("cpu", n_threads=2)
    yield backend
    backend.close()


@pytest.fixture
def rng():
    return np.random.default_rng(RNG_SEED)
