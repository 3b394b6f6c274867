"""The playback GEMV (`matvec_triton.gemv_kernel`, through `dequant_matvec`) against the fp64 product over the
codec's values: within the fp32 accumulation bound for every type it takes, 1 to 4 tokens, odd row counts (rows
split unevenly between programs), steps that do and do not divide the row's blocks, split-K with uneven splits, fp32
or bf16-rounded weights; its bf16 output is the fp32 result rounded to nearest even, and its configuration string
is checked.

Runs on the GPU at real sizes when there is one, else on the CPU under Triton's interpreter (tests/kernels/
conftest.py) on small shapes.
"""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels.dequant import (  # noqa: E402
    GEMV_TYPES,
    dequant_matvec,
    dequantize_reference,
    matvec_reference,
    parse_gemv_config,
)
from juno_py.testing.blocks import random_rows  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24
TYPES = sorted((GGMLType(t) for t in GEMV_TYPES), key=int)
# (BR, KB, warps, split): one program's rows and blocks a step; the second and third split K unevenly (3 splits of
# a row's blocks, steps that cut the last split's end)
CONFIGS = [(2, 2, 4, 1), (4, 4, 2, 3), (1, 1, 4, 2)]


def shape(t: GGMLType) -> tuple[int, int]:
    """(rows, columns): an odd row count; 5 blocks of 256 or 9 (GPU: 130) of 32 a row (no power of two of them)."""
    if DEVICE == "cuda":
        return (3001, 4096) if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else (3001, 4160)
    return (7, 1280) if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else (7, 288)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gemv_within_fp32_accumulation_bound(ggml_type):
    n_rows, n_cols = shape(ggml_type)
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=int(ggml_type)))
    weights = {
        rb: dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16 if rb else torch.float32).double()
        for rb in (True, False)
    }
    dev = raw.to(DEVICE)
    cases = [(CONFIGS[0], 1, True), (CONFIGS[0], 4, True), (CONFIGS[1], 2, True), (CONFIGS[1], 3, True)]
    cases += [(CONFIGS[2], 1, False)]
    for config, tokens, round_bf16 in cases:
        x = torch.randn(tokens, n_cols, generator=torch.Generator().manual_seed(tokens + 7 * int(ggml_type)))
        y = dequant_matvec(dev, ggml_type, n_cols, x.to(DEVICE), round_bf16=round_bf16, config=config)
        assert y.shape == (tokens, n_rows) and y.dtype == torch.float32
        ref = matvec_reference(raw, ggml_type, n_cols, x, round_bf16)
        bound = n_cols * U32 * (x.double().abs() @ weights[round_bf16].abs().T)
        err = (y.cpu().double() - ref).abs()
        assert bool((err <= bound).all()), f"{config} {tokens} tokens: max |Δ| {err.max().item():.3g}"
        if config[3] > 1:  # split-K adds its partial sums in a fixed order: the same bits every launch
            again = dequant_matvec(dev, ggml_type, n_cols, x.to(DEVICE), round_bf16=round_bf16, config=config)
            assert torch.equal(again, y)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_gemv_bf16_output_is_the_fp32_result_rounded(ggml_type):
    """bf16 activations in, bf16 out: the fp32 sums rounded to nearest even (as torch's cast), split or not."""
    n_rows, n_cols = shape(ggml_type)
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=5)).to(DEVICE)
    x = torch.randn(2, n_cols, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    for config in ((2, 2, 4, 1), (2, 1, 4, 3)):
        y32 = dequant_matvec(raw, ggml_type, n_cols, x, config=config)
        y16 = dequant_matvec(raw, ggml_type, n_cols, x, out_dtype=torch.bfloat16, config=config)
        assert y16.dtype == torch.bfloat16
        assert torch.equal(y16.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16))


def test_gemv_config_strings():
    assert parse_gemv_config("Q4_K=2,2,4,1; Q6_K=4,1,8,3;") == {
        int(GGMLType.Q4_K): (2, 2, 4, 1),
        int(GGMLType.Q6_K): (4, 1, 8, 3),
    }
    for bad in ("Q4_K=3,2,4,1", "Q4_K=2,2,4", "IQ2_XS=1,1,4,1", "Q4_K=2,2,4,0", "nonsense"):
        with pytest.raises(ValueError, match="JUNO_PY_GEMV"):
            parse_gemv_config(bad)
