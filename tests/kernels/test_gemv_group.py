"""The grouped GEMV (`matvec_triton.gemv_group_kernel`, through `dequant_matvec_group`): 2 or 3 quantized matrices
that read one x in one launch, each part bit for bit what `dequant_matvec` gives with the same unsplit
configuration (its LoRA term included), and the gated mode bit for bit `dequant_matvec` of gate and up followed by
`elementwise_triton.gated_forward`. Every GEMV type; parts of different odd row counts (each part's rows split
unevenly between programs), as separate tensors, as row slices of one tensor and from an unaligned address; 1 and
2 tokens; bf16 and fp32 x and output. Also the wrapper's refusals and `ResidentQuantLinear.matmul_group`.

Runs on the GPU at real sizes when there is one, else on the CPU under Triton's interpreter (tests/kernels/
conftest.py) on tiny shapes.
"""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels.dequant import (  # noqa: E402
    GEMV_TYPES,
    dequant_matvec,
    dequant_matvec_group,
    gemv_config,
    gemv_group_takes,
)
from juno_py.testing.blocks import random_rows  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

TYPES = sorted((GGMLType(t) for t in GEMV_TYPES), key=int)
K_QUANTS = (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
GPU = DEVICE == "cuda"


def n_cols(t: GGMLType) -> int:
    """A row's width: 5 blocks of 256 or 130 of 32 on the GPU (no power of two of them); 1 of 256 or 3 of 32 on the
    CPU."""
    if GPU:
        return 1280 if t in K_QUANTS else 4160
    return 256 if t in K_QUANTS else 96


def configs(t: GGMLType) -> list:
    """The configurations a case runs: the type's own (split-K forced to 1) on the GPU, besides small ones whose
    steps do (KB 1) and do not (KB 2, 3 blocks of 32 or 1 of 256) divide a row's blocks."""
    small = [(4, 2, 4, 1), (2, 1, 4, 1)]
    return [(*gemv_config(t)[:3], 1), *small] if GPU else small


def rows(*counts: int) -> list[int]:
    """Row counts: as given on the CPU, scaled up on the GPU (still odd, still different)."""
    return [n * 601 if GPU else n for n in counts]


def raw_parts(t: GGMLType, counts: list[int], layout: str, seed: int) -> list[torch.Tensor]:
    """Each part's bytes on the device: separate tensors, row slices of one tensor (as a fused qkv tensor's
    targets), or the last part at an odd address (copied to an aligned buffer by the launch)."""
    cols = n_cols(t)
    whole = torch.from_numpy(random_rows(t, sum(counts), cols, seed=seed)).to(DEVICE)
    parts = list(whole.split(counts))
    if layout == "separate":
        return [p.clone() for p in parts]
    if layout == "odd":
        p = parts[-1]
        buf = torch.empty(p.numel() + 1, dtype=torch.uint8, device=DEVICE)
        parts[-1] = buf[1:].view(p.shape)
        parts[-1].copy_(p)
        assert parts[-1].data_ptr() % 2
    return parts


def lora_term(n_rows: int, tokens: int, rank: int, seed: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(seed)
    xa = torch.randn(tokens, rank, generator=g).to(dtype).to(DEVICE)
    B = torch.randn(n_rows, rank, generator=g).to(dtype).to(DEVICE)
    return xa, B, 0.37 * (seed % 5 + 1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


# (row counts, layout, parts with a LoRA term, tokens, x and output dtype, weights rounded to bf16)
CASES = [
    ((5, 3, 7), "separate", (0, 2), 2, torch.bfloat16, True),
    ((3, 5), "slices", (1,), 1, torch.float32, False),
    ((7, 1, 5), "odd", (), 1, torch.bfloat16, True),
    ((5, 7), "separate", (0, 1), 2, torch.float32, True),
]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_group_equals_separate_gemvs(ggml_type):
    cols = n_cols(ggml_type)
    for i, (counts, layout, with_lora, tokens, dtype, round_bf16) in enumerate(CASES):
        counts = rows(*counts)
        raws = raw_parts(ggml_type, counts, layout, seed=int(ggml_type) + 10 * i)
        loras = [
            lora_term(n, tokens, 3 + j, seed=i + j, dtype=dtype) if j in with_lora else None
            for j, n in enumerate(counts)
        ]
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(i)).to(dtype).to(DEVICE)
        config = configs(ggml_type)[i % len(configs(ggml_type))]
        parts = [(r, ggml_type, cols, lora) for r, lora in zip(raws, loras)]
        y = dequant_matvec_group(parts, x, round_bf16, out_dtype=dtype, config=config)
        assert y.shape == (tokens, sum(counts)) and y.dtype == dtype
        ref = torch.cat(
            [dequant_matvec(r, ggml_type, cols, x, round_bf16, dtype, config, lora) for r, lora in zip(raws, loras)],
            dim=1,
        )
        assert same_bits(y, ref), f"case {i} {config}: {(y.float() - ref.float()).abs().max().item():.3g}"
        if GPU and i == 0:  # no configuration given: the type's own, unsplit (configs()[0])
            assert same_bits(dequant_matvec_group(parts, x, round_bf16, out_dtype=dtype), ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's saturated σ
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_gated_group_equals_gemvs_then_gated_forward(ggml_type):
    from juno_py.kernels.elementwise_triton import gated_forward

    cols = n_cols(ggml_type)
    # (activation, parts with a LoRA term, tokens, dtype)
    for i, (act, with_lora, tokens, dtype) in enumerate(
        [("silu", (0, 1), 1, torch.bfloat16), ("gelu_tanh", (1,), 2, torch.float32)]
    ):
        counts = rows(5, 5)
        raws = raw_parts(ggml_type, counts, "separate", seed=3 * int(ggml_type) + i)
        loras = [
            lora_term(n, tokens, 4, seed=7 + i + j, dtype=dtype) if j in with_lora else None
            for j, n in enumerate(counts)
        ]
        # large enough that the activation's tails (saturated sigmoid, the gelu's cubic) are reached
        x = 4 * torch.randn(tokens, cols, generator=torch.Generator().manual_seed(i))
        x = x.to(dtype).to(DEVICE)
        config = configs(ggml_type)[i % len(configs(ggml_type))]
        parts = [(r, ggml_type, cols, lora) for r, lora in zip(raws, loras)]
        y = dequant_matvec_group(parts, x, True, out_dtype=dtype, act=act, config=config)
        assert y.shape == (tokens, counts[0]) and y.dtype == dtype
        gate, up = (dequant_matvec(r, ggml_type, cols, x, True, dtype, config, lora) for r, lora in zip(raws, loras))
        ref = gated_forward(gate, up, act)
        assert same_bits(y, ref), f"{act} {config}: {(y.float() - ref.float()).abs().max().item():.3g}"


def test_group_refusals():
    t, cols = GGMLType.Q8_0, 64
    a = torch.from_numpy(random_rows(t, 3, cols, seed=1)).to(DEVICE)
    b = torch.from_numpy(random_rows(t, 5, cols, seed=2)).to(DEVICE)
    x = torch.randn(1, cols, device=DEVICE)
    q4 = torch.from_numpy(random_rows(GGMLType.Q4_0, 3, cols, seed=3)).to(DEVICE)
    wide = torch.from_numpy(random_rows(t, 3, 2 * cols, seed=4)).to(DEVICE)
    with pytest.raises(ValueError, match="expected one type"):
        dequant_matvec_group([(a, t, cols, None), (q4, GGMLType.Q4_0, cols, None)], x)
    with pytest.raises(ValueError, match="expected one width"):
        dequant_matvec_group([(a, t, cols, None), (wide, t, 2 * cols, None)], x)
    with pytest.raises(ValueError, match="two parts of equal rows"):
        dequant_matvec_group([(a, t, cols, None), (b, t, cols, None)], x, act="silu")
    with pytest.raises(ValueError, match="two parts of equal rows"):
        dequant_matvec_group([(a, t, cols, None)] * 3, x, act="silu")
    with pytest.raises(ValueError, match="act 'relu'"):
        dequant_matvec_group([(a, t, cols, None)] * 2, x, act="relu")
    with pytest.raises(ValueError, match="expected 2 or 3"):
        dequant_matvec_group([(a, t, cols, None)] * 4, x)
    with pytest.raises(ValueError, match="1 to 4 tokens"):
        dequant_matvec_group([(a, t, cols, None)] * 2, torch.randn(5, cols, device=DEVICE))
    with pytest.raises(ValueError, match="has no GEMV"):
        q5 = torch.from_numpy(random_rows(GGMLType.Q5_0, 3, cols, seed=5)).to(DEVICE)
        dequant_matvec_group([(q5, GGMLType.Q5_0, cols, None)] * 2, x)
    with pytest.raises(ValueError, match="LoRA xa"):
        dequant_matvec_group([(a, t, cols, (torch.randn(1, 2), torch.randn(5, 2), 1.0)), (b, t, cols, None)], x)
    term = (torch.randn(1, 2, device=DEVICE), torch.randn(3, 2, device=DEVICE), 1.0)
    term16 = (term[0].to(torch.bfloat16), torch.randn(5, 2, device=DEVICE).to(torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="expected one pair"):
        dequant_matvec_group([(a, t, cols, term), (b, t, cols, term16)], x)
    assert gemv_group_takes([t, t], [cols, cols], 4) and gemv_group_takes([t] * 3, [cols] * 3, 1)
    assert not gemv_group_takes([t, GGMLType.Q4_K], [256, 256], 1)
    assert not gemv_group_takes([t, t], [cols, 2 * cols], 1)
    assert not gemv_group_takes([t, t], [cols, cols], 5)
    assert not gemv_group_takes([t], [cols], 1)
    assert not gemv_group_takes([GGMLType.Q5_0] * 2, [cols] * 2, 1)


def test_matmul_group_of_resident_linears(monkeypatch):
    """`ResidentQuantLinear.matmul_group`: q, k, v with LoRA terms on two of them equal `matmul_lora`/`matmul` per
    linear (bf16 compute, an unsplit configuration); gate and up give the unfused gated activation; None where the
    linears do not fit (another type, a resident cache, a bias before the activation, an activation it lacks)."""
    from juno_py.kernels import dequant
    from juno_py.kernels.elementwise_triton import gated_forward
    from juno_py.weights import FrozenQuantLinear
    from juno_py.weights.resident import ResidentQuantLinear

    t = GGMLType.Q8_0
    cols = 4160 if GPU else 64
    if not GPU:  # 4 rows a program: the interpreter runs programs one after another
        monkeypatch.setitem(dequant.MATVEC_CONFIG, int(t), (4, 2, 4, 1))
    else:
        monkeypatch.setitem(dequant.MATVEC_CONFIG, int(t), (*dequant.gemv_config(t)[:3], 1))

    def linear(n: int, seed: int, **kw) -> FrozenQuantLinear:
        raw = torch.from_numpy(random_rows(t, n, cols, seed=seed))
        lin = FrozenQuantLinear(
            raw, t, cols, compute_dtype=torch.bfloat16, dequant="triton" if not GPU else "auto", **kw
        )
        return lin.to(DEVICE)

    q, k, v = linear(rows(5)[0], 1), linear(rows(3)[0], 2), linear(rows(3)[0], 3)
    x = torch.randn(1, 1, cols, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    loras = [lora_term(m.out_features, 1, 4, seed=s, dtype=torch.bfloat16) for s, m in enumerate((q, v))]
    loras = [loras[0], None, loras[1]]
    with torch.no_grad():
        y = ResidentQuantLinear.matmul_group([q, k, v], x, loras)
        assert y is not None and y.shape == (1, 1, q.out_features + k.out_features + v.out_features)
        ref = torch.cat([q.matmul_lora(x, *loras[0]), k.matmul(x), v.matmul_lora(x, *loras[2])], dim=-1)
        assert same_bits(y, ref)
        gate, up = linear(rows(5)[0], 4), linear(rows(5)[0], 5)
        y = ResidentQuantLinear.matmul_group([gate, up], x, [None, loras[0]], act="silu")
        ref = gated_forward(gate.matmul(x), up.matmul_lora(x, *loras[0]), "silu")
        assert y is not None and same_bits(y, ref)
        assert ResidentQuantLinear.matmul_group([q, k], x, [None], act=None) is None
        biased = linear(rows(5)[0], 6, bias=torch.ones(rows(5)[0]))
        assert ResidentQuantLinear.matmul_group([gate, biased], x, [None, None], act="silu") is None
        assert ResidentQuantLinear.matmul_group([q, k], x, [None, None], act="silu") is None  # unequal rows
        assert ResidentQuantLinear.matmul_group([gate, up], x, [None, None], act="relu") is None
        cached = linear(rows(3)[0], 8, cache="bf16")
        assert ResidentQuantLinear.matmul_group([q, cached], x, [None, None]) is None
        k4 = FrozenQuantLinear(torch.from_numpy(random_rows(GGMLType.Q4_0, 3, cols, seed=7)), GGMLType.Q4_0, cols)
        k4.dequant = "triton" if not GPU else "auto"
        assert ResidentQuantLinear.matmul_group([q, k4.to(DEVICE)], x, [None, None]) is None
