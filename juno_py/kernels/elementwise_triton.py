"""Fused Triton kernels for a decoder block's elementwise work, each forward and backward in one launch, with the
autograd Functions that run them: RMSNorm (`RMSNormFn`), the gated activations SwiGLU and GeGLU-tanh
(`GatedFn`), and RoPE on q and k together (`RopeQKFn`).

Their eager references are the model's own code (`juno_py.models.model`: `RMSNorm`, `GatedActivation`,
`apply_rope`); `juno_py.kernels.elementwise` chooses between the two. Inputs are bf16 or fp32, all arithmetic is
fp32 and each result is rounded once to its dtype (bf16 with integer round-to-nearest-even, `dora_triton._store`,
so Triton's interpreter writes the bits the GPU writes). Eager bf16 rounds every intermediate instead: the fused
results are at least as close to the exact values. What backward keeps: RMSNorm its input and one fp32 rstd per row
(the normalized row is recomputed), the gated activations their two inputs (the activation is recomputed), RoPE
only the cos/sin tables it was given (the backward is the rotation by −θ).

Imported only when a fused path runs (it imports triton; `@triton.jit` reads TRITON_INTERPRET when it runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from juno_py.kernels.dora_triton import FUSED_DTYPES, INTERPRETED, _launch, _out_arg, _store
from juno_py.kernels.launch import cdiv, next_pow2, row_warps

ELEMENTWISE_BLOCK = 1024  # elements a program of the gated activations
ROPE_HEADS = 8  # heads (of q and k together) a RoPE program
GELU_K = 0.7978845608028654  # sqrt(2/π)
GELU_C = 0.044715
# the same as compile-time constants: a compiled @triton.jit function may read only constexpr globals
_GELU_K = tl.constexpr(GELU_K)
_GELU_C = tl.constexpr(GELU_C)
ACTIVATIONS = ("silu", "gelu_tanh")


# --- RMSNorm ---------------------------------------------------------------------------------------------------
@triton.jit
def _rms_rstd(x, N, eps):
    """1/sqrt(mean(x²) + eps) of a row `x` (fp32, zeros past N), correctly rounded: the RMSNorm kernels' scale,
    shared so that a fused kernel normalizes with these operations (`decode_triton.add_rms`)."""
    ms = tl.sum(x * x, axis=0) / N
    return tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride_x, eps, Y_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Row `program_id`: rstd = 1/sqrt(mean(x²) + eps), y = (x·rstd)·w, fp32; rstd saved for backward."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = _rms_rstd(x, N, eps)
    tl.store(rstd_ptr + row, rstd)
    _store(y_ptr + row * N + cols, (x * rstd) * w, ok, Y_BF16)


@triton.jit
def _rms_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, N, stride_x, stride_dy, DX_BF16: tl.constexpr, BLOCK: tl.constexpr
):
    """Row `program_id`: dx = rstd·(w·dy − x̂·mean(w·dy·x̂)) with x̂ = x·rstd, fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    xhat = x * rstd
    wdy = w * dy
    c = tl.sum(wdy * xhat, axis=0) / N
    _store(dx_ptr + row * N + cols, rstd * (wdy - xhat * c), ok, DX_BF16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[rows, N]` with unit column stride (a copy only where x's last dimension is not contiguous)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _rms_warps(block: int) -> int:
    return row_warps(block)


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in `out_dtype` shaped like x, rstd fp32 `[rows]`) of x `[..., N]` over its last dimension."""
    n = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        block = next_pow2(n)
        _launch(
            _rms_fwd_kernel,
            (x2.shape[0],),
            (x2, weight, _out_arg(y), rstd, n, x2.stride(0), float(eps)),
            _rms_warps(block),
            Y_BF16=out_dtype == torch.bfloat16,
            BLOCK=block,
        )
    return y.view(x.shape), rstd


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx in x's dtype and shape."""
    n = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = next_pow2(n)
        _launch(
            _rms_bwd_kernel,
            (x2.shape[0],),
            (x2, weight, dy2, rstd, _out_arg(dx), n, x2.stride(0), dy2.stride(0)),
            _rms_warps(block),
            DX_BF16=x.dtype == torch.bfloat16,
            BLOCK=block,
        )
    return dx.view(x.shape)


class RMSNormFn(torch.autograd.Function):
    """`(x / rms(x)) · weight` over the last dimension in fp32, result in `out_dtype`; the gradient reaches x only
    (the norm weights are frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        y, rstd = rms_norm_forward(x, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        return rms_norm_backward(x, weight, rstd, dy), None, None, None


# --- gated activations -----------------------------------------------------------------------------------------
@triton.jit
def _gate_sigmoid(g, GELU: tl.constexpr):
    """(σ(v), dv/dg) with v = g for silu (silu(g) = g·σ(g)) and v = 2k(g + c·g³) for gelu_tanh, whose
    ½(1 + tanh(v/2)) is σ(v): gelu_tanh(g) = g·σ(v) without tanh's cancellation near −1."""
    if GELU:
        v = 2.0 * _GELU_K * (g + _GELU_C * g * g * g)
        dv = 2.0 * _GELU_K * (1.0 + 3.0 * _GELU_C * g * g)
    else:
        v = g
        dv = tl.full(g.shape, 1.0, tl.float32)
    return 1.0 / (1.0 + tl.exp(-v)), dv


@triton.jit
def _gated_fwd_kernel(g_ptr, u_ptr, y_ptr, n, GELU: tl.constexpr, Y_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """y = act(g)·u = g·σ(v)·u."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sig, _ = _gate_sigmoid(g, GELU)
    _store(y_ptr + offs, (g * sig) * u, ok, Y_BF16)


@triton.jit
def _gated_bwd_kernel(
    g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, GELU: tl.constexpr, D_BF16: tl.constexpr, BLOCK: tl.constexpr
):
    """du = dy·act(g), dg = dy·u·act'(g), the activation recomputed: act' = σ(v) + g·σ(v)(1 − σ(v))·dv/dg (silu:
    σ(g)(1 + g(1 − σ(g))))."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sig, dv = _gate_sigmoid(g, GELU)
    da = sig + g * sig * (1.0 - sig) * dv
    _store(du_ptr + offs, dy * (g * sig), ok, D_BF16)
    _store(dg_ptr + offs, (dy * u) * da, ok, D_BF16)


def _check_gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"fused gated activation: {act!r}: expected one of {', '.join(ACTIVATIONS)}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in FUSED_DTYPES:
        raise ValueError(
            f"fused gated activation: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype}: "
            f"expected two float32 or bfloat16 tensors of one shape and dtype"
        )


def gated_forward(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate)·up in gate's dtype."""
    _check_gated(gate, up, act)
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _launch(
            _gated_fwd_kernel,
            (cdiv(n, ELEMENTWISE_BLOCK),),
            (gate, up, _out_arg(y), n),
            4,
            GELU=act == "gelu_tanh",
            Y_BF16=y.dtype == torch.bfloat16,
            BLOCK=ELEMENTWISE_BLOCK,
        )
    return y


def gated_backward(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, act: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in gate's dtype, in one pass."""
    _check_gated(gate, up, act)
    gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    n = gate.numel()
    if n:
        _launch(
            _gated_bwd_kernel,
            (cdiv(n, ELEMENTWISE_BLOCK),),
            (gate, up, dy, _out_arg(dg), _out_arg(du), n),
            4,
            GELU=act == "gelu_tanh",
            D_BF16=dg.dtype == torch.bfloat16,
            BLOCK=ELEMENTWISE_BLOCK,
        )
    return dg, du


class GatedFn(torch.autograd.Function):
    """`act(gate)·up` ("silu" or "gelu_tanh") keeping gate and up for backward, which recomputes act(gate)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return gated_forward(gate, up, act)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dg, du = gated_backward(gate, up, dy, ctx.act)
        return dg, du, None


# --- RoPE ------------------------------------------------------------------------------------------------------
@triton.jit
def _rope_pairs(d, HALF, NEOX: tl.constexpr):
    """For features d: (rotated: d < 2·HALF, first of its pair, its partner p, its pair's angle j) in the "neox"
    halves (p = d ± HALF) or the "norm" adjacent pairs (p = d ^ 1); features past the rotated ones are their own
    partner at angle 0. The RoPE kernels' table (`decode_triton` rotates with it too)."""
    rot = d < 2 * HALF
    if NEOX:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        j = tl.where(first, d, d - HALF)
    else:
        first = (d % 2) == 0
        partner = d ^ 1
        j = d // 2
    return rot, first, tl.where(rot, partner, d), tl.where(rot, j, 0)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    oq_ptr,
    ok_ptr,
    cos_ptr,
    sin_ptr,
    T,
    HQ,
    HK,
    D,
    HALF,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_t,
    sk_h,
    sc_b,
    sc_t,
    NEOX: tl.constexpr,
    INVERSE: tl.constexpr,
    O_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Token `program_id(0)` (b = tok // T, t = tok % T), heads `program_id(1)`·BLOCK_H.. of q's HQ heads then k's
    HK: each of the first 2·HALF features x_d becomes x_d·cos_j ∓ x_p·sin_j with p its partner in the pair (d ^ 1,
    "norm" style; d ± HALF, "neox") and j the pair's angle, minus for the pair's first; the rest pass through.
    INVERSE: sin negated (the rotation by −θ, the backward). Outputs are contiguous `[tokens, heads, D]`."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // T
    t = tok % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    rot, first, partner, j = _rope_pairs(d, HALF, NEOX)
    in_d = d < D
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HK)
    hk = tl.where(is_k, h - HQ, 0)
    mq = is_q & in_d
    mk = is_k & in_d
    q_row = q_ptr + b * sq_b + t * sq_t + h * sq_h
    k_row = k_ptr + b * sk_b + t * sk_t + hk * sk_h
    x = tl.where(
        is_q,
        tl.load(q_row + d, mask=mq, other=0.0).to(tl.float32),
        tl.load(k_row + d, mask=mk, other=0.0).to(tl.float32),
    )
    xp = tl.where(
        is_q,
        tl.load(q_row + partner, mask=mq & rot, other=0.0).to(tl.float32),
        tl.load(k_row + partner, mask=mk & rot, other=0.0).to(tl.float32),
    )
    c = tl.load(cos_ptr + b * sc_b + t * sc_t + j, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + b * sc_b + t * sc_t + j, mask=rot, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    s = tl.where(first, -s, s)
    y = tl.where(rot, x * c + xp * s, x)
    _store(oq_ptr + (tok * HQ + h) * D + d, y, mq, O_BF16)
    _store(ok_ptr + (tok * HK + hk) * D + d, y, mk, O_BF16)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x `[B, T, H, D]` with a unit feature stride (any other strides: attention's gradients come head-major)."""
    return x if x.stride(3) == 1 else x.contiguous()


def _table(c: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """cos or sin `[B|1, T, 1, half]` as `[B, T, half]` with a unit last stride (batch stride 0 where broadcast)."""
    c = c.squeeze(2)
    if c.stride(-1) != 1:
        c = c.contiguous()
    return c.expand(b, t, c.shape[-1])


def rope_apply(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[B, T, HQ, D]` and k `[B, T, HK, D]` rotated in one launch (`inverse`: by −θ), new contiguous tensors in
    their dtype; cos, sin `[B, T, 1, rope_dim/2]` (or batch 1) as `models.model.rope_cos_sin` gives them."""
    if style not in ("norm", "neox"):
        raise ValueError(f"fused RoPE: style {style!r}: expected 'norm' or 'neox'")
    if q.dtype != k.dtype or q.dtype not in FUSED_DTYPES or q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"fused RoPE: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype}: expected two 4-D "
            f"[batch, tokens, heads, head_dim] float32 or bfloat16 tensors of one dtype"
        )
    b, t, hq, dim = q.shape
    hk = k.shape[2]
    half = cos.shape[-1]
    if k.shape[:2] != (b, t) or k.shape[3] != dim or 2 * half > dim or cos.shape != sin.shape:
        raise ValueError(
            f"fused RoPE: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: "
            f"expected q and k of one batch, length and head_dim, and tables of at most head_dim/2 angles"
        )
    q, k = _heads(q), _heads(k)
    cs, sn = _table(cos, b, t), _table(sin, b, t)
    if cs.stride() != sn.stride():
        cs, sn = cs.contiguous(), sn.contiguous()
    oq = torch.empty(b, t, hq, dim, dtype=q.dtype, device=q.device)
    ok = torch.empty(b, t, hk, dim, dtype=k.dtype, device=k.device)
    if b * t and hq + hk:
        _launch(
            _rope_kernel,
            (b * t, cdiv(hq + hk, ROPE_HEADS)),
            (q, k, _out_arg(oq), _out_arg(ok), cs, sn, t, hq, hk, dim, half)
            + (*q.stride()[:3], *k.stride()[:3], cs.stride(0), cs.stride(1)),
            4,
            NEOX=style == "neox",
            INVERSE=inverse,
            O_BF16=q.dtype == torch.bfloat16,
            BLOCK_H=ROPE_HEADS,
            BLOCK_D=next_pow2(dim),
        )
    return oq, ok


class RopeQKFn(torch.autograd.Function):
    """q and k rotated by RoPE in one launch; backward rotates their gradients back by −θ in one launch. The tables
    take no gradient (they come from positions)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str):
        ctx.style = style
        ctx.save_for_backward(cos, sin)
        return rope_apply(q, k, cos, sin, style)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        gq, gk = rope_apply(dq, dk, cos, sin, ctx.style, inverse=True)
        return gq, gk, None, None, None


__all__ = [
    "RMSNormFn",
    "GatedFn",
    "RopeQKFn",
    "rms_norm_forward",
    "rms_norm_backward",
    "gated_forward",
    "gated_backward",
    "rope_apply",
    "INTERPRETED",
    "ACTIVATIONS",
]
