"""bf16 bit patterns (common.bf16) against ggml's own converter, and the parity figure."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml_dkv.common.bf16 import from_bf16_bits as bf16_bits_to_fp32
from pyggml_dkv.common.bf16 import to_bf16_bits as fp32_to_bf16_bits
from pyggml_dkv.common.numeric import relative_error
from pyggml_dkv.ggml._lowlevel import ffi, lib


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _ggml_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_bf16_row, in chunks of < 32 so a build with AVX512-BF16 stays on the exact scalar path."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.size, np.uint16)
    for start in range(0, x.size, 31):
        n = min(31, x.size - start)
        lib.ggml_fp32_to_bf16_row(
            ffi.from_buffer("float[]", x[start : start + n]),
            ffi.cast("ggml_bf16_t *", ffi.from_buffer(out[start : start + n])),
            n,
        )
    return out


def test_fp32_to_bf16_bits_matches_ggml(rng):
    special = np.array(
        [
            np.inf,
            -np.inf,
            0.0,
            -0.0,
            np.nan,
            -np.nan,
            1e-45,
            -1e-45,
            1e-40,
            1.1754942e-38,
            1.17549435e-38,
            3.4028235e38,
            -3.4028235e38,
            3.3961514e38,
            1.0,
            -2.5,
        ],
        np.float32,
    )
    bit_patterns = np.array(
        [
            0x3F808000,
            0x3F818000,
            0x3F807FFF,
            0x3F808001,  # ties to even (down, up), just below / above a tie
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F7F8000,  # rounding up into +-inf
            0x7F800001,
            0xFF800001,
            0x7FC00001,
            0x7FBFFFFF,
            0xFFFFFFFF,  # signalling / quiet / payload NaNs
            0x00008000,
            0x00018000,
            0x0000FFFF,
            0x807FFFFF,
            0x00000001,  # subnormals (ties and round-up)
        ],
        np.uint32,
    ).view(np.float32)
    randoms = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = (rng.standard_normal(5000) * 10.0 ** rng.integers(-44, 38, 5000)).astype(np.float32)
    x = np.concatenate([special, bit_patterns, randoms, scaled])
    np.testing.assert_array_equal(fp32_to_bf16_bits(x), _ggml_bf16(x))
    # shapes and scalars are kept; NaNs come back quiet
    assert fp32_to_bf16_bits(x[:12].reshape(3, 4)).shape == (3, 4)
    assert fp32_to_bf16_bits(np.float32(1.0)).shape == () and int(fp32_to_bf16_bits(1.0)) == 0x3F80
    nan_bits = fp32_to_bf16_bits(bit_patterns[7:12])
    assert (nan_bits & 0x7FC0 == 0x7FC0).all()


def test_bf16_bits_roundtrip_every_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    values = bf16_bits_to_fp32(bits)
    back = fp32_to_bf16_bits(values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    np.testing.assert_array_equal(back[nan], bits[nan] | 0x40)


def test_relative_error():
    assert relative_error(np.array([1.0, 2.0]), np.array([1.0, 4.0])) == 0.5
    assert relative_error(np.zeros(2), np.zeros(2)) == 0.0
    assert relative_error(np.ones(2), np.zeros(2)) == 1.0
    with pytest.raises(ValueError):
        relative_error(np.zeros(2), np.zeros(3))


def test_bf16_bits_are_c_contiguous_for_any_input_layout():
    """Tensor.set hands the bits to ggml as raw bytes: a transposed input must not stay transposed."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for arr in (x.T, np.asfortranarray(x), x[:, ::2]):
        bits = fp32_to_bf16_bits(arr)
        assert bits.flags.c_contiguous and bits.shape == arr.shape
        np.testing.assert_array_equal(bf16_bits_to_fp32(bits), arr)
