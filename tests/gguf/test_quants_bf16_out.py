"""The codecs' bfloat16 output (`quants.dequantize(..., dtype=torch.bfloat16)`, used by the CPU streaming path in
bf16 compute): bit for bit the float32 decode rounded to nearest even, for every type that writes it directly."""

import numpy as np
import pytest
import torch

from juno_py.gguf import GGMLType, quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.gguf.quants import NARROW_OUTPUT
from tests.gguf.newtype_blocks import random_blocks

TYPES = [GGMLType[name] for name in sorted(NARROW_OUTPUT)]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_bf16_output_is_the_float32_decode_rounded(ggml_type):
    rows, cols = 37, 512  # odd row count; chunks cut across blocks for the 32-value types
    g = torch.Generator().manual_seed(int(ggml_type))
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    if quants.get_codec(ggml_type).quantize_blocks is not None:
        raw = quants.quantize(ggml_type, x)
    else:  # decode-only types: random valid blocks
        raw = random_blocks(
            ggml_type, rows * cols // GGML_BLOCK_SIZES[ggml_type][0], seed=int(ggml_type), moderate=True
        ).reshape(rows, -1)
    exact = quants.dequantize(ggml_type, raw, cols)
    narrow = quants.dequantize(ggml_type, raw, cols, dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and narrow.shape == exact.shape
    assert torch.equal(narrow.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16))


def test_bf16_output_of_a_large_tensor_spans_several_chunks():
    """More values than one chunk of the decoder (2^19): every chunk's scratch is used and rounded right."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1100, 1024, generator=g)
    for ggml_type in (GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K):
        raw = quants.quantize(ggml_type, x)
        exact = quants.dequantize(ggml_type, raw, 1024).to(torch.bfloat16)
        assert torch.equal(quants.dequantize(ggml_type, np.asarray(raw), 1024, dtype=torch.bfloat16), exact)
