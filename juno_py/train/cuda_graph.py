"""CUDA graphs for training on a GPU: one micro-batch's forward, loss and backward captured once per batch shape and
replayed, so a step costs one launch instead of thousands.

A training step of a small model on an H200 is bound by the host, not the GPU: each of its few thousand kernels
(frozen-linear decodes, GEMMs, norms, compositions, the chunked loss) costs tens of microseconds of Python and
launching, more than the kernel runs. A graph replays the same kernels with no host work in between.

What is captured: `Transformer.hidden_states` (blocks and final norm) from the token embeddings, the chunked
cross-entropy and the backward into the trainable's gradients. The embedding lookup runs eagerly before (its table
may sit on the host), and the loop does the rest as for an eager step: the non-finite checks, clipping and the
optimizer. What the trainable keeps computed from its weights (`Trainable.forget_derived`, `derived_tensors`) is
recomputed inside the graph, from the weights as they are at each replay.

Static buffers (inputs, the loss, the gradients) belong to each captured shape; all graphs of a model share one
memory pool. A shape is captured the second time it is seen (the first runs eagerly and warms up cuBLAS and the
Triton kernels), at most `MAX_GRAPHS` shapes; other shapes run eagerly. Anything that cannot be captured (a host
synchronisation inside the step, an error) turns graphs off for the run and the step runs eagerly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from juno_py.errors import JunoError
from juno_py.train.optim import TrainOptimizer
from juno_py.train.trainable import Trainable

GRAPH_MODES = ("auto", "on", "off")
MAX_GRAPHS = 4
# micro-batches of at least this many tokens run eagerly: launches are a negligible part of such a step, and a
# graph's private memory pool would keep a second set of its activations beside the eager warm-up's
MAX_GRAPH_TOKENS = 65536


class GraphsUnavailable(JunoError, RuntimeError):
    """--cuda-graphs on was asked for where graphs cannot run."""


def graph_blocker(model, cfg, net, optimizer: TrainOptimizer, trainable: Trainable) -> Optional[str]:
    """Why this run's steps cannot be captured, or None when they can."""
    if model.embed.device.type != "cuda":
        return "the model is not on a CUDA device"
    if net is not None:
        return "data-parallel training (DDP all-reduces during backward)"
    moe = _moe_blocks(model)
    if moe and not all(m.runs_grouped(torch.empty(0, device=model.embed.device, dtype=model.act_dtype)) for m in moe):
        return "mixture-of-experts blocks on the per-expert loop (its group sizes are read on the host every step)"
    why = step_blocker(cfg, model.checkpoint_blocks, launch_bound=bool(moe))
    if why is not None:
        return why
    if optimizer.updates_in_backward:
        return "an optimizer that updates during backward (GaLore per-layer)"
    return trainable.graph_blocker()


def _moe_blocks(model) -> list:
    """The model's mixture-of-experts feed-forwards (none for a dense model)."""
    from juno_py.models.moe import MoEFeedForward

    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def step_blocker(cfg, checkpointing: bool, launch_bound: bool = False) -> Optional[str]:
    """Why steps of this configuration cannot be captured (`checkpointing`: the model recomputes its blocks in
    backward), or None. `launch_bound`: the model's step is bound by its launches even with checkpointing (the
    grouped experts of an MoE model: routing, gathers and grouped products in every block), so a checkpointed step
    is captured too."""
    if cfg.bptt_window:
        return "--bptt-window (windows carry a KV cache between captures)"
    if (checkpointing or cfg.grad_checkpoint) and not launch_bound:
        return "--grad-checkpoint (activation checkpointing)"
    if cfg.batch_size * cfg.max_seq_len >= MAX_GRAPH_TOKENS:
        return f"micro-batches of {cfg.batch_size} x {cfg.max_seq_len} tokens (at least {MAX_GRAPH_TOKENS})"
    return None


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor
    targets: torch.Tensor
    positions: Optional[torch.Tensor]
    documents: Optional[torch.Tensor]
    inv_denominator: torch.Tensor
    loss: torch.Tensor
    grads: list
    keep: list = field(default_factory=list)  # other tensors the graph writes (`derived_tensors`): never freed


class GraphedSteps:
    """Forward + backward of micro-batches through CUDA graphs, one per batch shape (see the module docstring).

    `__call__(batch, denominator, last)` returns the summed token loss (a float, read after the replay) and leaves
    this micro-batch's gradients of (loss / denominator) added to the parameters' `.grad`, as
    `steps.forward_backward` does; it returns None when the batch must run eagerly instead (the caller then runs it).
    `last`: no further micro-batch of this step follows (the gradients may then alias the graph's buffers)."""

    def __init__(self, model, trainable: Trainable, loss_fn: Callable, log: Callable[[str], None] = lambda msg: None):
        self.model, self.trainable, self.loss_fn, self.log = model, trainable, loss_fn, log
        self.params = list(trainable.parameters())
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}
        self.seen: dict[tuple, int] = {}
        self.disabled: Optional[str] = None
        self.replays = 0

    @staticmethod
    def key(batch) -> tuple:
        return tuple(batch.tokens.shape), batch.documents is not None

    def __call__(self, batch, denominator: float, last: bool = True) -> Optional[float]:
        if self.disabled is not None:
            return None
        key = self.key(batch)
        cap = self.graphs.get(key)
        if cap is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < 2 or len(self.graphs) >= MAX_GRAPHS:
                return None  # first sight (eager warm-up), or no room: eager
            try:
                cap = self._capture(batch)
            except Exception as e:  # noqa: BLE001 - whatever breaks capture, the step can still run eagerly
                self._give_up(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                return None
            self.graphs[key] = cap
        self._load(cap, batch, denominator)
        cap.graph.replay()
        self.replays += 1
        value = float(cap.loss)
        if math.isfinite(value):
            for p, g in zip(self.params, cap.grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g if last else g.clone()
                else:
                    p.grad.add_(g)
        return value

    # ---- capture ------------------------------------------------------------------------------------------------
    def _static_inputs(self, batch) -> dict:
        dev = self.model.embed.device
        x = self.model.embed_tokens(batch.tokens)
        plain = batch.documents is None  # one example per row, no padding: causal by index (SDPA's causal kernels)
        return dict(
            x=x.clone(),
            targets=batch.targets.to(dev).clone(),
            positions=None if plain else batch.positions.to(dev).clone(),
            documents=None if plain else batch.documents.to(dev).clone(),
            inv_denominator=torch.ones((), dtype=torch.float32, device=dev),
        )

    def _forward_backward(self, s: dict) -> torch.Tensor:
        hidden = self.model.hidden_states(s["x"], s["positions"], documents=s["documents"])
        loss = self.loss_fn(hidden, s["targets"])
        (loss * s["inv_denominator"]).backward()
        return loss.detach()

    def _capture(self, batch) -> _Captured:
        s = self._static_inputs(batch)
        held = [p.grad for p in self.params]  # an accumulating step's gradients so far: kept out of the capture
        try:
            for p in self.params:
                p.grad = None
            # warm-up on a side stream, as CUDA graph capture wants (lazy allocations, autograd's stream state); the
            # router load it counts is taken back, so the step counts its routing once (by the replay)
            loads = getattr(self.model, "expert_load", None)
            counted = {k: v.clone() for k, v in loads().items()} if loads is not None else {}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward_backward(s)
            torch.cuda.current_stream().wait_stream(side)
            for layer, v in (loads() if loads is not None else {}).items():
                if layer in counted:
                    v.copy_(counted[layer])
                else:
                    v.zero_()
            for p in self.params:
                p.grad = None
            self.trainable.forget_derived()  # computed inside the graph, from the weights as they are at replay
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                loss = self._forward_backward(s)
            grads = [p.grad for p in self.params]
            keep = self.trainable.derived_tensors()
        finally:
            for p, g in zip(self.params, held):
                p.grad = g
            self.trainable.forget_derived()  # eager calls recompute it (the graph wrote its own copy; a failed one none)
        self.log(
            f"captured a CUDA graph of the training step for batches of {tuple(batch.tokens.shape)} tokens"
            + (" (packed or padded)" if batch.documents is not None else "")
        )
        return _Captured(
            graph, s["x"], s["targets"], s["positions"], s["documents"], s["inv_denominator"], loss, grads, keep
        )

    def _load(self, cap: _Captured, batch, denominator: float) -> None:
        cap.x.copy_(self.model.embed_tokens(batch.tokens))
        cap.targets.copy_(batch.targets, non_blocking=True)
        if cap.positions is not None:
            cap.positions.copy_(batch.positions, non_blocking=True)
            cap.documents.copy_(batch.documents, non_blocking=True)
        cap.inv_denominator.fill_(1.0 / denominator)

    def _give_up(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()
        torch.cuda.synchronize()
        self.log(f"CUDA graphs off for this run: {why}; the steps run eagerly")


def resolve_graphs(mode: str, blocker: Optional[str]) -> bool:
    """Whether to use graphs: `mode` auto/on/off and the reason they cannot run (None: they can)."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs is {mode!r}: expected one of {', '.join(GRAPH_MODES)}")
    if mode == "off":
        return False
    if blocker is not None:
        if mode == "on":
            raise GraphsUnavailable(f"--cuda-graphs on: {blocker}; use --cuda-graphs auto or off")
        return False
    return True


__all__ = [
    "GraphedSteps",
    "GraphsUnavailable",
    "graph_blocker",
    "resolve_graphs",
    "step_blocker",
    "GRAPH_MODES",
    "MAX_GRAPHS",
    "MAX_GRAPH_TOKENS",
]
