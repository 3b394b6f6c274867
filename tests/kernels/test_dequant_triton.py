"""The Triton dequantization kernels against the torch codecs: bit-exact fp32 values, bf16 rounded to nearest even
exactly as torch's cast rounds them, both bf16 halves of the split decode exactly as `kernels.split_bf16` of the
codec's values, on any rectangle of rows and columns (one row, sizes and offsets that are not
multiples of the blocks a kernel program decodes (64 blocks of 32 values, 8 of 256, several programs a row and
rows split between programs), K-quant rows of 256·k columns); and the fused dequantize-matvec within
the fp32 accumulation bound of an fp64 product over the same (bf16-rounded) weights.

Runs on the GPU at real sizes when there is one, else on the CPU under Triton's interpreter (tests/kernels/
conftest.py), which truncates on float casts: the kernels round with integer operations, so both must agree.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.gguf.constants import GGML_BLOCK_SIZES  # noqa: E402
from juno_py.kernels.dequant import (  # noqa: E402
    TRITON_TYPES,
    dequant_matvec,
    dequantize_reference,
    dequantize_split_reference,
    dequantize_split_tile,
    dequantize_tile,
    matvec_reference,
)
from juno_py.testing.blocks import F16_FIELDS, random_rows  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24  # unit roundoff of fp32
# the types whose blocks `random_rows` makes (the codebook, ternary and MXFP4 kernels have their own tests:
# test_dequant_triton_newtypes.py)
TYPES = sorted((GGMLType(t) for t in TRITON_TYPES if t in F16_FIELDS or GGML_BLOCK_SIZES[t][0] == 1), key=int)
# the types of 256-value super-blocks (K-quants, IQ4_XS): their rows are 256·k columns
K_QUANTS = tuple(t for t in TYPES if GGML_BLOCK_SIZES[t][0] == 256)


def test_every_decodable_type_has_a_kernel():
    """A GGUF of any type the codecs read trains on the GPU with its bytes decoded there, never on the CPU."""
    from juno_py.gguf import quants

    assert {GGMLType[name] for name in quants.supported_types()} == set(TRITON_TYPES)


def shapes(t: GGMLType) -> list[tuple[int, int]]:
    """(rows, columns): one row; odd row counts; column counts that are and are not multiples of the 256 columns
    of a float type's kernel block (K-quant rows are always 256·k); block counts that are not multiples of the
    blocks of one program (8 K-quant blocks, 64 blocks of 32), over several programs; real sizes on the GPU."""
    block = GGML_BLOCK_SIZES[t][0]
    if t in K_QUANTS:
        small = [(1, 256), (13, 768), (9, 512), (37, 1280)]
    elif block == 32:
        small = [(1, 32), (13, 96), (9, 288), (67, 2080)]
    else:
        small = [(1, 1), (1, 7), (13, 300), (19, 1000)]
    return small + ([(3001, 4096), (64, 14336)] if DEVICE == "cuda" else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def assert_same_values(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit, except that a NaN may carry any payload (torch's own cast gives 0xFFFF on the CPU, 0x7FFF on
    CUDA; the kernel writes 0x7FC0): NaN positions must match."""
    got = got.cpu()
    assert got.shape == ref.shape and got.dtype == ref.dtype
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got)[~nan], bits(ref)[~nan])


def wild_rows(t: GGMLType, n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    """Random blocks whose float16 scale fields take any bit pattern, and surely the largest finite value, an
    infinity, a NaN and the smallest subnormal in the first blocks."""
    raw = random_rows(t, n_rows, n_cols, seed)
    block, size = GGML_BLOCK_SIZES[t]
    blocks = raw.reshape(-1, size)
    rng = np.random.default_rng(seed + 1000)
    for offset in F16_FIELDS[t]:
        blocks[:, offset : offset + 2] = rng.integers(0, 256, size=(blocks.shape[0], 2), dtype=np.uint8)
        special = np.array([0x7BFF, 0x7C00, 0x7E00, 0x0001], dtype="<u2").view(np.uint8).reshape(4, 2)
        blocks[:4, offset : offset + 2] = special
    return raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_codec_bit_exact(ggml_type, dtype):
    for i, (n_rows, n_cols) in enumerate(shapes(ggml_type)):
        raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=31 * i + int(ggml_type)))
        ref = dequantize_reference(raw, ggml_type, n_cols, dtype)
        assert_same_values(dequantize_tile(raw.to(DEVICE), ggml_type, n_cols, dtype=dtype), ref)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_rectangles_at_any_offset(ggml_type):
    """Row and column ranges cut anywhere (inside blocks, across tiles), written into a wider buffer."""
    n_rows, n_cols = (21, 768) if ggml_type in K_QUANTS else (21, 320)
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=5)).to(DEVICE)
    ref = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16)
    for (r0, r1), (c0, c1) in [
        ((0, 1), (0, n_cols)),
        ((3, 20), (5, n_cols - 3)),
        ((20, 21), (257, 300)),
        ((7, 15), (31, 33)),
        ((4, 4), (0, 10)),
    ]:
        out = torch.full((n_rows, n_cols + 9), 7.0, dtype=torch.bfloat16, device=DEVICE)
        tile = dequantize_tile(raw, ggml_type, n_cols, (r0, r1), (c0, c1), out=out)
        assert tile.numel() == 0 or tile.data_ptr() == out.data_ptr()
        assert_same_values(tile, ref[r0:r1, c0:c1])
        rest = out.clone()
        rest[: r1 - r0, : c1 - c0] = 7.0
        assert bool((rest == 7.0).all())  # nothing written outside the rectangle


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t in F16_FIELDS], ids=lambda t: t.name)
def test_dequantize_wild_scales_round_like_torch(ggml_type):
    """Scales of every float16 magnitude: bf16 rounding near ties, overflow to infinity, NaN from 0·inf."""
    n_rows, n_cols = (16, 512) if ggml_type in K_QUANTS else (16, 256)
    raw = torch.from_numpy(wild_rows(ggml_type, n_rows, n_cols, seed=int(ggml_type)))
    for dtype in (torch.bfloat16, torch.float32):
        ref = dequantize_reference(raw, ggml_type, n_cols, dtype)
        assert_same_values(dequantize_tile(raw.to(DEVICE), ggml_type, n_cols, dtype=dtype), ref)


def test_bf16_rounds_to_nearest_even_not_truncates():
    """Values just above a bf16 tie, at a tie with an odd and an even neighbour: truncation would get these wrong
    (and the interpreter's float cast truncates)."""
    patterns = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF818000, 0x7F7FFFFF, 0x00008000, 0x00018000]
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    raw = x.view(torch.uint8).reshape(1, -1)
    got = dequantize_tile(raw.to(DEVICE), GGMLType.F32, len(patterns), dtype=torch.bfloat16).cpu()
    want = x.reshape(1, -1).to(torch.bfloat16)
    assert torch.equal(bits(got), bits(want))
    assert not torch.equal(bits(got), (x.view(torch.int32) >> 16).to(torch.int16).reshape(1, -1))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("round_bf16", [True, False], ids=["bf16-weights", "fp32-weights"])
def test_matvec_within_fp32_accumulation_bound(ggml_type, round_bf16):
    n_rows, n_cols = shapes(ggml_type)[-1] if DEVICE == "cuda" else ((37, 512) if ggml_type in K_QUANTS else (37, 96))
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=3))
    w = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16 if round_bf16 else torch.float32).double()
    for tokens in (1, 3, 8):
        x = torch.randn(tokens, n_cols, generator=torch.Generator().manual_seed(tokens))
        y = dequant_matvec(raw.to(DEVICE), ggml_type, n_cols, x.to(DEVICE), round_bf16=round_bf16).cpu().double()
        ref = matvec_reference(raw, ggml_type, n_cols, x, round_bf16)
        bound = n_cols * U32 * (x.double().abs() @ w.abs().T)  # fp32 summation of n_cols products
        assert y.shape == (tokens, n_rows)
        assert bool(((y - ref).abs() <= bound).all())


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_split_decode_matches_codec_split_bit_exact(ggml_type):
    """Both halves in one pass: w_hi bit-identical to the bf16 decode, w_lo = bf16(w − w_hi) as `split_bf16` of the
    codec's fp32 values gives it; together within 2⁻¹⁶ of w."""
    for i, (n_rows, n_cols) in enumerate(shapes(ggml_type)):
        raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=31 * i + int(ggml_type)))
        ref = dequantize_split_reference(raw, ggml_type, n_cols)
        got = dequantize_split_tile(raw.to(DEVICE), ggml_type, n_cols)
        assert_same_values(got, ref)
        assert_same_values(got[0], dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16))
        w = dequantize_reference(raw, ggml_type, n_cols, torch.float32).double()
        assert bool(((got.cpu().double().sum(0) - w).abs() <= 2.0**-16 * w.abs()).all())


@pytest.mark.parametrize("ggml_type", [GGMLType.F16, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_split_decode_rectangles_at_any_offset(ggml_type):
    """The split decode of rectangles cut anywhere, into a wider two-part buffer: nothing written outside."""
    n_rows, n_cols = (21, 768) if ggml_type in K_QUANTS else (21, 320)
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=6)).to(DEVICE)
    ref = dequantize_split_reference(raw, ggml_type, n_cols)
    for (r0, r1), (c0, c1) in [
        ((3, 20), (5, n_cols - 3)),
        ((20, 21), (257, 300)),
        ((0, 21), (0, n_cols)),
        ((4, 4), (0, 10)),
    ]:
        out = torch.full((2, n_rows + 2, n_cols + 9), 7.0, dtype=torch.bfloat16, device=DEVICE)
        tile = dequantize_split_tile(raw, ggml_type, n_cols, (r0, r1), (c0, c1), out=out)
        assert tile.shape == (2, r1 - r0, c1 - c0)
        assert_same_values(tile, ref[:, r0:r1, c0:c1])
        rest = out.clone()
        rest[:, : r1 - r0, : c1 - c0] = 7.0
        assert bool((rest == 7.0).all())


def test_split_decode_rounds_both_halves_to_nearest_even():
    """fp32 values whose w_hi or w_lo sits at or just past a bf16 tie (truncation gets these wrong, and the
    interpreter's float cast truncates), a negative w_lo, subnormals, the largest finite value (w_hi rounds to
    infinity, w_lo to −infinity, as torch), infinities (w_lo NaN) and NaN; also Q8_0 and Q4_K at every float16 scale."""
    patterns = [
        0x3F808000,
        0x3F818000,
        0x3F808001,
        0x3F800101,
        0x3F800103,
        0x3F800107,
        0x3F800203,
        0xBF800103,
        0x3F80C103,
        0x7F7FFFFF,
        0x00008000,
        0x00018000,
        0x00000001,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
    ]
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    raw = x.view(torch.uint8).reshape(1, -1)
    got = dequantize_split_tile(raw.to(DEVICE), GGMLType.F32, len(patterns)).cpu()
    assert_same_values(got, dequantize_split_reference(raw, GGMLType.F32, len(patterns)))
    truncated_lo = ((x - got[0, 0].float()).view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(bits(got[1, 0])[:9], truncated_lo[:9])
    for t, n_cols in ((GGMLType.Q8_0, 256), (GGMLType.Q4_K, 512)):
        raw = torch.from_numpy(wild_rows(t, 16, n_cols, seed=int(t)))
        assert_same_values(dequantize_split_tile(raw.to(DEVICE), t, n_cols), dequantize_split_reference(raw, t, n_cols))


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch runs on the GPU (the interpreter launches as usual)")
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_decodes_launch_directly_with_the_same_bits(ggml_type):
    """The decode and the GEMV go through `kernels.launch`: from the second launch of a specialization on, the
    compiled kernel runs without triton's binder, with the same bits; other rectangles (other specializations:
    offsets that are not multiples of 16, one row) still decode exactly."""
    from juno_py.kernels import launch
    from juno_py.kernels.dequant import gemv_kernels
    from juno_py.kernels.dequant import kernels as dequant_kernels

    raw = torch.from_numpy(random_rows(ggml_type, 300, 512, seed=3)).to(DEVICE)
    ref = dequantize_reference(raw, ggml_type, 512).to(DEVICE)
    first = [dequantize_tile(raw, ggml_type, 512, rows=(0, 256)) for _ in range(3)]
    assert all(torch.equal(t, ref[:256]) for t in first)
    for rows in ((1, 2), (17, 299), (0, 300)):
        for _ in range(2):
            assert torch.equal(dequantize_tile(raw, ggml_type, 512, rows=rows), ref[rows[0] : rows[1]])
    x = torch.randn(3, 512, device=DEVICE)
    y = [dequant_matvec(raw, ggml_type, 512, x) for _ in range(3)]
    assert torch.equal(y[0], y[1]) and torch.equal(y[1], y[2])
    live = launch.compiled_kernels()
    assert launch.direct() and dequant_kernels().dequant_kernel in live and gemv_kernels().gemv_kernel in live
