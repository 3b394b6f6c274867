"""Quant codecs against the `gguf` package: dequantization bit for bit, quantization of the simple types byte for
byte, and typed errors for the types we do not support."""

import contextlib
import os
import warnings

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from juno_py.errors import UnsupportedQuantType
from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType
from juno_py.gguf.quants.simple import CHUNK_ELEMENTS, F16_SCALE_OFFSETS, round_half_away

ELEMENT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
BLOCK_TYPES = [
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q8_0,
    GGMLType.Q2_K,
    GGMLType.Q3_K,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
    GGMLType.IQ4_NL,
    GGMLType.IQ4_XS,
]
ENCODABLE_TYPES = ELEMENT_TYPES + [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]

# non-finite patterns of a float of each width, and the mask that makes any pattern finite (clears the
# exponent's top bit)
_FINITE_MASK = {2: np.uint16(0xBFFF), 4: np.uint32(0xBFFFFFFF)}
_F16_NON_FINITE = np.array([0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7FFF], dtype=np.uint16)  # ±inf, NaNs

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gguf_type(ggml_type: GGMLType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(int(ggml_type))


def reference_dequantize(ggml_type: GGMLType, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, _gguf_type(ggml_type))


def reference_quantize(ggml_type: GGMLType, x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the package warns on NaN and overflow, then proceeds
        out = gguf.quants.quantize(x, _gguf_type(ggml_type))
    return np.ascontiguousarray(out).view(np.uint8).reshape(x.shape[0], -1)


# `quants.dequantize` decodes the block types with the native decoder where it is built; "torch" runs the torch
# codecs alone (the fallback), so both are checked against gguf
BACKENDS = ["native", "torch"]


@contextlib.contextmanager
def backend_of(backend: str):
    saved = os.environ.get("JUNO_PY_NATIVE")
    os.environ["JUNO_PY_NATIVE"] = "0" if backend == "torch" else "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["JUNO_PY_NATIVE"]
        else:
            os.environ["JUNO_PY_NATIVE"] = saved


def juno_dequantize(ggml_type: GGMLType, raw: np.ndarray, n_cols: int, backend: str = "native") -> np.ndarray:
    with backend_of(backend):
        out = quants.dequantize(int(ggml_type), raw, n_cols)
    assert out.dtype == torch.float32 and tuple(out.shape) == (raw.shape[0], n_cols)
    return out.numpy()


def assert_bits_equal(expected: np.ndarray, actual: np.ndarray) -> None:
    expected = np.ascontiguousarray(expected, dtype=np.float32).reshape(actual.shape)
    if not np.array_equal(expected.view(np.uint32), actual.view(np.uint32)):
        diff = np.flatnonzero(expected.view(np.uint32) != actual.view(np.uint32))
        i = diff[0]
        raise AssertionError(
            f"{diff.size} of {actual.size} values differ; first at {i}: "
            f"{expected.ravel()[i]!r} vs {actual.ravel()[i]!r}"
        )


def assert_nan_aware_equal(expected: np.ndarray, actual: np.ndarray) -> None:
    """Same NaN positions, every other value bit for bit."""
    expected = np.ascontiguousarray(expected, dtype=np.float32).reshape(actual.shape)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(nan, np.isnan(actual))
    assert np.array_equal(expected.view(np.uint32)[~nan], actual.view(np.uint32)[~nan])


def random_rows(data, ggml_type: GGMLType, max_blocks: int = 6) -> tuple[np.ndarray, int]:
    """Random raw rows of a type, `[rows, bytes_per_row]`, and the row length in elements."""
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    if ggml_type in ELEMENT_TYPES:
        max_blocks *= 32
    rows = data.draw(st.integers(1, 3), label="rows")
    blocks = data.draw(st.integers(1, max_blocks), label="blocks per row")
    payload = data.draw(st.binary(min_size=rows * blocks * type_size, max_size=rows * blocks * type_size))
    raw = np.frombuffer(payload, dtype=np.uint8).copy().reshape(rows, blocks * type_size)
    return raw, blocks * block_size


def with_finite_scales(raw: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    if ggml_type in ELEMENT_TYPES:
        width = GGML_BLOCK_SIZES[ggml_type][1]
        elements = raw.view({2: np.uint16, 4: np.uint32}[width])
        elements &= _FINITE_MASK[width]
        return raw
    blocks = raw.reshape(-1, GGML_BLOCK_SIZES[ggml_type][1])
    for offset in F16_SCALE_OFFSETS[ggml_type]:
        field = blocks[:, offset : offset + 2].copy().view(np.uint16)
        blocks[:, offset : offset + 2] = (field & _FINITE_MASK[2]).view(np.uint8)
    return raw


# ---- dequantize ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", ELEMENT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
@SETTINGS
@given(data=st.data())
def test_dequantize_matches_gguf_bit_for_bit(ggml_type, backend, data):
    raw, n_cols = random_rows(data, ggml_type)
    raw = with_finite_scales(raw, ggml_type)
    assert_bits_equal(reference_dequantize(ggml_type, raw), juno_dequantize(ggml_type, raw, n_cols, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
@SETTINGS
@given(data=st.data())
def test_dequantize_non_finite_scales_match_gguf(ggml_type, backend, data):
    raw, n_cols = random_rows(data, ggml_type)
    blocks = raw.reshape(-1, GGML_BLOCK_SIZES[ggml_type][1])
    offsets = F16_SCALE_OFFSETS[ggml_type]
    for b in range(blocks.shape[0]):
        offset = offsets[data.draw(st.integers(0, len(offsets) - 1), label="scale")]
        pattern = _F16_NON_FINITE[data.draw(st.integers(0, len(_F16_NON_FINITE) - 1), label="pattern")]
        blocks[b, offset : offset + 2] = np.array([pattern], dtype=np.uint16).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = reference_dequantize(ggml_type, raw)
    actual = juno_dequantize(ggml_type, raw, n_cols, backend)
    assert np.isnan(actual).any() or np.isinf(actual).any()
    assert_nan_aware_equal(expected, actual)


@pytest.mark.parametrize("ggml_type", ELEMENT_TYPES, ids=lambda t: t.name)
def test_dequantize_non_finite_elements_match_gguf(ggml_type):
    width = GGML_BLOCK_SIZES[ggml_type][1]
    patterns = {
        2: [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x8001],
        4: [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x80000001],
    }[width]
    raw = np.array(patterns, dtype={2: np.uint16, 4: np.uint32}[width]).view(np.uint8).reshape(1, -1)
    assert_nan_aware_equal(reference_dequantize(ggml_type, raw), juno_dequantize(ggml_type, raw, len(patterns)))


def test_dequantize_accepts_torch_rows_and_returns_an_owned_tensor():
    raw = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = quants.dequantize(int(GGMLType.F32), torch.from_numpy(raw.view(np.uint8)), 4)
    out += 1  # writing the result must not write the source
    assert raw[0, 0] == 0 and out[0, 0] == 1
    q8 = reference_quantize(GGMLType.Q8_0, np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64))
    assert_bits_equal(
        reference_dequantize(GGMLType.Q8_0, q8), quants.dequantize(int(GGMLType.Q8_0), torch.from_numpy(q8), 64).numpy()
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ggml_type", ELEMENT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_empty_and_unaligned_buffers(ggml_type, backend):
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    assert juno_dequantize(ggml_type, np.zeros((0, 2 * type_size), np.uint8), 2 * block_size, backend).shape == (
        0,
        2 * block_size,
    )
    rng = np.random.default_rng(int(ggml_type))
    raw = with_finite_scales(rng.integers(0, 256, (3, 2 * type_size), dtype=np.uint8), ggml_type)
    shifted = torch.zeros(1 + raw.size, dtype=torch.uint8)
    shifted[1:] = torch.from_numpy(raw.ravel())
    actual = juno_dequantize(ggml_type, shifted[1:].view(3, -1), 2 * block_size, backend)
    assert_bits_equal(reference_dequantize(ggml_type, raw), actual)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_many_chunks_matches_gguf(backend):
    """More blocks than one chunk holds, with a ragged last chunk."""
    rng = np.random.default_rng(7)
    for ggml_type in (GGMLType.Q4_K, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.BF16):
        block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
        n_blocks = CHUNK_ELEMENTS // block_size * 2 + 3
        raw = with_finite_scales(rng.integers(0, 256, (1, n_blocks * type_size), dtype=np.uint8), ggml_type)
        assert_bits_equal(
            reference_dequantize(ggml_type, raw), juno_dequantize(ggml_type, raw, n_blocks * block_size, backend)
        )


# ---- quantize ------------------------------------------------------------------------------------------------


def assert_quantize_matches_gguf(ggml_type: GGMLType, x: np.ndarray) -> None:
    x = np.ascontiguousarray(x, dtype=np.float32)
    expected = reference_quantize(ggml_type, x)
    actual = quants.quantize(int(ggml_type), torch.from_numpy(x))
    assert actual.dtype == np.uint8 and actual.shape == expected.shape
    if not np.array_equal(expected, actual):
        type_size = GGML_BLOCK_SIZES[ggml_type][1]
        bad = np.flatnonzero((expected != actual).reshape(-1, type_size).any(axis=1))
        raise AssertionError(
            f"{ggml_type.name}: {bad.size} blocks differ, first block {bad[0]}: "
            f"{x.reshape(-1, GGML_BLOCK_SIZES[ggml_type][0])[bad[0]]!r}"
        )


@pytest.mark.parametrize("ggml_type", ENCODABLE_TYPES, ids=lambda t: t.name)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    exponent=st.sampled_from([-44, -40, -30, -8, -3, 0, 1, 4, 15, 30, 37]),
    rows=st.integers(1, 3),
    blocks=st.integers(1, 5),
    shape=st.sampled_from(["normal", "uniform", "skewed"]),
)
def test_quantize_matches_gguf_byte_for_byte(ggml_type, seed, exponent, rows, blocks, shape):
    rng = np.random.default_rng(seed)
    size = (rows, blocks * 32)
    if shape == "normal":
        x = rng.standard_normal(size)
    elif shape == "uniform":
        x = rng.uniform(-1, 1, size)
    else:
        x = rng.exponential(1.0, size) - 0.2
    assert_quantize_matches_gguf(ggml_type, (x * 10.0**exponent).astype(np.float32))


def edge_blocks() -> dict[str, np.ndarray]:
    """32-element blocks where quantizers go wrong: zero or tiny ranges, extremes, ties."""
    f32 = np.finfo(np.float32)
    rng = np.random.default_rng(3)
    blocks = {
        "zeros": np.zeros(32),
        "negative zeros": np.full(32, -0.0),
        "constant": np.full(32, 0.37),
        "negative constant": np.full(32, -2.5),
        "one outlier": np.where(np.arange(32) == 11, 1e30, rng.uniform(-1e-3, 1e-3, 32)),
        "one negative outlier": np.where(np.arange(32) == 30, -3e4, rng.uniform(-1, 1, 32)),
        "subnormal": rng.uniform(-1, 1, 32) * 1e-40,
        "smallest subnormals": rng.integers(-3, 4, 32) * float(f32.smallest_subnormal),
        "subnormal with zeros": np.where(np.arange(32) % 3 == 0, 0.0, 7e-45),
        "zeros of both signs": np.where(np.arange(32) % 3 == 0, -0.0, 0.0),
        "positive with zeros of both signs": np.where(
            np.arange(32) % 5 == 0, -0.0, np.where(np.arange(32) % 7 == 0, 0.0, 0.5)
        ),
        "negative with zeros of both signs": np.where(
            np.arange(32) % 5 == 0, 0.0, np.where(np.arange(32) % 7 == 0, -0.0, -0.5)
        ),
        "negative only": -rng.uniform(0.5, 2.0, 32),
        "positive only": rng.uniform(0.5, 2.0, 32),
        "float32 max": np.where(np.arange(32) % 2 == 0, float(f32.max), -float(f32.max)),
        "float32 max and small": np.where(np.arange(32) == 0, float(f32.max), rng.uniform(-1, 1, 32)),
        "float32 -max only": np.full(32, -float(f32.max)),
        "float16 max": np.where(np.arange(32) % 2 == 0, 65504.0, -65504.0),
        "beyond float16": rng.uniform(-1, 1, 32) * 1e6,
        "tie of magnitudes": np.where(np.arange(32) == 4, -5.0, np.where(np.arange(32) == 20, 5.0, 0.5)),
        "halves": (np.arange(32) - 15.5) / 2,
        "integers": np.arange(32) - 16.0,
    }
    return {name: np.asarray(v, dtype=np.float32) for name, v in blocks.items()}


@pytest.mark.parametrize("ggml_type", ENCODABLE_TYPES, ids=lambda t: t.name)
def test_quantize_edge_blocks_match_gguf(ggml_type):
    blocks = edge_blocks()
    for name, block in blocks.items():
        try:
            assert_quantize_matches_gguf(ggml_type, block.reshape(1, 32))
        except AssertionError as e:
            raise AssertionError(f"edge block {name!r}: {e}") from None
    assert_quantize_matches_gguf(ggml_type, np.stack(list(blocks.values())).reshape(1, -1))


@pytest.mark.parametrize("ggml_type", ENCODABLE_TYPES, ids=lambda t: t.name)
def test_quantize_blocks_of_signed_zeros_and_ties_match_gguf(ggml_type):
    """Which of several equal extremes (+0 or −0, x or −x) sets a scale's sign bit is decided by how numpy
    reduces: thousands of blocks drawn from a few such values."""
    rng = np.random.default_rng(21)
    values = np.array([0.0, -0.0, 0.5, -0.5, 1.0, 1.4e-45, -1.4e-45], dtype=np.float32)
    weights = [[0.3, 0.3, 0.1, 0.1, 0.1, 0.05, 0.05], [0.45, 0.45, 0.1, 0, 0, 0, 0], [0.4, 0.4, 0, 0.2, 0, 0, 0]]
    blocks = np.concatenate([rng.choice(values, size=(1000, 32), p=w) for w in weights])
    assert_quantize_matches_gguf(ggml_type, blocks.reshape(-1, 128))


@pytest.mark.parametrize("ggml_type", ENCODABLE_TYPES, ids=lambda t: t.name)
def test_quantize_non_finite_inputs_match_gguf(ggml_type):
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    signalling = np.array([0x7F800001, 0xFFA12345], dtype=np.uint32).view(np.float32)
    blocks = [
        np.where(np.arange(32) == 3, inf, 1.0),
        np.where(np.arange(32) == 3, -inf, 1.0),
        np.where(np.arange(32) == 7, nan, np.linspace(-1, 1, 32)),
        np.full(32, nan),
        np.where(np.arange(32) < 2, signalling[np.arange(32) % 2], 0.25),
    ]
    for block in blocks:
        assert_quantize_matches_gguf(ggml_type, np.asarray(block, dtype=np.float32).reshape(1, 32))


def test_f16_quantize_rounds_like_numpy_on_every_exponent():
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).reshape(64, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = x.astype(np.float16).view(np.uint8)
    np.testing.assert_array_equal(expected, quants.quantize(int(GGMLType.F16), torch.from_numpy(x)))


def test_bf16_quantize_rounds_to_nearest_even_like_gguf():
    rng = np.random.default_rng(12)
    bits = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    bits[:64] = (bits[:64] & 0xFFFF0000) | 0x8000  # exact ties
    bits[64:128] &= 0x807FFFFF  # subnormals
    assert_quantize_matches_gguf(GGMLType.BF16, bits.view(np.float32).reshape(64, -1))


def test_round_half_away_matches_gguf_formula_near_every_tie():
    """Q8_0's rounding against gguf's np_roundf on every float32 in [0.45, 0.55) and on the 2^12 floats either side
    of each half-integer below 256, both signs."""
    dense = np.arange(*np.array([0.45, 0.55], dtype=np.float32).view(np.int32), dtype=np.int32)
    ties = np.array(np.arange(0.5, 256, 1.0), dtype=np.float32).view(np.int32)
    near = (ties[:, None] + np.arange(-(1 << 12), 1 << 12, dtype=np.int32)).ravel()
    y = np.concatenate([dense, near]).view(np.float32)
    y = np.concatenate([y, -y, np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = gguf.quants.np_roundf(y).astype(np.int8)
    actual = round_half_away(torch.from_numpy(y)).to(torch.int8).numpy()
    np.testing.assert_array_equal(expected, actual)


def test_quantize_then_dequantize_round_trips_through_gguf_layout():
    x = np.random.default_rng(5).standard_normal((4, 256)).astype(np.float32)
    for ggml_type in (GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.Q8_0):
        encoded = quants.quantize(int(ggml_type), torch.from_numpy(x))
        assert_bits_equal(reference_dequantize(ggml_type, encoded), juno_dequantize(ggml_type, encoded, 256))


# ---- unsupported ----------------------------------------------------------------------------------------------


def test_unsupported_type_raises_naming_it():
    raw = np.zeros((1, 292), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantType, match="Q8_K"):
        quants.dequantize(int(GGMLType.Q8_K), raw, 256)
    with pytest.raises(UnsupportedQuantType, match="IQ2_XXS"):
        quants.quantize(16, torch.zeros(1, 256))
    with pytest.raises(UnsupportedQuantType, match="type 99"):
        quants.dequantize(99, raw, 256)


def test_decode_only_type_refuses_to_encode_naming_it():
    with pytest.raises(UnsupportedQuantType, match="cannot encode GGML type IQ1_S"):
        quants.quantize(int(GGMLType.IQ1_S), torch.zeros(1, 256))


def test_row_length_not_a_multiple_of_the_block_raises():
    with pytest.raises(UnsupportedQuantType, match="Q4_K.*256"):
        quants.dequantize(int(GGMLType.Q4_K), np.zeros((1, 144), dtype=np.uint8), 200)
    with pytest.raises(UnsupportedQuantType, match="Q8_0.*32"):
        quants.quantize(int(GGMLType.Q8_0), torch.zeros(2, 48))
