"""Every kernel variant (`dequant.variants`: the grouped layouts, 16-bit field loads, bf16 rounded by the GPU's cast)
against the torch codecs: fp32 values bit for bit, bf16 as torch rounds, both split halves as `kernels.split_bf16`
gives them, rectangles whose first and last columns cut blocks, ragged last programs, and the fused matvec
(`_blocks`' MODE 1) within the fp32 accumulation bound.

On the CPU these run under Triton's interpreter (tests/kernels/conftest.py) on small shapes, where the cast
variants round with integer operations as variant 0 does (the interpreter's cast truncates): there the odd
variants, whose layouts differ, are the ones tested. On a GPU every variant runs, at larger sizes.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.gguf.constants import GGML_BLOCK_SIZES  # noqa: E402
from juno_py.kernels import dequant  # noqa: E402
from juno_py.kernels.dequant import (  # noqa: E402
    dequant_matvec,
    dequantize_reference,
    dequantize_split_reference,
    dequantize_split_tile,
    dequantize_tile,
    matvec_reference,
)
from juno_py.testing.blocks import F16_FIELDS, random_rows  # noqa: E402
from tests.gguf.newtype_blocks import random_blocks  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)
QUANTIZED = sorted((GGMLType(t) for t in dequant.TRITON_TYPES if t not in dequant.KERNEL_BLOCK), key=int)
CASES = [
    (t, v)
    for t in sorted(map(GGMLType, dequant.TRITON_TYPES), key=int)
    for v in dequant.variants(t)
    if v != 0 and (DEVICE == "cuda" or v % 2 == 1)
]


def rows_of(t: GGMLType, n_rows: int, n_cols: int, seed: int) -> torch.Tensor:
    """uint8 `[n_rows, row bytes]` of random valid blocks (scales of moderate size)."""
    floats = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
    if t in floats:  # finite values of the float type, its bytes
        x = torch.randn(n_rows, n_cols, generator=torch.Generator().manual_seed(seed)).to(floats[t])
        return x.view(torch.uint8).reshape(n_rows, -1).contiguous()
    if t in F16_FIELDS:
        return torch.from_numpy(random_rows(t, n_rows, n_cols, seed=seed))
    block, size = GGML_BLOCK_SIZES[t]
    blocks = random_blocks(t, n_rows * n_cols // block, seed=seed, moderate=True)
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(n_rows, n_cols // block * size)))


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit; a NaN may carry any payload (MXFP4's split low halves of infinities): NaN positions match."""
    got = got.cpu()
    assert got.shape == ref.shape and got.dtype == ref.dtype
    nan = torch.isnan(ref)
    view = torch.int16 if ref.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(view)[~nan], ref.view(view)[~nan])


@pytest.fixture
def variant_of(monkeypatch):
    """Set a type's decode and matvec variant (and optionally blocks a program) for one test."""

    def use(t: GGMLType, variant: int, nb=None) -> None:
        monkeypatch.setitem(dequant.KERNEL_VARIANT, t, variant)
        monkeypatch.setitem(dequant.MATVEC_VARIANT, t, variant)
        if nb is not None:
            monkeypatch.setitem(dequant.KERNEL_CONFIG, t, (nb, *dequant.KERNEL_CONFIG[t][1:]))

    return use


def test_every_quantized_type_has_a_layout_variant():
    """The odd variants exist for every block type, the grid-word and register-grid ones for every codebook type,
    and the grouped layouts cover every codebook, ternary and low-bit K type."""
    for t in QUANTIZED:
        grids = (5, 7, 9, 11) if t in dequant.CODEBOOK_TYPES else ()
        assert dequant.variants(t) == (0, 1, 2, 3, *grids)
    low_bit = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.IQ4_NL, GGMLType.IQ4_XS}
    assert dequant.CODEBOOK_TYPES | low_bit <= dequant.GROUPED_TYPES <= set(QUANTIZED)
    assert all(v == 0 for v in dequant.KERNEL_VARIANT.values()) or set(dequant.KERNEL_VARIANT) == set(
        dequant.TRITON_TYPES
    )


@pytest.mark.parametrize("ggml_type,variant", CASES, ids=lambda c: c.name if isinstance(c, GGMLType) else str(c))
def test_variant_matches_codec_bit_exact(ggml_type, variant, variant_of):
    """Whole rows in fp32 and bf16 over several programs with a ragged last one, programs whose blocks run on
    into the next row (3 blocks a row, 2 a program), a rectangle whose rows start inside the tensor and whose
    columns cut blocks at both ends (into a wider buffer: nothing written outside), the split halves of both, and
    the matvec."""
    block = dequant.KERNEL_BLOCK.get(ggml_type, GGML_BLOCK_SIZES[ggml_type][0])
    n_rows, n_cols = (5, 3 * block) if DEVICE == "cpu" else (301, 4096)
    if ggml_type in dequant.KERNEL_BLOCK and DEVICE == "cpu":
        n_rows, n_cols = 3, 700
    variant_of(ggml_type, variant, nb=2 if DEVICE == "cpu" else None)
    raw = rows_of(ggml_type, n_rows, n_cols, seed=int(ggml_type) * 4 + variant)
    dev = raw.to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_bits(
            dequantize_tile(dev, ggml_type, n_cols, dtype=dtype), dequantize_reference(raw, ggml_type, n_cols, dtype)
        )
    ref = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16)
    split = dequantize_split_reference(raw, ggml_type, n_cols)
    assert_same_bits(dequantize_split_tile(dev, ggml_type, n_cols), split)
    (r0, r1), (c0, c1) = (1, n_rows - 1), (5, n_cols - 3)
    out = torch.full((n_rows, n_cols + 9), 7.0, dtype=torch.bfloat16, device=DEVICE)
    tile = dequantize_tile(dev, ggml_type, n_cols, (r0, r1), (c0, c1), out=out)
    assert_same_bits(tile, ref[r0:r1, c0:c1])
    rest = out.clone()
    rest[: r1 - r0, : c1 - c0] = 7.0
    assert bool((rest == 7.0).all())
    assert_same_bits(dequantize_split_tile(dev, ggml_type, n_cols, (r0, r1), (c0, c1)), split[:, r0:r1, c0:c1])
    for round_bf16 in (True, False):
        x = torch.randn(2, n_cols, generator=torch.Generator().manual_seed(variant))
        y = dequant_matvec(dev, ggml_type, n_cols, x.to(DEVICE), round_bf16=round_bf16).cpu().double()
        want = matvec_reference(raw, ggml_type, n_cols, x, round_bf16)
        w = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16 if round_bf16 else torch.float32).double()
        bound = n_cols * U32 * (x.double().abs() @ w.abs().T)
        assert float(want.abs().max()) > 0
        assert bool(((y - want).abs() <= bound).all())


@pytest.mark.parametrize("ggml_type", [GGMLType.IQ2_XS, GGMLType.Q5_0], ids=lambda t: t.name)
def test_variant_with_16_bit_loads_reads_bytes_at_an_odd_address(ggml_type, variant_of):
    """Bytes that start at an odd address (a view one byte into a buffer) decode the same under the variants that
    read 16-bit fields: the launch copies them to an aligned buffer first."""
    variant_of(ggml_type, 1)
    n_rows, n_cols = (2, 256) if GGML_BLOCK_SIZES[ggml_type][0] == 256 else (2, 64)
    raw = rows_of(ggml_type, n_rows, n_cols, seed=9)
    buf = torch.zeros(raw.numel() + 1, dtype=torch.uint8, device=DEVICE)
    view = buf[1:].view(n_rows, -1)
    view.copy_(raw.to(DEVICE))
    assert view.data_ptr() % 2 == 1
    assert_same_bits(
        dequantize_tile(view, ggml_type, n_cols, dtype=torch.float32),
        dequantize_reference(raw, ggml_type, n_cols, torch.float32),
    )


@pytest.mark.parametrize("ggml_type", [GGMLType.IQ2_XXS, GGMLType.Q4_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_variant_with_more_blocks_a_program_than_a_row_has(ggml_type, variant_of):
    """Programs of more blocks than a row (or the rectangle's width) has, so one program spans several rows."""
    variant_of(ggml_type, 1, nb=8)
    block = GGML_BLOCK_SIZES[ggml_type][0]
    n_rows, n_cols = 7, 3 * block
    raw = rows_of(ggml_type, n_rows, n_cols, seed=11)
    ref = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16)
    assert_same_bits(dequantize_tile(raw.to(DEVICE), ggml_type, n_cols), ref)
    tile = dequantize_tile(raw.to(DEVICE), ggml_type, n_cols, (2, 7), (block + 3, 2 * block - 1))
    assert_same_bits(tile, ref[2:7, block + 3 : 2 * block - 1])
