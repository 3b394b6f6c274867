"""Eager torch references for the fused Triton kernels (DoRA composition and norm, the loss chunk's cross-entropy):
the kernels are checked against these, and these run where the kernels do not (CPU, fp64, no triton)."""

from __future__ import annotations

import torch


def compose_eager(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
    """y = g ⊙ (base + s·lora), with g broadcast over the last dimension.

    The arithmetic runs in fp32 whatever the inputs: g lies within about 1e-3 of 1, where bf16 rounding
    would erase the adapter's effect. Autograd gives d_base = g·dy, d_lora = g·s·dy, d_g = Σ inner·dy.
    """
    acc = torch.float64 if torch.float64 in (base.dtype, lora.dtype, g.dtype) else torch.float32
    inner = base.to(acc) + s * lora.to(acc)
    return (g.to(acc) * inner).to(base.dtype if base.dtype != torch.float32 else acc)


def norm_assemble_eager(base_sq: torch.Tensor, cross: torch.Tensor, ba_sq: torch.Tensor, s: float) -> torch.Tensor:
    """‖W + sBA‖_row = sqrt(max(‖W‖² + 2s·cross + s²·‖BA‖², 0)) in fp32 (or fp64 if the inputs are)."""
    dt = torch.promote_types(base_sq.dtype, torch.float32)
    total = base_sq.to(dt) + (2.0 * s) * cross.to(dt) + (s * s) * ba_sq.to(dt)
    return torch.sqrt(torch.clamp(total, min=0.0))


def norm_rows_eager(
    base_sq: torch.Tensor, B: torch.Tensor, U: torch.Tensor, V: torch.Tensor | None, s: float, eps: float = 0.0
) -> torch.Tensor:
    """max(‖W + sBA‖_row, eps) from ‖W‖²_row, B, U = W·Aᵀ and V = B·(A·Aᵀ) (all `[n, r]`):
    sqrt(max(‖W‖² + Σ_j B_ij·(2s·U_ij + s²·V_ij), 0)), in fp32 (or fp64 if the inputs are). V None: no s² term
    (the caller folded it into U)."""
    dt = torch.promote_types(base_sq.dtype, torch.float32)
    inner = (2.0 * s) * U.to(dt) if V is None else (2.0 * s) * U.to(dt) + (s * s) * V.to(dt)
    total = base_sq.to(dt) + (B.to(dt) * inner).sum(dim=1)
    return torch.sqrt(torch.clamp(total, min=0.0)).clamp_min(eps)


def norm_rows_gram_eager(
    base_sq: torch.Tensor,
    B: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    s: float,
    eps: float = 0.0,
    split: bool = False,
) -> torch.Tensor:
    """`norm_rows_eager` with V = B·G: G = A·Aᵀ `[r, r]`, or with `split` the half Gram matrix
    P = [A_hi; A_lo]·A_hiᵀ `[2r, r]` of the split A, G = P_top + P_bot + P_botᵀ. fp32 (or fp64 if the inputs are)."""
    dt = torch.promote_types(base_sq.dtype, torch.float32)
    r = B.shape[1]
    G = G.to(dt)
    if split:
        G = G[:r] + G[r:] + G[r:].T
    return norm_rows_eager(base_sq, B, U, B.to(dt) @ G, s, eps)


def cross_entropy_grad_eager(
    z: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, ∂loss/∂z in z's dtype) of logits z `[n, V]` and int64 targets `[n]` (ignore_index: no loss).

    With m = max z per row: loss = Σ_rows m + log Σ exp(z − m) − z_t, ∂loss/∂z = softmax(z) − onehot(t), zero on
    ignored rows. Arithmetic in fp32 (fp64 for fp64 z). `in_place`: the gradient is written into z's buffer (fp32 and
    fp64 z are worked on in place; other dtypes in an fp32 copy, copied back); else z is left as it is."""
    if z.dtype in (torch.float32, torch.float64):
        work = z if in_place else z.clone()
    else:
        work = z.float()  # a buffer of its own
    # masked rows instead of indexing the valid ones: no data-dependent shape, so nothing waits for the device
    # (and a CUDA graph can capture it); the gradient's arithmetic is the same, value for value
    valid = (targets != ignore_index).unsqueeze(1)
    at = torch.where(valid, targets.unsqueeze(1), 0)
    target = work.gather(1, at)
    m = work.amax(dim=1, keepdim=True)
    work.sub_(m).exp_()
    total = work.sum(dim=1, keepdim=True)
    loss = torch.where(valid, m + total.log() - target, 0).sum()
    work.div_(total)
    work.scatter_add_(1, at, valid.to(work.dtype).neg_())
    work.masked_fill_(~valid, 0)
    if work.dtype == z.dtype:
        return loss, work
    return loss, z.copy_(work) if in_place else work.to(z.dtype)


# the running maximum's start: the lowest finite fp32 value (not -inf, so exp(start − start) = 1 and no NaN arises
# on a row that has seen nothing yet)
LOWEST = -3.4028234663852886e38


def online_tile_eager(
    z: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    state: tuple[torch.Tensor, ...],
    ignore_index: int = -100,
    cap: float = 0.0,
) -> None:
    """One tile of a vocabulary-tiled cross-entropy: logits z `[n, R]` of vocabulary rows `[start, start + R)` fold
    into each row's running state, and z is overwritten with what the gradient's product needs.

    state: (m, s, other, z_t, d_t, scale), each `[n]` in fp32 (fp64 for fp64 z), started as (LOWEST, 0, 0, 0, 1, 1).
    With c = cap·tanh(z/cap) (c = z without a cap) and m' = max(m, max c): s ← s·e^(m−m') + Σ_j e^(c_j−m'),
    other the same sum without the target's term, scale = e^(m−m'), m ← m'; z_t and d_t take the target's c and
    dc/dz where the target falls in this tile. z becomes e^(c_j−m')·dc_j/dz_j with 0 at the target's column and on
    ignored rows. After the last tile: loss = m + log s − z_t, and ∂loss/∂x = acc/s − (other/s)·d_t·W[t] where acc
    is Σ over tiles of z·W_tile, rescaled by each tile's `scale` before the tile's product is added."""
    m, s, other, zt, dt, scale = state
    acc = m.dtype
    c = z.to(acc)
    d = None
    if cap > 0:  # tanh and its slope 1 − tanh² from e = exp(−2|u|), the slope free of cancellation near ±1
        u = c / cap
        e2 = torch.exp(-2 * u.abs())
        c, d = torch.copysign((1 - e2) / (1 + e2), u) * cap, 4 * e2 / (1 + e2).square()
    n, R = z.shape
    valid = targets != ignore_index
    inside = valid & (targets >= start) & (targets < start + R)
    col = torch.where(inside, targets - start, 0).unsqueeze(1)
    m_new = torch.maximum(m, torch.where(valid, c.amax(dim=1) if R else m, m))
    e = torch.where(valid.unsqueeze(1), torch.exp(c - m_new.unsqueeze(1)), 0)
    e_t = torch.where(inside, e.gather(1, col).squeeze(1), 0)
    e.scatter_(1, col, torch.where(inside.unsqueeze(1), 0, e.gather(1, col)))
    summed = e.sum(dim=1)
    sc = torch.exp(m - m_new)
    s.mul_(sc).add_(summed + e_t)
    other.mul_(sc).add_(summed)
    m.copy_(m_new)
    scale.copy_(sc)
    zt.copy_(torch.where(inside, c.gather(1, col).squeeze(1), zt))
    if d is not None:
        dt.copy_(torch.where(inside, d.gather(1, col).squeeze(1), dt))
        e.mul_(d)
    z.copy_(e)
