"""Eager torch references for the DoRA kernels: the fused Triton kernels (GPU issue) are checked against these."""

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


def norm_rows_eager(base_sq: torch.Tensor, B: torch.Tensor, U: torch.Tensor, V: torch.Tensor, s: float,
                    eps: float = 0.0) -> torch.Tensor:
    """max(‖W + sBA‖_row, eps) from ‖W‖²_row, B, U = W·Aᵀ and V = B·(A·Aᵀ) (all `[n, r]`):
    sqrt(max(‖W‖² + Σ_j B_ij·(2s·U_ij + s²·V_ij), 0)), in fp32 (or fp64 if the inputs are)."""
    dt = torch.promote_types(base_sq.dtype, torch.float32)
    total = base_sq.to(dt) + (B.to(dt) * ((2.0 * s) * U.to(dt) + (s * s) * V.to(dt))).sum(dim=1)
    return torch.sqrt(torch.clamp(total, min=0.0)).clamp_min(eps)
