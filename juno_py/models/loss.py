"""Cross-entropy over a vocabulary without ever holding `[tokens, vocab]` logits for a whole batch.

The output projection runs on `chunk` positions at a time. When the hidden states need a gradient, each
chunk's gradient is computed right away (the logits of a chunk live only inside its iteration) and kept, the
size of the hidden states; backward only scales it. The projection must hold no trainable parameters (the
output layer and final norm are frozen): their gradients would not be computed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _chunk_loss(project: Callable[[Tensor], Tensor], h: Tensor, t: Tensor, ignore_index: int) -> Tensor:
    logits = project(h)
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, targets: Tensor, project, chunk: int, ignore_index: int) -> Tensor:
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for i in range(0, hidden.shape[0], chunk):
            h, t = hidden[i:i + chunk], targets[i:i + chunk]
            if grad is None:
                total += _chunk_loss(project, h, t, ignore_index)
                continue
            with torch.enable_grad():
                h = h.detach().requires_grad_(True)
                loss = _chunk_loss(project, h, t, ignore_index)
                (g,) = torch.autograd.grad(loss, h)
            grad[i:i + chunk] = g
            total += loss.detach()
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None


def chunked_cross_entropy(hidden: Tensor, targets: Tensor, project: Callable[[Tensor], Tensor], chunk: int = 1024,
                          ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Cross-entropy of `targets` under `project(hidden)` logits, `chunk` positions at a time.

    hidden `[..., D]`, targets `[...]` (positions equal to `ignore_index` carry no loss). `reduction`: "sum", or
    "mean" over the supervised positions (0 when there are none).
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction is {reduction!r}: expected 'sum' or 'mean'")
    if chunk < 1:
        raise ValueError(f"chunk is {chunk}: expected a positive number of positions")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {hidden.shape[0]} hidden states")
    total = _ChunkedCrossEntropy.apply(hidden, targets, project, chunk, ignore_index)
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)
