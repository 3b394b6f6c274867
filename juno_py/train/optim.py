"""The optimizer and learning-rate schedule of training.

AdamW (β 0.9/0.999, ε 1e-8, decoupled weight decay) over the trainable's parameter groups (`Trainable.param_groups`:
for adapters A decays, B and the DoRA magnitude never do, and B's learning rate is `plus_ratio` times the base rate,
LoRA+). The schedule is a factor of the step applied to every group's base rate.

`TrainOptimizer` is what the training loop asks of an optimizer: torch's `param_groups`, `step()` and `zero_grad()`,
and the abilities below with an Adam optimizer's defaults, which an optimizer of another kind (GaLore) overrides:
`updates_in_backward`, `grad_norm(params)`, `state_tensors(names)` and `load_state_tensors(...)` for the resume state.
A torch optimizer passed to the loop as it is runs through `TorchOptimizer`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from juno_py.train.state import StateError

SCHEDULES = ("constant", "warmup-cosine")
BETAS = (0.9, 0.999)
EPS = 1e-8


def grad_norm(params: Sequence[torch.Tensor]) -> float:
    """Global L2 norm of the gradients. On the CPU each gradient's norm accumulates in fp64. On a GPU every norm
    comes from one multi-tensor launch (`torch._foreach_norm`), summed there and read once: a reduction launch per
    parameter took 15 ms of an 8B-shaped LoRA step's 290 (448 adapter tensors), and one read per parameter would
    wait for the device hundreds of times a step."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and grads[0].device.type != "cpu":
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        return math.sqrt(float(torch.stack(norms).square().sum()))
    # vector_norm accumulates in fp64 without an fp64 copy of the gradient (5x faster on the CPU than
    # g.double().square().sum(): it matters for full training's 106M-value gradients)
    return math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads))


class TrainOptimizer:
    """What the training loop asks of an optimizer beyond torch's `param_groups`, `step()` and `zero_grad()` (which a
    subclass provides, its own or torch's), with the defaults of an Adam optimizer whose `state` holds per parameter
    "step", "exp_avg" and "exp_avg_sq" and whose `defaults` say whether it is "fused"."""

    param_groups: list[dict[str, Any]]
    state: Any
    defaults: dict[str, Any]

    @property
    def updates_in_backward(self) -> bool:
        """Whether the weights change during backward, before the loop sees the step's gradient norm."""
        return False

    def grad_norm(self, params: Sequence[torch.Tensor]) -> float:
        """The step's global gradient norm."""
        return grad_norm(params)

    def state_bytes(self, params: Sequence[torch.Tensor]) -> int:
        """About how many bytes `state_tensors` will hold once every parameter has stepped (Adam: two moments of
        each parameter's size), for the disk space reserved before the first step."""
        return sum(2 * p.numel() * p.element_size() for p in params)

    def state_tensors(self, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The optimizer's state for the resume file: tensors keyed by parameter name (Adam's moments), and a JSON
        document (the step count of each parameter)."""
        tensors, steps = {}, {}
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                name = names[id(p)]
                tensors[f"adam/{name}/exp_avg"] = st["exp_avg"]
                tensors[f"adam/{name}/exp_avg_sq"] = st["exp_avg_sq"]
                steps[name] = float(st["step"])
        return tensors, steps

    def load_state_tensors(
        self, names: dict[int, str], tensors: dict[str, torch.Tensor], steps: dict[str, Any], where: str
    ) -> None:
        """Restore what `state_tensors` gave; StateError naming `where` when it does not fit the parameters."""
        for group in self.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                if name not in steps:
                    continue
                try:
                    m, v = tensors[f"adam/{name}/exp_avg"], tensors[f"adam/{name}/exp_avg_sq"]
                except KeyError:
                    raise StateError(f"{where}: Adam moments of {name!r} are missing") from None
                if m.shape != p.shape or v.shape != p.shape:
                    raise StateError(
                        f"{where}: Adam moments of {name!r} have shape {tuple(m.shape)}, the parameter {tuple(p.shape)}"
                    )
                # the fused (GPU) AdamW keeps its step counts on the parameters' device
                step_device = p.device if self.defaults.get("fused") else None
                self.state[p] = {
                    "step": torch.tensor(steps[name], dtype=torch.float32, device=step_device),
                    "exp_avg": m.clone().to(p.device),
                    "exp_avg_sq": v.clone().to(p.device),
                }


class TorchOptimizer(TrainOptimizer):
    """A torch optimizer with Adam's state (torch.optim.AdamW, fused or not) as a `TrainOptimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def as_train_optimizer(optimizer: "TrainOptimizer | torch.optim.Optimizer") -> TrainOptimizer:
    """`optimizer` itself when it is a TrainOptimizer, else the torch optimizer in a `TorchOptimizer`."""
    return optimizer if isinstance(optimizer, TrainOptimizer) else TorchOptimizer(optimizer)


def build_optimizer(trainable, lr: float, weight_decay: float = 0.01, plus_ratio: float = 1.0) -> TrainOptimizer:
    """AdamW over the trainable's groups (`Trainable.param_groups`); each group remembers its `base_lr` for the
    schedule."""
    param_groups = trainable.param_groups(lr, weight_decay, plus_ratio)
    # CPU: foreach=False, the per-parameter loop is bit-identical from run to run and fast enough for adapters.
    # GPU: the fused kernel (deterministic too); a loop of small kernels per parameter would be launch-bound.
    if any(p.is_cuda for g in param_groups for p in g["params"]):
        return TorchOptimizer(
            torch.optim.AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, fused=True)
        )
    return AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)


class AdamW(TrainOptimizer):
    """torch.optim.AdamW with `foreach=False` (its single-tensor arithmetic, step for step the same bits) for the
    adapters on a CPU, without torch.optim.Optimizer: that class's first `add_param_group` imports torch._dynamo
    (about 900 modules with sympy: 145 MiB of resident memory, a third of what training SmolLM2-135M holds, and
    about a second of start-up). The interface is the part the trainer uses: `param_groups` (dicts with "params",
    "lr", "betas", "eps", "weight_decay" and the caller's keys), `state` (per parameter "step", a float32 tensor,
    "exp_avg", "exp_avg_sq"), `defaults`, `step()` and `zero_grad()`."""

    def __init__(
        self, param_groups, lr: float, betas: tuple[float, float] = BETAS, eps: float = EPS, weight_decay: float = 0.01
    ):
        self.defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "fused": False,
            "foreach": False,
        }
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
                    st = self.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
                exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
                st["step"] += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = st["step"].item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
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
