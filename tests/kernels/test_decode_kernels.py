"""The decode step's fused kernels (`kernels.decode_triton`) give the unfused kernels' bits: `add_rms` equals
torch's residual addition between `elementwise_triton`'s RMSNorm launches (with and without the sandwich norm of the
added rows, in place or not), and `rope_cache` equals `elementwise_triton.rope_apply` followed by the cache writes
(`index_copy_`), both RoPE styles, grouped-query heads and a value width other than the key's, at the first and the
last position of the cache. Interpreted on the CPU (small shapes) or compiled on the GPU."""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.kernels.decode_triton import add_rms, rope_cache  # noqa: E402
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
    got_x, got_y = add_rms(x, h, w, 1e-6, post=(wp, 1e-5) if post else None)
    assert _bits_equal(got_x, want_x) and _bits_equal(got_y, want_y)
    assert not _bits_equal(got_y, rms_norm_forward(x, w, 1e-6, dtype)[0])  # the sum, not x, was normalized
    xin = x.clone()
    same_x, same_y = add_rms(xin, h, w, 1e-6, post=(wp, 1e-5) if post else None, out=xin)
    assert same_x is xin and _bits_equal(xin, want_x) and _bits_equal(same_y, want_y)


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
