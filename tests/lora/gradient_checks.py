"""Finite-difference checks of adapter gradients, shared by the dense and the mixture-of-experts tests."""

from typing import Callable

import torch


def summed_loss(model, tokens, targets):
    """The model's summed cross-entropy, the output in chunks of 7 positions (not a divisor of the tests' lengths)."""
    return model.loss(tokens, targets, reduction="sum", chunk=7)


def directional_error(p: torch.Tensor, loss: Callable[[], torch.Tensor], g: torch.Generator, h: float = 1e-6):
    """(relative error, numeric, analytic) of p's gradient (`p.grad`, from a backward of `loss()`) along a random
    direction v: Σ grad·v against the central difference (loss(p + h·v) − loss(p − h·v)) / 2h. p is left as it was.
    Call under no_grad."""
    v = torch.randn(p.shape, generator=g, dtype=torch.float64)
    analytic = float((p.grad * v).sum())
    p.add_(h * v)
    up = float(loss())
    p.sub_(2 * h * v)
    down = float(loss())
    p.add_(h * v)
    numeric = (up - down) / (2 * h)
    return abs(numeric - analytic) / max(abs(analytic), 1e-8), numeric, analytic
