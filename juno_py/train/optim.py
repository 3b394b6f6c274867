"""The optimizer and learning-rate schedule of adapter training.

AdamW (β 0.9/0.999, ε 1e-8, decoupled weight decay) over three parameter groups: A decays, B and the DoRA
magnitude never do, and B's learning rate is `plus_ratio` times the base rate (LoRA+). The schedule is a
factor of the step applied to every group's base rate.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("constant", "warmup-cosine")
BETAS = (0.9, 0.999)
EPS = 1e-8


def build_optimizer(adapters, lr: float, weight_decay: float = 0.01, plus_ratio: float = 1.0) -> torch.optim.AdamW:
    """AdamW over an AdapterSet's groups; each group remembers its `base_lr` for the schedule."""
    groups = adapters.param_groups()
    spec = [("A", lr, weight_decay), ("B", lr * plus_ratio, 0.0), ("magnitude", lr, 0.0)]
    param_groups = [{"name": name, "params": groups[name], "lr": rate, "base_lr": rate, "weight_decay": wd}
                    for name, rate, wd in spec if groups[name]]
    # CPU: foreach=False, the per-parameter loop is bit-identical from run to run and fast enough for adapters.
    # GPU: the fused kernel (deterministic too); a loop of small kernels per parameter would be launch-bound.
    if any(p.is_cuda for g in param_groups for p in g["params"]):
        return torch.optim.AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based).

    constant: 1 (after the linear warmup, if any). warmup-cosine: linear warmup from 1/warmup to 1 over
    `warmup_steps`, then a cosine from 1 down to `min_ratio` at the last step.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rates(optimizer: torch.optim.Optimizer, factor: float) -> dict[str, float]:
    """Apply the schedule's factor to every group; returns the rate of each group by name."""
    out = {}
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * factor
        out[g["name"]] = g["lr"]
    return out
