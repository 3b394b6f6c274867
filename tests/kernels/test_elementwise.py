"""The fused elementwise kernels of a decoder block (RMSNorm, SwiGLU / GeGLU-tanh, RoPE on q and k) against fp64
references of the same inputs, forward and gradients; their dispatch; whole tiny models through them against the
eager model.

Bounds: the kernels compute in fp32 and round each result once, so a result is within a few fp32 roundings of the
magnitudes of the terms it sums (a factor for the length of a row's reduction), plus, for a bf16 result, half a bf16
ulp of the value (≤ 2⁻⁸·|value|; round to nearest even: a truncating store fails). On a GPU the same tests run
compiled, and also at 8B sizes.
"""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels import KernelUnavailable, elementwise  # noqa: E402
from juno_py.kernels import elementwise_triton as et  # noqa: E402
from juno_py.lora import attach  # noqa: E402
from juno_py.models import load_model  # noqa: E402
from juno_py.models.model import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24  # unit roundoff of fp32
HALF_BF16 = 2.0**-8  # half a bf16 ulp, relative to the value (bound)
CUDA = DEVICE == "cuda"
DTYPES = [torch.float32, torch.bfloat16]


def rounding(dtype, ref):
    """The output's rounding to `dtype`: half an ulp of bf16 (0 for fp32 results, whose error the fp32 term holds)."""
    return HALF_BF16 * ref.abs() if dtype == torch.bfloat16 else torch.zeros_like(ref)


def randn(shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(DEVICE, dtype)


def check(got, ref, bound, what):
    err = (got.detach().double() - ref).abs()
    worst = float((err - bound).max()) if err.numel() else 0.0
    assert worst <= 0.0, f"{what}: error exceeds the bound by {worst:.3g} (max error {float(err.max()):.3g})"


# --- RMSNorm ---------------------------------------------------------------------------------------------------
RMS_SHAPES = [(1, 1), (3, 7), (5, 64), (4, 300), (2, 3, 128)] + ([(4096, 4096)] if CUDA else [])


def rms_reference(x, w, eps, dy):
    x64 = x.double().requires_grad_(True)
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    y.backward(dy.double())
    return y.detach(), x64.grad


@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rms_norm_matches_fp64(shape, x_dtype, out_dtype):
    eps = 1e-6
    n = shape[-1]
    x = randn(shape, x_dtype, 2.0, seed=1)
    w = randn((n,), torch.float32, 1.0, seed=2)
    dy = randn(shape, out_dtype, 1.0, seed=3)
    xr = x.clone().requires_grad_(True)
    y = et.RMSNormFn.apply(xr, w, eps, out_dtype)
    y.backward(dy)
    assert y.dtype == out_dtype and y.shape == x.shape and xr.grad.dtype == x_dtype
    ref_y, ref_dx = rms_reference(x, w, eps, dy)
    steps = math.log2(n) + 4  # the sum's levels, the mean, the square root and the products
    check(y, ref_y, 8 * U32 * steps * ref_y.abs() + rounding(out_dtype, ref_y), "y")
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    wdy, xhat = (w.double() * dy.double()), x.double() * rstd
    terms = rstd * (wdy.abs() + xhat.abs() * (wdy * xhat).abs().mean(-1, keepdim=True))
    check(xr.grad, ref_dx, 16 * U32 * steps * terms + rounding(x_dtype, ref_dx), "dx")


def test_rms_norm_rows_of_a_wider_tensor():
    """Per-head q/k norm (Qwen3, Gemma 3): rows of head_dim inside `[B, T, H, D]`, a view with a row stride."""
    base = randn((2, 3, 4, 24), torch.float32, seed=4)
    x = base[..., :16]  # rows 24 apart
    w = randn((16,), torch.float32, seed=5)
    y = et.RMSNormFn.apply(x, w, 1e-6, torch.float32)
    ref, _ = rms_reference(x, w, 1e-6, torch.ones_like(x))
    check(y, ref, 8 * U32 * 8 * ref.abs(), "y")


# --- gated activations -----------------------------------------------------------------------------------------
GATED_SHAPES = [(1,), (3, 7), (2, 1500)] + ([(4096, 14336)] if CUDA else [])


def gelu_tanh64(g):
    """½g(1 + tanh(k(g + c·g³))) as g·σ(2k(g + c·g³)): the same function, without the cancellation of 1 + tanh that
    makes even fp64 `F.gelu(approximate="tanh")` 0 from g ≈ −8 on (true value −3·10⁻²¹ there)."""
    return g * torch.sigmoid(2 * et.GELU_K * (g + et.GELU_C * g**3))


REF_ACTS = {"silu": F.silu, "gelu_tanh": gelu_tanh64}


def test_gelu_reference_is_torchs_gelu_tanh():
    g = torch.linspace(-6, 6, 241, dtype=torch.float64)
    torch.testing.assert_close(gelu_tanh64(g), F.gelu(g, approximate="tanh"), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_matches_fp64(act, shape, dtype):
    g = randn(shape, dtype, 3.0, seed=6)
    if g.numel() > 4:  # the tails: saturated sigmoids both ways, and zero
        g.view(-1)[:5] = torch.tensor([-30.0, -12.0, 0.0, 12.0, 30.0], dtype=dtype)
    u = randn(shape, dtype, 1.0, seed=7)
    dy = randn(shape, dtype, 1.0, seed=8)
    gr, ur = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    y = et.GatedFn.apply(gr, ur, act)
    y.backward(dy)
    g64, u64 = g.double().requires_grad_(True), u.double().requires_grad_(True)
    ref = REF_ACTS[act](g64) * u64
    ref.backward(dy.double())
    assert y.dtype == dtype and gr.grad.dtype == dtype and ur.grad.dtype == dtype
    g_, u_, dy_ = g.double(), u.double(), dy.double()
    if act == "silu":
        v, dv = g_, torch.ones_like(g_)
    else:
        v = 2 * et.GELU_K * (g_ + et.GELU_C * g_**3)
        dv = 2 * et.GELU_K * (1 + 3 * et.GELU_C * g_**2)
    sig = torch.sigmoid(v)
    # exp's argument carries its rounding times |v|; a few more roundings per operation; σ(v) below fp32's normal
    # range (v < −87) loses its bits: an absolute 2⁻¹²⁶ per unit of the factors around it (values there are ~1e-40)
    rel = 16 * U32 * (v.abs() + 4)
    tiny = 2.0**-126 * (1 + g_.abs() * dv.abs()) * (1 + u_.abs()) * (1 + dy_.abs())
    check(y, ref.detach(), rel * (g_ * sig * u_).abs() + rounding(dtype, ref.detach()) + tiny, "y")
    check(ur.grad, u64.grad, rel * (dy_ * g_ * sig).abs() + rounding(dtype, u64.grad) + tiny, "du")
    d_terms = (dy_ * u_).abs() * (sig + (g_ * dv).abs() * sig * (1 - sig) + (g_ * dv).abs() * U32)
    check(gr.grad, g64.grad, rel * d_terms + rounding(dtype, g64.grad) + tiny, "dg")


def test_gated_refuses_mismatched_operands():
    with pytest.raises(ValueError, match="gate .* and up .*: expected two float32 or bfloat16 tensors"):
        et.gated_forward(torch.zeros(3, device=DEVICE), torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="'relu': expected one of silu, gelu_tanh"):
        et.gated_forward(torch.zeros(3, device=DEVICE), torch.zeros(3, device=DEVICE), "relu")


# --- RoPE ------------------------------------------------------------------------------------------------------
# (B, T, HQ, HK, D, rope_dim): full and partial rotation, q and k heads sharing a program (10 + 3 over blocks of 8)
ROPE_CASES = [(1, 1, 1, 1, 2, 2), (2, 3, 4, 2, 8, 8), (2, 3, 10, 3, 8, 4), (1, 5, 3, 1, 12, 8), (2, 4, 2, 2, 16, 12)]
if CUDA:
    ROPE_CASES.append((8, 512, 32, 8, 128, 128))


def rope_tables(b, t, rope_dim, dtype, seed=9):
    """cos, sin as the model builds them, for distinct positions per row (packed documents restart them)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4000, (b, t), generator=gen)
    return rope_cos_sin(positions.to(DEVICE), rope_inv_freq(rope_dim, 500000.0).to(DEVICE), 1.0, dtype)


def magnitude(x, cos, sin, style):
    """|x_d·cos| + |x_p·sin| of each rotated feature (and 2|x_d| of the others)."""
    x, zero = x.double().abs(), torch.zeros_like(cos)
    on_cos = apply_rope(x, cos.abs(), zero, style, complex_pairs=False)
    return on_cos + apply_rope(x, zero, sin.abs(), style, complex_pairs=False).abs()


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_fp64(case, style, dtype):
    b, t, hq, hk, d, rope_dim = case
    cos, sin = rope_tables(b, t, rope_dim, dtype)
    q, k = randn((b, t, hq, d), dtype, seed=10), randn((b, t, hk, d), dtype, seed=11)
    dq, dk = randn((b, t, hq, d), dtype, seed=12), randn((b, t, hk, d), dtype, seed=13)
    qr, kr = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    oq, ok = et.RopeQKFn.apply(qr, kr, cos, sin, style)
    torch.autograd.backward((oq, ok), (dq, dk))
    assert oq.dtype == dtype and ok.shape == k.shape and qr.grad.dtype == dtype
    c64, s64 = cos.double(), sin.double()  # the tables as given (bf16 ones rounded): the kernel reads the same
    for x, out, dout, grad, what in ((q, oq, dq, qr.grad, "q"), (k, ok, dk, kr.grad, "k")):
        x64 = x.double().requires_grad_(True)
        ref = apply_rope(x64, c64, s64, style, complex_pairs=False)
        ref.backward(dout.double())
        mag, gmag = magnitude(x, c64, s64, style), magnitude(dout, c64, s64, style)
        check(out, ref.detach(), 4 * U32 * mag + rounding(dtype, ref.detach()), what)
        check(grad, x64.grad, 4 * U32 * gmag + rounding(dtype, x64.grad), f"d{what}")


def test_rope_takes_head_major_strides():
    """Attention hands back gradients laid out `[B, H, T, D]`: the kernel reads them where they are."""
    q = randn((2, 4, 3, 8), torch.float32, seed=16).transpose(1, 2)  # [B, T, H, D] view, head-major
    k = randn((2, 2, 3, 8), torch.float32, seed=17).transpose(1, 2)
    cos, sin = rope_tables(2, 3, 8, torch.float32)
    oq, ok = et.rope_apply(q, k, cos, sin, "neox")
    assert oq.is_contiguous() and ok.is_contiguous()
    torch.testing.assert_close(oq, et.rope_apply(q.contiguous(), k.contiguous(), cos, sin, "neox")[0], rtol=0, atol=0)
    ref = apply_rope(k.double(), cos.double(), sin.double(), "neox", complex_pairs=False)
    check(ok, ref, 4 * U32 * magnitude(k, cos.double(), sin.double(), "neox"), "k")


def test_rope_inverse_undoes_the_rotation():
    q, k = randn((2, 3, 4, 8), torch.float32, seed=14), randn((2, 3, 2, 8), torch.float32, seed=15)
    cos, sin = rope_tables(2, 3, 6, torch.float32)
    oq, ok = et.rope_apply(q, k, cos, sin, "norm")
    assert float((oq - q).abs().max()) > 0.1  # it rotated
    bq, bk = et.rope_apply(oq, ok, cos, sin, "norm", inverse=True)
    torch.testing.assert_close(bq, q, rtol=0, atol=8 * U32 * 4)
    torch.testing.assert_close(bk, k, rtol=0, atol=8 * U32 * 4)


def test_rope_refuses_tables_wider_than_the_head():
    q = torch.zeros(1, 2, 2, 4, device=DEVICE)
    cos = torch.zeros(1, 2, 1, 3, device=DEVICE)
    with pytest.raises(ValueError, match="tables of at most head_dim/2 angles"):
        et.rope_apply(q, q, cos, cos, "norm")
    with pytest.raises(ValueError, match="style 'gptj': expected 'norm' or 'neox'"):
        et.rope_apply(q, q, cos[..., :2], cos[..., :2], "gptj")


# --- dispatch --------------------------------------------------------------------------------------------------
def test_cpu_tensors_take_the_eager_code(monkeypatch):
    """CPU tensors run the model's eager code in every mode unless the interpreted kernels are asked for."""
    x, w = torch.randn(2, 8), torch.ones(8)
    for mode in ("auto", "fused", "eager"):
        monkeypatch.setenv("JUNO_PY_KERNELS", mode)
        assert elementwise.rms_norm(x, w, 1e-6, torch.float32) is None
        assert elementwise.gated("silu", x, x) is None
        assert (
            elementwise.rope_qk(
                x.view(1, 2, 1, 8),
                x.view(1, 2, 1, 8),
                x[:, :4].reshape(1, 2, 1, 4),
                x[:, :4].reshape(1, 2, 1, 4),
                "norm",
            )
            is None
        )


def test_dispatch_rules(fused, monkeypatch):
    monkeypatch.setattr(elementwise, "INTERPRET_CPU", True)
    x, w = torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    assert elementwise.rms_norm(x, w, 1e-6, torch.float32) is not None
    assert elementwise.rms_norm(x.double(), w, 1e-6, torch.float64) is None  # fp64 exactness checks stay eager
    assert elementwise.rms_norm(x, w.double(), 1e-6, torch.float64) is None
    assert elementwise.rms_norm(x, w.clone().requires_grad_(True), 1e-6, torch.float32) is None  # no dw kernel
    assert elementwise.gated("silu", x, x.bfloat16()) is None
    monkeypatch.setenv("JUNO_PY_KERNELS", "eager")
    assert elementwise.rms_norm(x, w, 1e-6, torch.float32) is None
    monkeypatch.setenv("JUNO_PY_KERNELS", "auto")  # the default: fused on a GPU, eager on CPU tensors
    assert (elementwise.rms_norm(x, w, 1e-6, torch.float32) is None) == (not CUDA)


@pytest.mark.skipif(CUDA, reason="the CPU's rule")
def test_fused_on_cpu_needs_the_interpreter(fused, monkeypatch):
    import juno_py.kernels.dora_triton as dt

    monkeypatch.setattr(elementwise, "INTERPRET_CPU", True)
    monkeypatch.setattr(dt, "INTERPRETED", False)
    with pytest.raises(KernelUnavailable, match="TRITON_INTERPRET=1"):
        elementwise.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.float32)


# --- whole models ----------------------------------------------------------------------------------------------
TOKENS = torch.tensor([[1, 5, 9, 200, 17, 42, 3, 77], [150, 8, 64, 99, 12, 250, 31, 2]])


def loss_and_grads(model, params):
    for p in params:
        p.grad = None
    tokens = TOKENS.to(DEVICE)
    loss = model.loss(tokens, tokens.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


# llama: adjacent pairs, SwiGLU; qwen3: halves, per-head q/k norm; gemma3: GeGLU-tanh, sandwich norms, q/k norm
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_model_through_fused_kernels_matches_eager(arch, tiny_gguf, monkeypatch):
    """A LoRA step's loss and every adapter gradient: fused within fp32 roundoff of the eager model (each op's
    error is a few fp32 roundings; two blocks and the loss keep the relative difference under 1e-5), and every fused
    kernel ran."""
    path = tiny_gguf(arch, GGMLType.F32)
    model = load_model(path, device=DEVICE)
    adapters = attach(model, "all", rank=4, alpha=8)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:  # B is zero after attach: give every adapter an effect and every A a gradient
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    assert adapters is not None and params
    monkeypatch.setenv("JUNO_PY_KERNELS", "eager")
    loss_e, grads_e = loss_and_grads(model, params)
    calls = {"rms": 0, "rms_bwd": 0, "gated": 0, "rope": 0}
    spied = {"rms": "rms_norm_forward", "rms_bwd": "rms_norm_backward", "gated": "gated_backward", "rope": "rope_apply"}
    for key, name in spied.items():
        real = getattr(et, name)

        def spy(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(et, name, spy)
    monkeypatch.setattr(elementwise, "INTERPRET_CPU", True)
    monkeypatch.setenv("JUNO_PY_KERNELS", "fused")
    loss_f, grads_f = loss_and_grads(model, params)
    n_layer = len(model.blocks)
    assert calls["rope"] == 2 * n_layer  # forward and backward, q and k together
    assert calls["gated"] == n_layer
    n_norm = sum(isinstance(m, RMSNorm) for m in model.modules())
    assert calls["rms"] == n_norm
    assert calls["rms_bwd"] == n_norm - 1  # all but the first block's input norm: the embeddings take no gradient
    assert abs(float(loss_f - loss_e)) <= 1e-5 * abs(float(loss_e))
    for ge, gf in zip(grads_e, grads_f):
        assert float((gf.double() - ge.double()).norm()) <= 1e-5 * float(ge.double().norm())
