"""What the training loop trains: the `Trainable` Protocol.

`juno_py.train.loop.train` trains any `Trainable`: the adapters attached to a model
(`juno_py.lora.adapters.AdapterSet`) or dense weights in place of quantized ones (`juno_py.train.dense.DenseTargets`).
The loop, its resume state, its CUDA graphs (`juno_py.train.cuda_graph`) and data-parallel training
(`juno_py.train.distributed`) ask a trainable what they need through these members and nothing else:

- the parameters, by name (the resume state keys them so), and the optimizer's groups with their rates;
- `train(mode)`, and `save(path)`, which writes the trainable's own file beside the resume state (or nothing), and
  `saved_bytes()`, that file's size, for which the loop reserves disk space before the first step;
- `state_format`: the name of the resume state's schema, checked on resume;
- three hooks around the steps: `start_run()` once before the first step (after a resume restored the weights),
  `before_step()` before each step's forward, `after_optimizer_step()` after each optimizer step;
- for the CUDA graphs: `graph_blocker()` (why its steps cannot be captured, or None), `forget_derived()` (drop what
  it keeps computed from the weights' values, so a captured step computes it from the weights at each replay) and
  `derived_tensors()` (the tensors such a computation wrote, which the graph's memory pool must keep).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Union, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class StepNote:
    """A metrics event that a trainable's work before a step asks the loop to record (`Trainable.before_step`): the
    loop emits `event` with the step number and `values`."""

    event: str
    values: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Trainable(Protocol):
    """The trainable side of a model, as the training loop uses it (see the module docstring)."""

    state_format: str  # the resume state's schema name (`juno_py.train.state`)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every trainable tensor, in a fixed order (the resume state and the CUDA graphs rely on it)."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """`parameters()` with their names, in the same order."""
        ...

    def param_groups(self, lr: float, weight_decay: float, plus_ratio: float = 1.0) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: each a dict with "name", "params", "lr", "base_lr" (the rate the schedule
        scales) and "weight_decay"."""
        ...

    def train(self, mode: bool = True) -> Trainable: ...

    def save(self, path: Union[str, Path]) -> Optional[Path]:
        """Write the trainable's own file at `path` and return it; None when the resume state beside it
        (`<path>.state`) is all there is to write."""
        ...

    def saved_bytes(self) -> int:
        """The size of the file `save` writes (0 when it writes none), known before the first step."""
        ...

    def start_run(self) -> None:
        """Called once before a run's first step, after a resume restored the weights: forget whatever was derived
        from values the weights held before."""
        ...

    def before_step(self) -> Optional[StepNote]:
        """Work before each step's forward; returns the metrics event to record, if any."""
        ...

    def after_optimizer_step(self) -> None:
        """Called after each optimizer step: the weights changed, possibly without their version counters moving
        (torch's fused AdamW bumps none)."""
        ...

    def graph_blocker(self) -> Optional[str]:
        """Why a step of this trainable cannot be captured in a CUDA graph, or None when it can."""
        ...

    def forget_derived(self) -> None:
        """Drop what is kept computed from the weights' values (it is computed again when next needed)."""
        ...

    def derived_tensors(self) -> list[torch.Tensor]:
        """The tensors now kept computed from the weights' values (what `forget_derived` drops)."""
        ...


__all__ = ["StepNote", "Trainable"]
