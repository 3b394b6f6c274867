"""The bf16 LoRA step on a CPU streaming base (`juno_py.lora.bf16_step`) against the composed ops it replaces: the
same output and gradients of x, A and B, computed from the same bf16 products (each within bf16 rounding of an fp64
reference), and the places it must not run."""

import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import bf16_step
from juno_py.lora.adapters import AdaptedLinear, AdapterConfig, LoraAdapter
from juno_py.testing.blocks import random_rows
from juno_py.weights import FrozenQuantLinear

N_IN, N_OUT, RANK = 256, 96, 8


def layer(cache: str, compute: torch.dtype = torch.bfloat16, bias: bool = False):
    raw = random_rows(GGMLType.Q8_0, N_OUT, N_IN, seed=0)
    b = torch.randn(N_OUT, generator=torch.Generator().manual_seed(1)) if bias else None
    base = FrozenQuantLinear(raw, GGMLType.Q8_0, N_IN, bias=b, cache=cache, compute_dtype=compute)
    ad = LoraAdapter(N_IN, N_OUT, AdapterConfig(rank=RANK, alpha=12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ad.lora_B.normal_(0, 64.0, generator=torch.Generator().manual_seed(3))
    return AdaptedLinear(base, [ad], [0.5])  # s = 0.5 · 12 / 8


def run(lin: AdaptedLinear, x: torch.Tensor, dy: torch.Tensor):
    ad = lin.adapters[0]
    ad.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = lin(x)
    y.backward(dy)
    return y.detach(), x.grad, ad.lora_A.grad, ad.lora_B.grad


def reference(lin: AdaptedLinear, x: torch.Tensor, dy: torch.Tensor):
    """fp64 over the same dequantized W: y = x·Wᵀ + b + w·s·x·Aᵀ·Bᵀ and its gradients."""
    ad = lin.adapters[0]
    W = lin.base.dequantize_rows(0, N_OUT).double()
    A = ad.lora_A.detach().double().requires_grad_(True)
    B = ad.lora_B.detach().double().requires_grad_(True)
    xd = x.double().requires_grad_(True)
    y = xd @ W.T + lin.weights[0] * ad.scale * (xd @ A.T) @ B.T
    if lin.base.bias is not None:
        y = y + lin.base.bias.double()
    y.backward(dy.double())
    return y.detach(), xd.grad, A.grad, B.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cache", ["none", "bf16"])
def test_bf16_step_matches_the_composed_ops(cache, bias, monkeypatch):
    lin = layer(cache, bias=bias)
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(2, 20, N_IN, generator=g), torch.randn(2, 20, N_OUT, generator=g)
    calls = []
    real = bf16_step.LoraBf16Fn.apply
    monkeypatch.setattr(bf16_step.LoraBf16Fn, "apply", lambda *a: calls.append(1) or real(*a))
    fused = run(lin, x, dy)
    assert calls, "the bf16 step did not run"
    monkeypatch.setattr(bf16_step, "applies", lambda *a: False)
    composed = run(lin, x, dy)
    want = reference(lin, x, dy)
    for name, f, c, w in zip(("y", "dx", "dA", "dB"), fused, composed, want):
        assert f.dtype == torch.float32 and f.shape == w.shape, name
        # bf16 products: a few bf16 roundings (2^-9 relative each) from the fp64 values, as the composed ops' (whose
        # adapter products run in fp32: dA and dB exact there); B is drawn so that the adapter's part of y and dx is
        # about as large as W's (random Q8_0 rows: W's values have σ ≈ 5)
        assert rel(f, w) < 8 * 2**-9, (name, rel(f, w))
        assert rel(c, w) < 8 * 2**-9, (name, rel(c, w))


def test_bf16_step_stays_out_of_fp32_inference_and_dropout():
    lin32 = layer("none", compute=torch.float32)
    x = torch.randn(1, 20, N_IN)
    assert not bf16_step.applies(lin32.base, x, 0.0)  # fp32 compute
    lin = layer("none")
    assert bf16_step.applies(lin.base, x, 0.0)
    assert not bf16_step.applies(lin.base, x, 0.1)  # dropout keeps its mask in the composed ops
    assert not bf16_step.applies(lin.base, x.double(), 0.0)  # exactness checks
    assert not bf16_step.applies(lin.base, x[:, :4], 0.0)  # few tokens: the streaming base computes in fp32
    with torch.no_grad():
        assert not bf16_step.applies(lin.base, x, 0.0)  # inference
