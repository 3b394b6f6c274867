"""Fused Triton kernels of the one-token decode step (`models.decode_cuda.CudaGraphDecoder`), where a step's time is
its launches, not its bytes: each kernel here does in one launch what the block's own modules do in two or three,
with the same operations in the same order, so its results are the unfused kernels' bits.

- `add_rms`: a residual addition and the next RMSNorm (`x ← x + h`, then `norm(x)`), with the block's sandwich
  norm of h first where it has one: the unfused path is `elementwise_triton._rms_fwd_kernel` (for the sandwich
  norm), torch's addition (fp32 sum rounded once to the activations' dtype) and `_rms_fwd_kernel` again.
- `rope_cache`: RoPE on the step's query and key heads and the key and the value written into the KV cache at the
  step's position, read from a device tensor: the unfused path is `elementwise_triton._rope_kernel`, two
  `index_copy_` and the rows of the cos and sin tables picked by `index_select`.

Inputs are bf16 or fp32, arithmetic fp32, each stored value rounded once to nearest even (`dora_triton._store`).
Imported only when a fused decode step runs (it imports triton).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from juno_py.kernels.dora_triton import FUSED_DTYPES, _launch, _out_arg, _store
from juno_py.kernels.elementwise_triton import _rms_warps
from juno_py.kernels.launch import cdiv, next_pow2

ROPE_CACHE_HEADS = 8  # heads (of q, k and v together) a rope_cache program


@triton.jit
def _as_stored(v, BF16: tl.constexpr):
    """fp32 `v` as `_store` would store it and a load read it back: rounded to bf16 (nearest even, NaN kept) when
    BF16, unchanged otherwise."""
    if BF16:
        bits = v.to(tl.uint32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, r.to(tl.float32, bitcast=True))
    else:
        return v


@triton.jit
def _rms_row(x, w, N, eps):
    """`_rms_fwd_kernel`'s product for one row held in registers: (x·rstd)·w with rstd = 1/sqrt(mean(x²) + eps)."""
    ms = tl.sum(x * x, axis=0) / N
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    return (x * rstd) * w


@triton.jit
def _add_rms_kernel(
    x_ptr,
    h_ptr,
    wpost_ptr,
    w_ptr,
    xo_ptr,
    y_ptr,
    N,
    eps_post,
    eps,
    POST: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `program_id`: h ← norm_post(h) when POST (stored value), s = x + h (stored value) into xo, y = norm(s)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    if POST:
        wp = tl.load(wpost_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        h = _as_stored(_rms_row(h, wp, N, eps_post), BF16)
    s = _as_stored(x + h, BF16)
    _store(xo_ptr + row * N + cols, s, ok, BF16)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    _store(y_ptr + row * N + cols, _rms_row(s, w, N, eps), ok, BF16)


def add_rms(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    post: Optional[tuple[torch.Tensor, float]] = None,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, RMSNorm(x + h) · weight) for x and h `[..., N]` of one dtype (bf16 or fp32; contiguous), the norm
    weight fp32 `[N]`; `post`: (weight, eps) of an RMSNorm applied to h first. The sum goes to `out` (a tensor like
    x; x itself is allowed) or a new tensor; the normalized rows are a new tensor in x's dtype."""
    n = x.shape[-1]
    if (
        x.dtype not in FUSED_DTYPES
        or h.dtype != x.dtype
        or h.shape != x.shape
        or not x.is_contiguous()
        or not h.is_contiguous()
        or weight.shape != (n,)
        or weight.dtype != torch.float32
        or (post is not None and (post[0].shape != (n,) or post[0].dtype != torch.float32))
    ):
        raise ValueError(
            f"add_rms: x {tuple(x.shape)} {x.dtype}, h {tuple(h.shape)} {h.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: expected contiguous x and h of one shape and dtype (bf16 or fp32) and fp32 weights [{n}]"
        )
    xo = torch.empty_like(x) if out is None else out
    y = torch.empty_like(x)
    rows = x.numel() // max(n, 1)
    if rows:
        block = next_pow2(n)
        wpost, eps_post = post if post is not None else (weight, 0.0)
        _launch(
            _add_rms_kernel,
            (rows,),
            (x, h, wpost, weight, _out_arg(xo), _out_arg(y), n, float(eps_post), float(eps)),
            _rms_warps(block),
            POST=post is not None,
            BF16=x.dtype == torch.bfloat16,
            BLOCK=block,
        )
    return xo, y


@triton.jit
def _rope_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    HQ,
    HK,
    D,
    DV,
    HALF,
    kc_head,
    vc_head,
    NEOX: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Heads `program_id(0)`·BLOCK_H.. of q's HQ, k's HK and v's HK (one token; each head's D or DV features
    contiguous): a q head rotated into qo `[HQ, D]`, a k head rotated into the cache's row `pos` of its head
    (`kc_ptr + head·kc_head + pos·D`), a v head copied into `vc_ptr + head·vc_head + pos·DV`. The rotation is
    `_rope_kernel`'s (the first 2·HALF features x_d become x_d·cos_j ∓ x_p·sin_j, the angles row `pos` of the
    tables `[positions, HALF]`)."""
    pos = tl.load(pos_ptr)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    rot = d < 2 * HALF
    if NEOX:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        j = tl.where(first, d, d - HALF)
    else:
        first = (d % 2) == 0
        partner = d ^ 1
        j = d // 2
    j = tl.where(rot, j, 0)
    partner = tl.where(rot, partner, d)
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HK)
    is_v = (h >= HQ + HK) & (h < HQ + 2 * HK)
    hk = tl.where(is_k, h - HQ, 0)
    hv = tl.where(is_v, h - HQ - HK, 0)
    mq = is_q & (d < D)
    mk = is_k & (d < D)
    mv = is_v & (d < DV)
    x = tl.where(
        is_q,
        tl.load(q_ptr + h * D + d, mask=mq, other=0.0).to(tl.float32),
        tl.load(k_ptr + hk * D + d, mask=mk, other=0.0).to(tl.float32),
    )
    xp = tl.where(
        is_q,
        tl.load(q_ptr + h * D + partner, mask=mq & rot, other=0.0).to(tl.float32),
        tl.load(k_ptr + hk * D + partner, mask=mk & rot, other=0.0).to(tl.float32),
    )
    c = tl.load(cos_ptr + pos * HALF + j, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + j, mask=rot, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)
    y = tl.where(rot, x * c + xp * s, x)
    _store(qo_ptr + h * D + d, y, mq, BF16)
    _store(kc_ptr + hk.to(tl.int64) * kc_head + pos * D + d, y, mk, BF16)
    val = tl.load(v_ptr + hv * DV + d, mask=mv, other=0.0).to(tl.float32)
    _store(vc_ptr + hv.to(tl.int64) * vc_head + pos * DV + d, val, mv, BF16)


def rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    style: str,
) -> torch.Tensor:
    """One token's q `[HQ·D]`, k `[HK·D]` and v `[HK·DV]` (any shapes of those sizes, contiguous; bf16 or fp32):
    returns q rotated by RoPE at position `pos` (a one-element long tensor on the device, read by the kernel) as
    `[1, HQ, 1, D]`, and writes k rotated and v into the caches `[1, HK, max_len, D]` (and DV) at that position.
    cos and sin: the whole tables `[1, max_len, 1, rope_dim / 2]` (`models.model.rope_cos_sin`)."""
    _, hk, max_len, dim = k_cache.shape
    dim_v = v_cache.shape[-1]
    hq = q.numel() // dim
    half = cos.shape[-1]
    dtype = q.dtype
    if (
        style not in ("norm", "neox")
        or dtype not in FUSED_DTYPES
        or {k.dtype, v.dtype, k_cache.dtype, v_cache.dtype, cos.dtype, sin.dtype} != {dtype}
        or q.numel() != hq * dim
        or k.numel() != hk * dim
        or v.numel() != hk * dim_v
        or not all(t.is_contiguous() for t in (q, k, v, k_cache, v_cache, cos, sin))
        or k_cache.shape[0] != 1
        or v_cache.shape[:3] != k_cache.shape[:3]
        or cos.shape != (1, max_len, 1, half)
        or sin.shape != cos.shape
        or 2 * half > dim
        or pos.numel() != 1
        or pos.dtype != torch.long
    ):
        raise ValueError(
            f"rope_cache: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} {dtype}, caches "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}, tables {tuple(cos.shape)}, style {style!r}: expected "
            f"one token's contiguous heads, caches of batch 1 and tables of their length, one dtype (bf16 or fp32)"
        )
    qo = torch.empty(1, hq, 1, dim, dtype=dtype, device=q.device)
    _launch(
        _rope_cache_kernel,
        (cdiv(hq + 2 * hk, ROPE_CACHE_HEADS),),
        (q, k, v, _out_arg(qo), _out_arg(k_cache), _out_arg(v_cache), cos, sin, pos, hq, hk, dim, dim_v, half)
        + (max_len * dim, max_len * dim_v),
        4,
        NEOX=style == "neox",
        BF16=dtype == torch.bfloat16,
        BLOCK_H=ROPE_CACHE_HEADS,
        BLOCK_D=next_pow2(max(dim, dim_v)),
    )
    return qo


__all__ = ["add_rms", "rope_cache"]
