"""One micro-batch's forward and backward, the loss it takes, and evaluation: what the training loop
(`juno_py.train.loop`) and data-parallel training (`juno_py.train.distributed`) share.

`forward_backward` runs one micro-batch (whole, in truncated-BPTT windows, or as a replayed CUDA graph) and leaves
its gradients in the trainable's parameters; `model_loss` is the summed token cross-entropy, chunked so that one
chunk's logits stay within a memory budget (`loss_chunk`); `evaluate` is the token-weighted loss that `juno-py eval`
reports.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from juno_py.errors import JunoError
from juno_py.models.loss import HEAD_CHUNK_POSITIONS, TiledHead, chunked_cross_entropy
from juno_py.train.data import Batch, Example, pad_batch

if TYPE_CHECKING:
    from juno_py.train.cuda_graph import GraphedSteps


class TrainingDiverged(JunoError, FloatingPointError):
    """A NaN or Inf in the loss or the gradients: the run stopped before the optimizer step."""


# ------------------------------------------------------------------------------------------------ memory
LOGITS_BYTES = 64 << 20  # fp32 logits of one loss chunk: bounds the loss's transient memory
# on a GPU: larger chunks, so the output projection's products have enough rows for cuBLAS (130 positions of a
# 128256-token vocabulary made the loss about 2/3 of a Llama-8B-shaped 4-layer step on the H200)
LOGITS_BYTES_GPU = 512 << 20


def loss_chunk(model) -> int:
    """Positions per loss chunk: HEAD_CHUNK_POSITIONS for a TiledHead (its tiles bound the logits); else as many as
    keep one chunk's fp32 logits within LOGITS_BYTES (LOGITS_BYTES_GPU when the model is on a GPU), at least 128."""
    head = model.loss_head()
    if isinstance(head, TiledHead):  # tiles of W bound the logits: positions bound only the chunk's [n, D] buffers
        return HEAD_CHUNK_POSITIONS
    if head is not None:  # one block of logits at a time: a quarter of the budget per block
        return max(128, LOGITS_BYTES // 4 // (4 * head.block_rows))
    budget = LOGITS_BYTES_GPU if model.embed.device.type == "cuda" else LOGITS_BYTES
    return max(128, budget // (4 * model.output.out_features))


# activation checkpointing "auto": on when a micro-batch's saved activations would take more than this share of the
# memory the device has free (the GPU's, or the host's available RAM on a CPU)
CHECKPOINT_SHARE = 0.5


def saved_activation_bytes(model, tokens: int) -> int:
    """About how many bytes a micro-batch of `tokens` tokens keeps for backward without activation checkpointing:
    per token and layer the residual stream and norms (6 × width), queries, keys and values before and after RoPE,
    the attention's output, the MLP's gate, up and product (3 × its width), in the activations' dtype."""
    a = model.args
    q, kv = a.n_head * a.head_dim, a.n_head_kv * (a.head_dim + a.head_dim_v)
    per = 6 * a.n_embd + 2 * (q + kv) + a.n_head * a.head_dim_v + 3 * a.n_ff
    return tokens * a.n_layer * per * torch.empty((), dtype=model.act_dtype).element_size()


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for activations on `device`: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import os

    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not a POSIX host: no estimate, no automatic checkpointing
        return 1 << 62


def resolve_checkpointing(model, grad_checkpoint: Optional[bool], tokens: int, bptt_window: int = 0) -> bool:
    """Whether to recompute each block in backward: `grad_checkpoint` True/False as given; None (auto): on when the
    activations of a micro-batch of `tokens` tokens (`saved_activation_bytes`) would exceed CHECKPOINT_SHARE of the
    device's free memory. Never for truncated-BPTT windows (blocks that read a K/V cache are not recomputed)."""
    if grad_checkpoint is not None:
        return bool(grad_checkpoint)
    if bptt_window:
        return False
    return saved_activation_bytes(model, tokens) > CHECKPOINT_SHARE * free_memory_bytes(model.embed.device)


# ------------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(
    model,
    examples: Sequence[Example],
    batch_size: int = 8,
    pad_id: int = 0,
    min_batches: int = 0,
    filler: Sequence[Example] = (),
    progress=None,
) -> dict:
    """Token-weighted cross-entropy over the supervised tokens of `examples`: {"loss", "ppl", "tokens"}.
    `min_batches`: run at least that many forwards, the ones beyond `examples` on `filler` and not counted (a
    sharded model's ranks must all run the same number). `progress`: a `juno_py.progress.Progress` counting
    sequences, told the loss so far and the tokens/s after every batch."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    ordered = sorted(examples, key=lambda e: len(e.ids))  # similar lengths together: less padding
    step = max(1, batch_size)
    for i in range(0, len(ordered), step):
        b = pad_batch(ordered[i : i + batch_size], pad_id)
        loss = model.loss(
            b.tokens, b.targets, b.positions, chunk=loss_chunk(model), reduction="sum", documents=b.documents
        )
        total += float(loss)
        n += b.n_supervised
        if progress is not None:
            seconds = max(progress.elapsed(), 1e-9)
            tokens = sum(len(e.ids) for e in ordered[: i + step])
            loss_so_far = f"loss {total / n:.4f}" if n else "loss -"
            progress.update(len(ordered[i : i + step]), f"{loss_so_far} | {tokens / seconds:,.0f} tokens/s")
    for _ in range(math.ceil(len(ordered) / step), min_batches):
        b = pad_batch(list(filler), pad_id)
        model.loss(b.tokens, b.targets, b.positions, chunk=loss_chunk(model), reduction="sum", documents=b.documents)
    model.train(was_training)
    loss = total / n if n else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)) if n else float("nan"), "tokens": n}


# ---------------------------------------------------------------------------------------- one micro-batch
def _detach_cache(cache) -> None:
    """Truncated BPTT: later windows see the cached keys and values as constants."""
    cache.k = [k.detach() for k in cache.k]
    cache.v = [v.detach() for v in cache.v]


def forward_backward(
    model,
    batch: Batch,
    denominator: float,
    window: int = 0,
    times: Optional[dict] = None,
    net=None,
    sync: bool = True,
    graphs: Optional[GraphedSteps] = None,
) -> float:
    """Forward and backward of one micro-batch; gradients of (summed token loss / denominator) accumulate in the
    trainable's parameters. `window` tokens at a time (0: the whole sequence), each window attending to the cached
    K/V of the earlier ones with gradients stopped there. Returns the summed token loss; raises TrainingDiverged on a
    non-finite loss before any backward (under a CUDA graph: before its gradients reach the parameters).

    `graphs`: CUDA graphs of whole micro-batches (`train.cuda_graph.GraphedSteps`), used where they apply.

    `net`: the model's DistributedDataParallel wrapper (data-parallel training). The blocks then run through it,
    and the gradients are all-reduced in the backward of the last window if `sync`. A non-finite loss does not
    raise there: every rank must take part in the all-reduce; the step checks the all-reduced loss instead."""
    times = times if times is not None else {}
    T = batch.tokens.shape[1]
    window = T if not window or window >= T else window
    if graphs is not None and window == T and net is None:
        t0 = time.perf_counter()
        value = graphs(batch, denominator, last=sync)
        if value is not None:
            times["forward_ms"] = times.get("forward_ms", 0.0) + 1e3 * (time.perf_counter() - t0)  # the whole replay
            times.setdefault("backward_ms", 0.0)
            if not math.isfinite(value):
                raise TrainingDiverged(f"the loss is {value} (a micro-batch)")
            return value
    cache = model.new_cache(batch.tokens.shape[0], T) if window < T else None
    total = 0.0
    for a in range(0, T, window):
        b = min(a + window, T)
        documents = batch.documents[:, a:b] if batch.documents is not None else None
        # rows of one unpadded example each are causal by index: no positions, so attention takes its causal kernels
        positions = batch.positions[:, a:b] if documents is not None or cache is not None else None
        t0 = time.perf_counter()
        with sync_context(net, sync and b == T):
            hidden = (net or model)(batch.tokens[:, a:b], positions, None, cache, documents)
        loss = model_loss(model, hidden, batch.targets[:, a:b])
        value = float(loss.detach())
        t1 = time.perf_counter()
        if not math.isfinite(value) and net is None:
            raise TrainingDiverged(f"the loss is {value} (tokens {a}..{b} of a micro-batch)")
        (loss / denominator).backward()
        times["forward_ms"] = times.get("forward_ms", 0.0) + 1e3 * (t1 - t0)
        times["backward_ms"] = times.get("backward_ms", 0.0) + 1e3 * (time.perf_counter() - t1)
        if cache is not None:
            _detach_cache(cache)
        total += value
    return total


def sync_context(net, sync: bool):
    """DDP all-reduces the gradients in the backward of a forward run with `sync`; the others accumulate."""
    return net.no_sync() if net is not None and not sync else nullcontext()


def model_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy of `hidden` under the model's output projection, chunked (see loss_chunk)."""
    return chunked_cross_entropy(
        hidden,
        targets,
        model.project,
        chunk=loss_chunk(model),
        reduction="sum",
        hold=model.output_decoded(),
        head=model.loss_head(),
    )
