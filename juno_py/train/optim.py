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


def build_optimizer(adapters, lr: float, weight_decay: float = 0.01, plus_ratio: float = 1.0):
    """AdamW over an AdapterSet's groups; each group remembers its `base_lr` for the schedule."""
    groups = adapters.param_groups()
    spec = [("A", lr, weight_decay), ("B", lr * plus_ratio, 0.0), ("magnitude", lr, 0.0)]
    param_groups = [{"name": name, "params": groups[name], "lr": rate, "base_lr": rate, "weight_decay": wd}
                    for name, rate, wd in spec if groups[name]]
    # CPU: foreach=False, the per-parameter loop is bit-identical from run to run and fast enough for adapters.
    # GPU: the fused kernel (deterministic too); a loop of small kernels per parameter would be launch-bound.
    if any(p.is_cuda for g in param_groups for p in g["params"]):
        return torch.optim.AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, fused=True)
    return AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)


class AdamW:
    """torch.optim.AdamW with `foreach=False` (its single-tensor arithmetic, step for step the same bits) for the
    adapters on a CPU, without torch.optim.Optimizer: that class's first `add_param_group` imports torch._dynamo
    (about 900 modules with sympy: 145 MiB of resident memory, a third of what training SmolLM2-135M holds, and
    about a second of start-up). The interface is the part the trainer uses: `param_groups` (dicts with "params",
    "lr", "betas", "eps", "weight_decay" and the caller's keys), `state` (per parameter "step", a float32 tensor,
    "exp_avg", "exp_avg_sq"), `defaults`, `step()` and `zero_grad()`."""

    def __init__(self, param_groups, lr: float, betas: tuple[float, float] = BETAS, eps: float = EPS,
                 weight_decay: float = 0.01):
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "fused": False,
                         "foreach": False}
        groups = list(param_groups)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                st = self.state.get(p)
                if not st:
                    st = self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
                st["step"] += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = st["step"].item()
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()


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


def set_learning_rates(optimizer, factor: float) -> dict[str, float]:
    """Apply the schedule's factor to every group; returns the rate of each group by name."""
    out = {}
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * factor
        out[g["name"]] = g["lr"]
    return out
