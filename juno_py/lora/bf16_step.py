"""One LoRA layer's training step on a CPU streaming base with bf16 compute, as one autograd node.

`y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` with fp32 activations and fp32 master A and B, every product in bf16 (as under
`torch.autocast("cpu", bfloat16)`, and as the base's own products already are). Left to autograd, the same layer
casts x to bf16 inside the base and again for nothing (the adapter's products ran in fp32, whose skinny GEMMs run at
a fifth of bf16's rate here), keeps x in fp32 for A's gradient, and sums the base's and the adapter's input
gradients in one more pass. Here x and the output gradient are cast once each and shared by the base and the
adapter, x is kept in bf16 (half the bytes), and the adapter's input gradient is added into the base's in place.

`applies` says where this runs: a training step (a gradient wanted), one LoRA without dropout, a streaming base
whose products run in bf16 for this input, fp32 activations. Everything else keeps the composed ops.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.autograd.function import once_differentiable

from juno_py.weights.streaming import StreamingQuantLinear


def applies(base: Any, x: torch.Tensor, dropout: float) -> bool:
    """Whether `LoraBf16Fn` runs the step of one LoRA on `base` for input `x`."""
    if not (torch.is_grad_enabled() and isinstance(base, StreamingQuantLinear)) or dropout > 0:
        return False
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != base.in_features:
        return False
    tokens = x.numel() // max(x.shape[-1], 1)
    return base._matmul_dtype(x, tokens) == torch.bfloat16


class LoraBf16Fn(torch.autograd.Function):
    """`y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` (no bias): forward and backward with bf16 products, fp32 outputs and gradients."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, base: StreamingQuantLinear, s: float
    ) -> torch.Tensor:
        shape = x.shape
        xb = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        Ab, Bb = A.detach().to(torch.bfloat16), B.detach().to(torch.bfloat16)
        y = base._forward_product(xb)  # fp32 [tokens, d_out]; the base's own cast of xb is a no-op
        xa = xb @ Ab.T  # [tokens, r]
        y.add_(xa @ Bb.T, alpha=s)
        ctx.save_for_backward(xb, xa, Ab, Bb)
        ctx.base, ctx.s, ctx.shape = base, s, shape
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        xb, xa, Ab, Bb = ctx.saved_tensors
        s = ctx.s
        gb = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        g_xa = gb @ Bb  # [tokens, r]: the output gradient through B
        dA = dB = dx = None
        if ctx.needs_input_grad[2]:
            dB = (gb.T @ xa).float().mul_(s)
        if ctx.needs_input_grad[1]:
            dA = (g_xa.T @ xb).float().mul_(s)
        if ctx.needs_input_grad[0]:
            dx = ctx.base._transpose_product(gb)  # fp32 [tokens, d_in]
            dx.add_(g_xa @ Ab, alpha=s)
            dx = dx.reshape(ctx.shape)
        return dx, dA, dB, None, None


__all__ = ["LoraBf16Fn", "applies"]
