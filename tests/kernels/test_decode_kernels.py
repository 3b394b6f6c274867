"""The decode step's fused kernels (`kernels.decode_triton`) give the unfused kernels' bits: `add_rms` equals
torch's residual addition between `elementwise_triton`'s RMSNorm launches (with and without the sandwich norm of the
added rows), and its LoRA product `lora_xa`'s, and `rope_cache` equals `elementwise_triton.rope_apply` followed by the cache writes
(`index_copy_`), both RoPE styles, grouped-query heads and a value width other than the key's, at the first and the
last position of the cache; `attend` is softmax attention over the cache rows up to the position (and inside the
window) within fp32 rounding, never reading the rows after it. Interpreted on the CPU (small shapes) or compiled on the GPU."""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.kernels.decode_triton import add_rms, attend, rope_cache  # noqa: E402
from juno_py.kernels.dequant import lora_xa  # noqa: E402
from juno_py.kernels.elementwise_triton import rms_norm_forward, rope_apply  # noqa: E402
from juno_py.models.model import rope_cos_sin, rope_inv_freq  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402


def _bits_equal(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.bfloat16 else torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize("n", [576, 100])
def test_add_rms_equals_the_addition_between_the_norm_kernels(dtype, post, n):
    g = torch.Generator().manual_seed(n + post)
    x = (4 * torch.randn(3, n, generator=g)).to(dtype).to(DEVICE)
    h = torch.randn(3, n, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(DEVICE)
    wp = (1 + 0.5 * torch.randn(n, generator=g)).to(DEVICE)
    added = rms_norm_forward(h, wp, 1e-5, dtype)[0] if post else h
    want_x = x + added
    want_y = rms_norm_forward(want_x, w, 1e-6, dtype)[0]
    got_x, got_y, none = add_rms(x, h, w, 1e-6, post=(wp, 1e-5) if post else None)
    assert _bits_equal(got_x, want_x) and _bits_equal(got_y, want_y) and none is None
    assert not _bits_equal(got_y, rms_norm_forward(x, w, 1e-6, dtype)[0])  # the sum, not x, was normalized
    # one row with a LoRA's A: every program normalizes the row, program 0 stores it, each multiplies its rows of A
    A = torch.randn(37, n, generator=g).to(dtype).to(DEVICE)
    one_x, one_y, xa = add_rms(x[1:2], h[1:2], w, 1e-6, post=(wp, 1e-5) if post else None, lora_a=A)
    assert _bits_equal(one_x, want_x[1:2]) and _bits_equal(one_y, want_y[1:2])
    assert xa.shape == (1, 37) and _bits_equal(xa, lora_xa(want_y[1:2], A))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("style,hq,hk,dim,dim_v,rope_dim", [("norm", 4, 2, 16, 16, 16), ("neox", 6, 2, 32, 16, 24)])
def test_rope_cache_equals_the_rotation_and_the_cache_writes(dtype, style, hq, hk, dim, dim_v, rope_dim):
    max_len = 7
    g = torch.Generator().manual_seed(hq + dim)
    inv = rope_inv_freq(rope_dim, 10000.0)
    cos, sin = rope_cos_sin(torch.arange(max_len).unsqueeze(0), inv, 1.0, dtype)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    kc0 = torch.randn(1, hk, max_len, dim, generator=g).to(dtype).to(DEVICE)
    vc0 = torch.randn(1, hk, max_len, dim_v, generator=g).to(dtype).to(DEVICE)
    for p in (0, max_len - 1):
        qkv = torch.randn(hq * dim + hk * dim + hk * dim_v, generator=g).to(dtype).to(DEVICE)
        q, k, v = qkv.split([hq * dim, hk * dim, hk * dim_v])
        pos = torch.tensor([p], device=DEVICE)
        kc, vc = kc0.clone(), vc0.clone()
        got_q = rope_cache(q, k, v, cos, sin, pos, kc, vc, style)
        want_q, want_k = rope_apply(
            q.view(1, 1, hq, dim), k.view(1, 1, hk, dim), cos[:, p : p + 1], sin[:, p : p + 1], style
        )
        want_kc, want_vc = kc0.clone(), vc0.clone()
        want_kc.index_copy_(2, pos, want_k.transpose(1, 2))
        want_vc.index_copy_(2, pos, v.view(1, 1, hk, dim_v).transpose(1, 2))
        assert _bits_equal(got_q, want_q.transpose(1, 2).contiguous())
        assert _bits_equal(kc, want_kc) and _bits_equal(vc, want_vc)
        assert not _bits_equal(kc, kc0)  # the row was written


def test_rope_cache_refuses_mismatched_inputs():
    t = torch.zeros(8, device=DEVICE)
    cache = torch.zeros(1, 1, 4, 8, device=DEVICE)
    cos = torch.zeros(1, 4, 1, 4, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="rope_cache: .* expected one token's contiguous heads"):
        rope_cache(t, t, t, cos, cos, pos, cache, cache, "gptj")
    with pytest.raises(ValueError, match="rope_cache"):
        rope_cache(t, t, t, cos, cos, pos.int(), cache, cache, "norm")


def _attention_reference(q, kc, vc, p, scale, window):
    """fp64 softmax attention of one token's heads over cache rows 0..p (the last `window` when > 0)."""
    hk, dim = kc.shape[1], kc.shape[-1]
    q = q.double().view(hk, -1, dim)
    lo = max(p - window + 1, 0) if window else 0
    k, v = kc[0, :, lo : p + 1].double(), vc[0, :, lo : p + 1].double()
    w = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)
    return (w @ v).reshape(-1, vc.shape[-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hk,dim,dim_v,max_len", [(4, 2, 16, 16, 150), (3, 3, 64, 32, 70), (2, 1, 16, 16, 600)])
def test_attend_equals_softmax_attention_over_the_cache_rows_up_to_the_position(dtype, hq, hk, dim, dim_v, max_len):
    g = torch.Generator().manual_seed(hq * dim)
    kc = (2 * torch.randn(1, hk, max_len, dim, generator=g)).to(dtype).to(DEVICE)
    vc = torch.randn(1, hk, max_len, dim_v, generator=g).to(dtype).to(DEVICE)
    # rows after the position hold garbage the kernel must not read: a huge key there would dominate the softmax
    for p, window in [(0, 0), (max_len // 2, 0), (max_len - 1, 0), (max_len - 1, 5), (70 % max_len, 64), (3, 8)]:
        q = torch.randn(hq * dim, generator=g).to(dtype).to(DEVICE)
        kx, vx = kc.clone(), vc.clone()
        kx[:, :, p + 1 :] = 1e4
        vx[:, :, p + 1 :] = float("nan")
        got = attend(q, kx, vx, torch.tensor([p], device=DEVICE), dim**-0.5, window)
        want = _attention_reference(q, kc, vc, p, dim**-0.5, window)
        err = (got.double() - want).abs().max().item()
        # fp32: a few ulp of the values' range; bf16: the output's rounding (half an ulp) and the fp32 sums before it
        bound = 1e-5 if dtype == torch.float32 else 2**-8 * want.abs().max().item() + 1e-5
        assert err <= bound, f"p {p} window {window}: max |Δ| {err:.3g} > {bound:.3g}"
        if window and p >= window:  # the rows before the window are left out
            assert (want - _attention_reference(q, kc, vc, p, dim**-0.5, 0)).abs().max().item() > 10 * bound
