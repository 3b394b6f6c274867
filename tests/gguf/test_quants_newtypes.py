"""The decoders of IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0 and MXFP4 against the `gguf`
package, bit for bit, on enough random valid blocks that every grid index, sign pattern and scale code appears:
the native decoder (where it is built) and the torch codecs alone (`JUNO_PY_NATIVE=0`)."""

import gguf
import numpy as np
import pytest
import torch

from juno_py.errors import UnsupportedQuantType
from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType
from juno_py.gguf.quants.simple import CHUNK_ELEMENTS
from tests.gguf.newtype_blocks import (
    F16_FIELDS,
    NEW_TYPES,
    codebook_indices,
    random_blocks,
)

N_BLOCKS = 4096
BACKENDS = ["native", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("JUNO_PY_NATIVE", "0" if request.param == "torch" else "1")
    return request.param


def reference(ggml_type: GGMLType, raw: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4's largest scales overflow to ±inf times the largest levels
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(ggml_type)))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1)


def assert_bits_equal(expected: np.ndarray, actual: torch.Tensor) -> int:
    """Every float32 bit pattern equal, no NaN; returns the number of values compared."""
    actual = actual.numpy()
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    assert not np.isnan(expected).any()
    diff = np.flatnonzero(expected.view(np.int32) != actual.view(np.int32))
    assert diff.size == 0, (
        f"{diff.size} of {actual.size} values differ; first at {diff[0]}: "
        f"{expected.ravel()[diff[0]]!r} vs {actual.ravel()[diff[0]]!r}"
    )
    return actual.size


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_decode_matches_gguf_bit_for_bit(ggml_type, backend):
    block, size = GGML_BLOCK_SIZES[ggml_type]
    blocks = random_blocks(ggml_type, N_BLOCKS, seed=int(ggml_type))
    # every value of every byte that is not a float16 field appears, so every packed field takes every value
    scale_bytes = {o + i for o in F16_FIELDS[ggml_type] for i in (0, 1)}
    for column in set(range(size)) - scale_bytes:
        assert np.unique(blocks[:, column]).size == 256, column
    for what, (index, space) in codebook_indices(ggml_type, blocks).items():
        assert np.unique(index).size == space, what
    raw = blocks.reshape(16, -1)  # 16 rows of 256 blocks
    got = quants.dequantize(int(ggml_type), raw, raw.shape[1] // size * block)
    assert assert_bits_equal(reference(ggml_type, raw), got) == N_BLOCKS * block


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_decode_covers_every_scale_pattern(ggml_type, backend):
    """The float16 scale of every block takes each finite pattern's exponent and sign: zeros, subnormals, the
    largest values (and for MXFP4 every e8m0 byte, whose largest two overflow as in gguf)."""
    block = GGML_BLOCK_SIZES[ggml_type][0]
    blocks = random_blocks(ggml_type, 2 * 64, seed=100 + int(ggml_type))
    exponents = np.repeat(np.arange(64, dtype=np.uint16), 2)  # sign and 5 exponent bits, each twice
    exponents = exponents[(exponents & 0x1F) != 0x1F]
    patterns = (exponents << 10) | np.uint16(0x3FF) * (np.arange(exponents.size, dtype=np.uint16) % 2)
    blocks = blocks[: patterns.size]
    for offset in F16_FIELDS[ggml_type]:
        blocks[:, offset : offset + 2] = patterns.view(np.uint8).reshape(-1, 2)
    if ggml_type == GGMLType.IQ1_M:
        words = blocks[:, 48:56].copy().view("<u2")
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((patterns >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    if ggml_type == GGMLType.MXFP4:
        blocks = random_blocks(ggml_type, 256, seed=7)
        blocks[:, 0] = np.arange(256)
    got = quants.dequantize(int(ggml_type), blocks, block)
    assert_bits_equal(reference(ggml_type, blocks), got.reshape(blocks.shape[0], -1))


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_decode_over_chunks_unaligned_and_to_bf16(ggml_type, backend):
    """More blocks than a chunk, with a ragged last one, from a buffer that starts at an odd address; bfloat16
    output is the float32 result rounded to nearest even."""
    block = GGML_BLOCK_SIZES[ggml_type][0]
    n = CHUNK_ELEMENTS // block + 3
    blocks = random_blocks(ggml_type, n, seed=1, moderate=True)
    shifted = torch.zeros(1 + blocks.size, dtype=torch.uint8)
    shifted[1:] = torch.from_numpy(blocks.ravel())
    got = quants.dequantize(int(ggml_type), shifted[1:].view(1, -1), n * block)
    expected = reference(ggml_type, blocks.reshape(1, -1))
    assert_bits_equal(expected, got)
    assert got.abs().max() > 0
    bf16 = quants.dequantize(int(ggml_type), blocks.reshape(1, -1), n * block, dtype=torch.bfloat16)
    assert torch.equal(bf16.view(torch.int16), torch.from_numpy(expected).bfloat16().view(torch.int16))


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_new_types_decode_and_encode_where_llama_cpp_can(ggml_type):
    """Every new type decodes; the i-quants (which llama.cpp writes only with an importance matrix) refuse to
    encode, naming the type; TQ1_0, TQ2_0 and MXFP4 encode (tests/gguf/test_ternary_quantize.py)."""
    assert ggml_type.name in quants.supported_types()
    block = GGML_BLOCK_SIZES[ggml_type][0]
    if ggml_type in (GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4):
        assert quants.quantize(int(ggml_type), torch.zeros(1, block)).shape == (1, GGML_BLOCK_SIZES[ggml_type][1])
    else:
        with pytest.raises(UnsupportedQuantType, match=f"cannot encode GGML type {ggml_type.name}"):
            quants.quantize(int(ggml_type), torch.zeros(1, block))
    assert quants.dequantize(int(ggml_type), np.zeros((0, GGML_BLOCK_SIZES[ggml_type][1]), np.uint8), block).shape == (
        0,
        block,
    )
