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
    SPLIT_K_TYPES,
    dequant_matvec,
    dequantize_reference,
    lora_xa,
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
    # (config, tokens, weights rounded to bf16, x in bf16: read as packed words of a weight word's values)
    cases = [(CONFIGS[0], 1, True, False), (CONFIGS[0], 4, True, True), (CONFIGS[1], 2, True, False)]
    cases += [(CONFIGS[1], 3, True, True), (CONFIGS[2], 1, False, False)]
    for config, tokens, round_bf16, bf16_x in cases:
        x = torch.randn(tokens, n_cols, generator=torch.Generator().manual_seed(tokens + 7 * int(ggml_type)))
        if bf16_x:
            x = x.to(torch.bfloat16)
        y = dequant_matvec(dev, ggml_type, n_cols, x.to(DEVICE), round_bf16=round_bf16, config=config)
        x = x.float()
        assert y.shape == (tokens, n_rows) and y.dtype == torch.float32
        ref = matvec_reference(raw, ggml_type, n_cols, x, round_bf16)
        bound = n_cols * U32 * (x.double().abs() @ weights[round_bf16].abs().T)
        err = (y.cpu().double() - ref).abs()
        assert bool((err <= bound).all()), f"{config} {tokens} tokens: max |Δ| {err.max().item():.3g}"
        if config[3] > 1 and ggml_type in SPLIT_K_TYPES:  # partial sums added in a fixed order: the same bits
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


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_codes_through_float_bits_give_the_conversion_s_bits(ggml_type, monkeypatch):
    """The decode without integer-to-float conversions (`GEMV_MAGIC_CODES`) and with the hardware's bf16 rounding
    (`GEMV_HW_ROUND`, compiled kernels only) gives the bits of the plain conversions, weights rounded or not."""
    from juno_py.kernels import dequant

    n_rows, n_cols = shape(ggml_type)
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=11)).to(DEVICE)
    x = torch.randn(2, n_cols, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    got = {}
    for magic, hw in ((False, False), (True, True)):
        monkeypatch.setattr(dequant, "GEMV_MAGIC_CODES", magic)
        monkeypatch.setattr(dequant, "GEMV_HW_ROUND", hw)
        got[magic] = [dequant_matvec(raw, ggml_type, n_cols, x, round_bf16=r) for r in (True, False)]
    for plain, fast in zip(got[False], got[True]):
        assert torch.equal(plain, fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lora_xa_within_fp32_accumulation_bound(dtype):
    """x·Aᵀ of one token by `lora_xa` (rows of A spread unevenly over programs, a width that is no multiple of the
    kernel's step): within the fp32 bound of the fp64 product; its bf16 result is the fp32 one rounded."""
    g = torch.Generator().manual_seed(6)
    d = 4100 if DEVICE == "cuda" else 700
    x, A = torch.randn(1, d, generator=g).to(dtype), torch.randn(11, d, generator=g).to(dtype)
    y = lora_xa(x.to(DEVICE), A.to(DEVICE)).cpu()
    assert y.shape == (1, 11) and y.dtype == dtype
    ref = x.double() @ A.double().T
    bound = d * U32 * (x.double().abs() @ A.double().abs().T)
    if dtype == torch.bfloat16:
        y32 = lora_xa(x.float().to(DEVICE), A.float().to(DEVICE)).cpu()
        assert torch.equal(y.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16))
        y = y32
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_gemv_config_strings():
    assert parse_gemv_config("Q4_K=2,2,4,1; Q6_K=4,1,8,3;") == {
        int(GGMLType.Q4_K): (2, 2, 4, 1),
        int(GGMLType.Q6_K): (4, 1, 8, 3),
    }
    for bad in ("Q4_K=3,2,4,1", "Q4_K=2,2,4", "IQ2_XS=1,1,4,1", "Q4_K=2,2,4,0", "nonsense"):
        with pytest.raises(ValueError, match="JUNO_PY_GEMV"):
            parse_gemv_config(bad)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_gemv_adds_a_lora_term_before_rounding(ggml_type):
    """alpha·xa·Bᵀ added to the fp32 sums (split or not, 1 and 3 tokens, a rank that is not a power of two): within
    the product's bound plus the term's own fp32 rounding."""
    n_rows, n_cols = shape(ggml_type)
    raw = torch.from_numpy(random_rows(ggml_type, n_rows, n_cols, seed=9))
    w = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16).double()
    g = torch.Generator().manual_seed(4)
    B = torch.randn(n_rows, 5, generator=g)
    for config, tokens in (((2, 2, 4, 1), 1), ((1, 1, 4, 3), 3)):
        x = torch.randn(tokens, n_cols, generator=g)
        xa = torch.randn(tokens, 5, generator=g)
        y = dequant_matvec(
            raw.to(DEVICE), ggml_type, n_cols, x.to(DEVICE), config=config, lora=(xa.to(DEVICE), B.to(DEVICE), -0.75)
        )
        term = -0.75 * xa.double() @ B.double().T
        ref = matvec_reference(raw, ggml_type, n_cols, x) + term
        bound = n_cols * U32 * (x.double().abs() @ w.abs().T) + 8 * U32 * (
            0.75 * xa.double().abs() @ B.double().abs().T
        )
        bound += U32 * ref.abs()
        err = (y.cpu().double() - ref).abs()
        assert bool((err <= bound).all()), f"{config}: max |Δ| {err.max().item():.3g}"
        assert (term.abs() > 100 * err).any()  # the term is there, not lost in the tolerance


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's CPU path; on a GPU tests/models/test_graph_decode.py")
def test_playback_lora_rides_on_the_gemv_with_the_forwards_logits(tiny_gguf, monkeypatch):
    """A LoRA-played model on the device path (the GEMV, forced onto the CPU under the interpreter) decodes the
    logits of the same model's CPU forward, the adapter's term added inside the GEMV (fp32 compute)."""
    from juno_py.kernels import dequant
    from juno_py.lora import attach
    from juno_py.models import load_model
    from juno_py.models.decode_cuda import CudaGraphDecoder
    from juno_py.testing.tiny_models import sample_ids
    from tests.models.decode_checks import assert_logits_close, decoder_steps, forward_steps, randomize

    path = tiny_gguf("llama", GGMLType.Q8_0)
    models, n_adapted = [], 0
    for device_path in (True, False):
        model = load_model(path)
        if device_path:
            for lin in model.frozen_linears():
                lin.dequant = "triton"
        aset = attach(model, "all", rank=3, alpha=4.0, seed=5)
        randomize(aset, seed=6)
        models.append(model)
        n_adapted = len(aset.adapters)
    # 16 rows a program: the interpreter runs programs one after another
    monkeypatch.setitem(dequant.MATVEC_CONFIG, int(GGMLType.Q8_0), (16, 16, 4, 1))
    fused = []
    real, real_group = dequant.dequant_matvec, dequant.dequant_matvec_group
    monkeypatch.setattr(
        dequant, "dequant_matvec", lambda *a, **k: fused.append(k.get("lora") is not None) or real(*a, **k)
    )
    monkeypatch.setattr(
        dequant,
        "dequant_matvec_group",
        lambda parts, *a, **k: fused.extend(p[3] is not None for p in parts) or real_group(parts, *a, **k),
    )
    prompt, tokens = sample_ids(2, seed=1), sample_ids(2, seed=2)
    got = decoder_steps(CudaGraphDecoder, models[0], prompt, tokens, graph=False)
    # every adapted product of the prefill (2 tokens) and the steps took the GEMV (alone or grouped) with its term
    assert sum(fused) == n_adapted * (1 + len(tokens))
    assert_logits_close(got, forward_steps(models[1], prompt, tokens))
