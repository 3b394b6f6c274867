"""GaLore's toy problem: one linear layer regressed onto a target of slowly decaying spectrum, trained by GaLore,
GaLore with a frozen projector, a low-rank product B·A or full AdamW (`benchmarks.galore_toy` runs the 256x256
problem; the GaLore tests a reduced one).

Target W* = U diag(σ) Vᵀ with σᵢ = i^(-1/2) and random orthogonal U, V; Gaussian inputs x, outputs W* x;
mean-squared error, weights starting at zero; error ‖W − W*‖²_F / ‖W*‖²_F.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from juno_py.train.galore import GaLoreAdamW, GaLoreConfig

METHODS = ("galore", "galore-frozen", "lora", "adamw")
LRS = (1e-3, 3e-3, 1e-2)


@dataclass
class Toy:
    w_star: torch.Tensor  # [d, d]
    x: torch.Tensor  # [n, d]
    y: torch.Tensor  # [n, d]

    def error(self, w: torch.Tensor) -> float:
        return float((w - self.w_star).square().sum() / self.w_star.square().sum())


def make_toy(d: int = 256, n: int = 8192, seed: int = 0) -> Toy:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    sigma = torch.arange(1, d + 1, dtype=torch.float64) ** -0.5
    w_star = ((u * sigma) @ v.T).float()
    x = torch.randn(n, d, generator=g)
    return Toy(w_star, x, x @ w_star.T)


def eckart_young_floor(d: int = 256, rank: int = 16) -> float:
    s2 = torch.arange(1, d + 1, dtype=torch.float64) ** -1.0
    return float(s2[rank:].sum() / s2.sum())


def train_toy(
    toy: Toy,
    method: str,
    lr: float,
    steps: int,
    rank: int = 16,
    gap: int = 50,
    scale: float = 0.25,
    svd: str = "exact",
    batch: int = 256,
    seed: int = 0,
) -> list[tuple[int, float]]:
    """Train one method; returns (step, error) every 100 steps and at the end."""
    d = toy.w_star.shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    if method == "lora":
        b = torch.nn.Parameter(torch.zeros(d, rank))
        a = torch.nn.Parameter(torch.randn(rank, d, generator=g) / math.sqrt(d))
        params, weight = [a, b], lambda: b @ a
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    else:
        w = torch.nn.Parameter(torch.zeros(d, d))
        params, weight = [w], lambda: w
        if method == "adamw":
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        else:
            never = method == "galore-frozen"
            cfg = GaLoreConfig(rank=rank, update_gap=steps + 1 if never else gap, scale=scale, svd=svd, stagger=False)
            opt = GaLoreAdamW([("w", w)], lr, 0.0, cfg, seed=seed)
    n = toy.x.shape[0]
    order = torch.randperm(n, generator=g)
    curve = []
    for step in range(steps):
        lo = (step * batch) % n
        if lo == 0 and step:
            order = torch.randperm(n, generator=g)
        idx = order[lo : lo + batch]
        loss = (toy.x[idx] @ weight().T - toy.y[idx]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            with torch.no_grad():
                curve.append((step + 1, toy.error(weight())))
    return curve


def best_of(toy: Toy, method: str, steps: int, lrs=LRS, **kw) -> tuple[float, list[tuple[int, float]], dict]:
    """The learning rate with the lowest final error, its curve, and every rate's final error."""
    finals, curves = {}, {}
    for lr in lrs:
        curves[lr] = train_toy(toy, method, lr, steps, **kw)
        finals[lr] = curves[lr][-1][1]
    best = min(finals, key=lambda k: finals[k] if math.isfinite(finals[k]) else math.inf)
    return best, curves[best], finals
