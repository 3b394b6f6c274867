"""The Triton decode of IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0 and MXFP4 against the
torch codecs: fp32 values bit for bit, bf16 rounded as torch rounds, both split halves as `kernels.split_bf16`
gives them, rectangles cut inside blocks, and the fused matvec within the fp32 accumulation bound.

Small shapes: on the CPU these run under Triton's interpreter (tests/kernels/conftest.py)."""

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
from juno_py.models import load_model  # noqa: E402
from tests.gguf.newtype_blocks import NEW_TYPES, codebook_indices, random_blocks, tiny_llama_parts, write_model_pair  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24
# MXFP4's two largest scales overflow to infinity, and the split's low halves of infinities are NaN (as in torch)
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)


def rows_of(t: GGMLType, n_rows: int, n_cols: int, seed: int, moderate: bool = False) -> torch.Tensor:
    block, size = GGML_BLOCK_SIZES[t]
    blocks = random_blocks(t, n_rows * n_cols // block, seed=seed, moderate=moderate)
    return torch.from_numpy(blocks.reshape(n_rows, n_cols // block * size))


def shapes(t: GGMLType) -> list[tuple[int, int]]:
    """One row; several programs (8 blocks of 256 or 128 of 32 a program) with a ragged last one."""
    small = [(1, 256), (5, 512)] if GGML_BLOCK_SIZES[t][0] == 256 else [(1, 32), (37, 288)]
    return small + ([(3001, 4096)] if DEVICE == "cuda" else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor, nan_from_inf: bool = False) -> None:
    """Bit for bit. The values hold no NaN, but with `nan_from_inf` the low split halves of infinite values
    (MXFP4's two largest scales overflow, as in gguf) are NaN: there only the NaN positions must match (the
    kernel writes 0x7FC0, torch's CPU cast 0xFFFF)."""
    got = got.cpu()
    assert got.shape == ref.shape and got.dtype == ref.dtype
    nan = torch.isnan(ref)
    assert nan_from_inf or not nan.any()
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(bits(got)[~nan], bits(ref)[~nan])


def test_every_new_type_has_a_kernel():
    assert set(NEW_TYPES) <= TRITON_TYPES


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_codec_bit_exact(ggml_type):
    for i, (n_rows, n_cols) in enumerate(shapes(ggml_type)):
        raw = rows_of(ggml_type, n_rows, n_cols, seed=31 * i + int(ggml_type))
        for dtype in (torch.float32, torch.bfloat16):
            ref = dequantize_reference(raw, ggml_type, n_cols, dtype)
            assert_same_bits(dequantize_tile(raw.to(DEVICE), ggml_type, n_cols, dtype=dtype), ref)
        ref = dequantize_split_reference(raw, ggml_type, n_cols)
        assert_same_bits(dequantize_split_tile(raw.to(DEVICE), ggml_type, n_cols), ref, ggml_type == GGMLType.MXFP4)


def test_mxfp4_every_scale_byte_matches_the_gguf_package():
    """Each of the 256 e8m0 scale bytes with each of the 16 codes, against `gguf.quants.dequantize` itself: the two
    largest scales overflow to ±inf there (ggml's e8m0 has no NaN: byte 255 is 2^127), and code 0 and 8 give +0 at
    every scale. fp32 and bf16 bit for bit; the split's high halves bit for bit, its low halves NaN exactly where
    w − bf16(w) is (the infinities) and bit for bit elsewhere."""
    import gguf

    codes = np.arange(32) % 16
    qs = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(qs, (256, 1))], 1)
    raw = torch.from_numpy(np.ascontiguousarray(blocks.reshape(8, -1)))
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(8, -1))
    assert torch.isinf(ref).sum() == 48 and not torch.isnan(ref).any()
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_bits(dequantize_tile(raw.to(DEVICE), GGMLType.MXFP4, 1024, dtype=dtype), ref.float().to(dtype))
    hi, lo = dequantize_split_tile(raw.to(DEVICE), GGMLType.MXFP4, 1024)
    want_hi = ref.float().bfloat16()
    want_lo = (ref.float() - want_hi.float()).bfloat16()
    assert_same_bits(hi, want_hi)
    assert_same_bits(lo, want_lo, nan_from_inf=True)
    assert int(torch.isnan(lo.cpu()).sum()) == 48


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_dequantize_many_blocks_bit_exact(ggml_type):
    """Enough blocks that most grid points and sign patterns occur (all of them for the smaller grids), fp32."""
    n_rows, n_cols = (64, 1024) if GGML_BLOCK_SIZES[ggml_type][0] == 256 else (64, 512)
    raw = rows_of(ggml_type, n_rows, n_cols, seed=int(ggml_type) + 500)
    blocks = raw.numpy().reshape(-1, GGML_BLOCK_SIZES[ggml_type][1])
    for what, (index, space) in codebook_indices(ggml_type, blocks).items():
        assert np.unique(index).size >= 0.9 * space, what
    ref = dequantize_reference(raw, ggml_type, n_cols, torch.float32)
    assert_same_bits(dequantize_tile(raw.to(DEVICE), ggml_type, n_cols, dtype=torch.float32), ref)


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_dequantize_rectangles_inside_blocks(ggml_type):
    """Row and column ranges cut inside blocks, into a wider buffer; nothing written outside."""
    n_rows, n_cols = (6, 768) if GGML_BLOCK_SIZES[ggml_type][0] == 256 else (6, 320)
    raw = rows_of(ggml_type, n_rows, n_cols, seed=5).to(DEVICE)
    ref = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16)
    split_ref = dequantize_split_reference(raw, ggml_type, n_cols)
    for (r0, r1), (c0, c1) in [((1, 5), (5, n_cols - 3)), ((5, 6), (257, 300)), ((2, 2), (0, 10))]:
        out = torch.full((n_rows, n_cols + 9), 7.0, dtype=torch.bfloat16, device=DEVICE)
        tile = dequantize_tile(raw, ggml_type, n_cols, (r0, r1), (c0, c1), out=out)
        assert_same_bits(tile, ref[r0:r1, c0:c1])
        rest = out.clone()
        rest[: r1 - r0, : c1 - c0] = 7.0
        assert bool((rest == 7.0).all())
        assert_same_bits(
            dequantize_split_tile(raw, ggml_type, n_cols, (r0, r1), (c0, c1)),
            split_ref[:, r0:r1, c0:c1],
            ggml_type == GGMLType.MXFP4,
        )


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("round_bf16", [True, False], ids=["bf16-weights", "fp32-weights"])
def test_matvec_within_fp32_accumulation_bound(ggml_type, round_bf16):
    n_rows, n_cols = (37, 512) if GGML_BLOCK_SIZES[ggml_type][0] == 256 else (37, 96)
    if DEVICE == "cuda":
        n_rows, n_cols = 3001, 4096
    raw = rows_of(ggml_type, n_rows, n_cols, seed=3, moderate=True)
    w = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16 if round_bf16 else torch.float32).double()
    for tokens in (1, 3):
        x = torch.randn(tokens, n_cols, generator=torch.Generator().manual_seed(tokens))
        y = dequant_matvec(raw.to(DEVICE), ggml_type, n_cols, x.to(DEVICE), round_bf16=round_bf16).cpu().double()
        ref = matvec_reference(raw, ggml_type, n_cols, x, round_bf16)
        bound = n_cols * U32 * (x.double().abs() @ w.abs().T)
        assert y.shape == (tokens, n_rows) and float(ref.abs().max()) > 0
        assert bool(((y - ref).abs() <= bound).all())


# the interpreter needs several seconds a type for the whole model: two types on the CPU, every one on a GPU
@pytest.mark.parametrize(
    "ggml_type", NEW_TYPES if DEVICE == "cuda" else [GGMLType.IQ2_XXS, GGMLType.MXFP4], ids=lambda t: t.name
)
def test_device_model_logits_match_eager_cpu(tmp_path, ggml_type):
    """A tiny model whose every linear is of the type: its frozen linears decoding on the device path give the
    eager CPU model's logits (within fp32 summation differences of cuBLAS vs the CPU)."""
    path = write_model_pair(tmp_path, *tiny_llama_parts(), ggml_type)[0]
    eager = load_model(path)
    if DEVICE == "cuda":
        dev = load_model(path, device="cuda", compute_dtype="fp32")
    else:
        dev = load_model(path, compute_dtype="fp32")
        for lin in dev.frozen_linears():
            lin.dequant = "triton"
    ids = [1, 5, 9, 200, 17, 42, 3, 77]
    with torch.no_grad():
        ref, got = eager.logits(ids), dev.logits(ids)
    assert got.shape == ref.shape and float(ref.std()) > 0
    assert float((got.cpu() - ref).abs().max()) <= 1e-3
    assert float((got.cpu().double() - ref.double()).norm() / ref.double().norm()) <= 1e-5


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"])
def test_llama_cpp_blocks_decode_bit_for_bit(name):
    """Rows written by llama.cpp's quantizer (golden set `newtypes`, 256 values a row): the kernel's fp32 values
    are the `gguf` package's. The edge set's infinite inputs give blocks whose float16 scale is infinite: their
    zero codes decode to NaN, as in gguf, and only the NaN positions must match there."""
    from tests.gguf.test_quants_llama_written import golden, reference

    t = GGMLType[name]
    if int(t) not in TRITON_TYPES:
        pytest.skip(f"no Triton decoder for {name}")
    for set_name, raw in golden(name).items():
        raw = raw[:256] if DEVICE == "cpu" else raw  # the interpreter runs programs one by one
        want = torch.from_numpy(reference(name, raw))
        got = dequantize_tile(torch.from_numpy(raw).to(DEVICE), int(t), 256, dtype=torch.float32)
        assert_same_bits(got, want, nan_from_inf=True)
