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
from triton.language.extra.cuda import libdevice

from juno_py.kernels.dora_triton import FUSED_DTYPES, INTERPRETED, _launch, _out_arg, _store
from juno_py.kernels.elementwise_triton import _rms_rstd, _rms_warps, _rope_pairs
from juno_py.kernels.launch import cdiv, next_pow2
from juno_py.kernels.matvec_triton import _round_bf16

ROPE_CACHE_HEADS = 8  # heads (of q, k and v together) a rope_cache program
ADD_RMS_XA_ROWS = 1  # rows of a LoRA's A an add_rms program multiplies (each program normalizes the row again)


@triton.jit
def _as_stored(v, BF16: tl.constexpr):
    """fp32 `v` as `_store` would store it and a load read it back: rounded to bf16 (`matvec_triton._round_bf16`)
    when BF16, unchanged otherwise."""
    if BF16:
        return _round_bf16(v)
    else:
        return v


@triton.jit
def _rms_row(x, w, N, eps):
    """`_rms_fwd_kernel`'s product for one row held in registers: (x·rstd)·w with its rstd (`_rms_rstd`)."""
    return (x * _rms_rstd(x, N, eps)) * w


@triton.jit
def _add_rms_kernel(
    x_ptr,
    h_ptr,
    wpost_ptr,
    w_ptr,
    xo_ptr,
    y_ptr,
    a_ptr,
    xa_ptr,
    N,
    R,
    eps_post,
    eps,
    POST: tl.constexpr,
    BF16: tl.constexpr,
    RN_ADD: tl.constexpr,
    XA: tl.constexpr,
    RB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row `program_id` (XA: the one row, every program): h ← norm_post(h) when POST (stored value), s = x + h
    (stored value) into xo, y = norm(s). XA: program p also computes rows p·RB.. of xa = y · Aᵀ (A `[R, N]`, y as
    stored), each row's products summed as `matvec_triton.lora_xa_kernel` sums them, and only program 0 stores xo
    and y."""
    pid = tl.program_id(0)
    if XA:
        row = 0
    else:
        row = pid.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    if POST:
        wp = tl.load(wpost_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        h = _as_stored(_rms_row(h, wp, N, eps_post), BF16)
    # the sum rounded on its own, as torch adds the stored rows: on the GPU add_rn keeps the compiler from
    # contracting the post norm's last product into it (one fma: one rounding fewer than the unfused kernels); the
    # interpreter, which has no libdevice, never contracts
    if RN_ADD:
        s = _as_stored(libdevice.add_rn(x, h), BF16)
    else:
        s = _as_stored(x + h, BF16)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _rms_row(s, w, N, eps)
    if XA:
        first = cols < tl.where(pid == 0, N, 0)
    else:
        first = ok
    _store(xo_ptr + row * N + cols, s, first, BF16)
    _store(y_ptr + row * N + cols, y, first, BF16)
    if XA:
        r = pid * RB + tl.arange(0, RB)
        keep = r < R
        rc = tl.minimum(r, R - 1).to(tl.int64)[:, None]
        a = tl.load(a_ptr + rc * N + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        # the products into a zeroed accumulator, then summed: lora_xa_kernel's operations (the multiply is not
        # contracted into the sum's additions)
        acc = tl.zeros((RB, BLOCK), dtype=tl.float32)
        acc += a * _as_stored(y, BF16)[None, :]
        _store(xa_ptr + r, tl.sum(acc, axis=1), keep, BF16)


def add_rms(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    post: Optional[tuple[torch.Tensor, float]] = None,
    lora_a: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x + h, RMSNorm(x + h) · weight, xa) for x and h `[..., N]` of one dtype (bf16 or fp32; contiguous), the norm
    weight fp32 `[N]`; `post`: (weight, eps) of an RMSNorm applied to h first. New tensors in x's dtype. `lora_a`:
    the concatenated A `[R, N]` (x's dtype, contiguous) of LoRAs that read the normalized row (one row only): xa is
        its x·Aᵀ `[1, R]` from the same launch (None without `lora_a`): `dequant.lora_xa`'s bits where N ≤ 4096 (one
    step of its row; wider rows are summed in another order)."""
    n = x.shape[-1]
    rows = x.numel() // max(n, 1)
    if (
        x.dtype not in FUSED_DTYPES
        or h.dtype != x.dtype
        or h.shape != x.shape
        or not x.is_contiguous()
        or not h.is_contiguous()
        or weight.shape != (n,)
        or weight.dtype != torch.float32
        or (post is not None and (post[0].shape != (n,) or post[0].dtype != torch.float32))
        or (
            lora_a is not None
            and (
                rows != 1
                or lora_a.dim() != 2
                or lora_a.shape[1] != n
                or lora_a.dtype != x.dtype
                or not lora_a.is_contiguous()
            )
        )
    ):
        raise ValueError(
            f"add_rms: x {tuple(x.shape)} {x.dtype}, h {tuple(h.shape)} {h.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: expected contiguous x and h of one shape and dtype (bf16 or fp32), fp32 weights [{n}], "
            f"and for a LoRA A one row and A [R, {n}] in x's dtype"
        )
    xo = torch.empty_like(x)
    y = torch.empty_like(x)
    xa = None if lora_a is None else torch.empty(1, lora_a.shape[0], dtype=x.dtype, device=x.device)
    if rows:
        block = next_pow2(n)
        wpost, eps_post = post if post is not None else (weight, 0.0)
        a, r = (lora_a, lora_a.shape[0]) if lora_a is not None else (weight, 0)
        _launch(
            _add_rms_kernel,
            (cdiv(r, ADD_RMS_XA_ROWS) if lora_a is not None else rows,),
            (x, h, wpost, weight, _out_arg(xo), _out_arg(y), a, _out_arg(xa) if xa is not None else y, n, r)
            + (float(eps_post), float(eps)),
            _rms_warps(block),
            POST=post is not None,
            BF16=x.dtype == torch.bfloat16,
            RN_ADD=not INTERPRETED,
            XA=lora_a is not None,
            RB=ADD_RMS_XA_ROWS,
            BLOCK=block,
        )
    return xo, y, xa


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
    rot, first, partner, j = _rope_pairs(d, HALF, NEOX)
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


@triton.jit
def _attend_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    o_ptr,
    pos_ptr,
    window,
    scale,
    D,
    DV,
    GROUP,
    kc_head,
    vc_head,
    WINDOW: tl.constexpr,
    BF16: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Query head `program_id(0)` of one token at position `pos` over its key/value head's cache rows 0..pos (the last
    `window` of them when WINDOW): softmax(q·kᵀ·scale)·v with an online softmax over blocks of BLOCK_N keys, fp32.
    PARTIAL: the program takes only the rows of split `program_id(1)` (SPLIT_KEYS rows each) and writes its
    unnormalized sums [acc `[DV]`, running max, sum of exponentials] to o `[heads, splits, DV + 2]` (fp32) for
    `_attend_combine_kernel`; a split holding no row of the range writes zeros and a max of −inf."""
    hq = tl.program_id(0)
    hk = (hq // GROUP).to(tl.int64)
    pos = tl.load(pos_ptr)
    lo = 0
    if WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    hi = pos + 1
    if PARTIAL:
        split = tl.program_id(1)
        lo = tl.maximum(lo, split * SPLIT_KEYS)
        hi = tl.minimum(hi, (split + 1) * SPLIT_KEYS)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + hq * D + d, mask=d < D, other=0.0).to(tl.float32)
    m = tl.full((1,), float("-inf"), tl.float32)
    total = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = (n < hi) & (n >= lo)
        k = tl.load(
            kc_ptr + hk * kc_head + n[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0
        )
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        v = tl.load(
            vc_ptr + hk * vc_head + n[:, None] * DV + dv[None, :],
            mask=valid[:, None] & (dv < DV)[None, :],
            other=0.0,
        )
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    if PARTIAL:
        base = o_ptr + (hq * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * (DV + 2)
        tl.store(base + dv, acc, mask=dv < DV)
        one = tl.arange(0, 1)
        tl.store(base + DV + one, m)
        tl.store(base + DV + 1 + one, total)
    else:
        _store(o_ptr + hq * DV + dv, acc / total, dv < DV, BF16)


@triton.jit
def _attend_combine_kernel(
    part_ptr, o_ptr, DV, SPLITS, BF16: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr
):
    """Query head `program_id(0)`: the splits' sums [acc, max, total] `[SPLITS, DV + 2]` rescaled to their common max
    and added: Σ acc·e^(m − M) / Σ total·e^(m − M)."""
    hq = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    ok = sp < SPLITS
    base = part_ptr + hq * SPLITS * (DV + 2) + sp * (DV + 2)
    m = tl.load(base + DV, mask=ok, other=float("-inf"))
    total = tl.load(base + DV + 1, mask=ok, other=0.0)
    big = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
    acc = tl.load(base[:, None] + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(total * w, axis=0)
    _store(o_ptr + hq * DV + dv, out, dv < DV, BF16)


ATTEND_KEYS = 64  # keys an attend program takes a step
ATTEND_SPLIT_KEYS = 256  # a longer cache is split into ranges of this many rows, one program each, then combined


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One token's attention: q `[HQ·D]` (any shape of that size, contiguous) at position `pos` (a one-element long
    tensor on the device, read by the kernel) over the caches `[1, HK, max_len, D]` and `[1, HK, max_len, DV]` rows
    0..pos (the last `window` of them when window > 0), query head h reading key/value head h // (HQ / HK); returns
    `[HQ, DV]` in q's dtype. The keys after pos are never read: their rows may hold anything. A cache longer than
    `ATTEND_SPLIT_KEYS` rows is taken in ranges of that many, one program per query head and range (those past the
    position return at once), and a second launch combines them."""
    _, hk, max_len, dim = k_cache.shape
    dim_v = v_cache.shape[-1]
    hq = q.numel() // dim
    dtype = q.dtype
    if (
        dtype not in FUSED_DTYPES
        or {k_cache.dtype, v_cache.dtype} != {dtype}
        or q.numel() != hq * dim
        or hq % max(hk, 1)
        or not all(t.is_contiguous() for t in (q, k_cache, v_cache))
        or k_cache.shape[0] != 1
        or v_cache.shape[:3] != k_cache.shape[:3]
        or pos.numel() != 1
        or pos.dtype != torch.long
        or window < 0
    ):
        raise ValueError(
            f"attend: q {tuple(q.shape)} {dtype}, caches {tuple(k_cache.shape)} {k_cache.dtype} and "
            f"{tuple(v_cache.shape)} {v_cache.dtype}, window {window}: expected one token's contiguous query heads (a "
            f"multiple of the caches' heads), caches of batch 1 and one dtype (bf16 or fp32)"
        )
    out = torch.empty(hq, dim_v, dtype=dtype, device=q.device)
    splits = cdiv(max_len, ATTEND_SPLIT_KEYS)
    part = torch.empty(hq, splits, dim_v + 2, dtype=torch.float32, device=q.device) if splits > 1 else None
    _launch(
        _attend_kernel,
        (hq, splits),
        (q, k_cache, v_cache, part if part is not None else _out_arg(out), pos, int(window), float(scale), dim, dim_v)
        + (hq // hk, max_len * dim, max_len * dim_v),
        4,
        WINDOW=window > 0,
        BF16=dtype == torch.bfloat16,
        SPLIT_KEYS=ATTEND_SPLIT_KEYS,
        PARTIAL=part is not None,
        BLOCK_N=ATTEND_KEYS,
        BLOCK_D=next_pow2(dim),
        BLOCK_DV=next_pow2(dim_v),
    )
    if part is not None:
        _launch(
            _attend_combine_kernel,
            (hq,),
            (part, _out_arg(out), dim_v, splits),
            4,
            BF16=dtype == torch.bfloat16,
            BLOCK_S=next_pow2(splits),
            BLOCK_DV=next_pow2(dim_v),
        )
    return out


__all__ = ["add_rms", "rope_cache", "attend"]
