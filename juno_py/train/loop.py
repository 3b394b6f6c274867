"""The training loop: read it top to bottom in `train`.

One optimizer step = one group of `accumulation` micro-batches. Each micro-batch's summed token loss is divided by
the supervised tokens of the whole group before backward, so the step's loss is the mean over the group's
supervised tokens whatever the split into micro-batches. Then: a non-finite loss or gradient stops the run before
the optimizer touches anything; the global gradient norm is clipped; AdamW steps with the scheduled rates.
Validation, stop rules and checkpoints follow. `evaluate` is the token-weighted loss that `juno-py eval` reports.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from juno_py.errors import JunoError
from juno_py.metrics import Identity, MetricsRecorder, format_bytes, peak_rss_bytes, rss_bytes
from juno_py.models.loss import chunked_cross_entropy
from juno_py.train import distributed
from juno_py.train.cuda_graph import GraphedSteps, graph_blocker, resolve_graphs
from juno_py.train.data import Batch, Example, pad_batch, plan_epoch
from juno_py.train.optim import build_optimizer, lr_factor, set_learning_rates
from juno_py.train.state import FORMAT, StateError, optimizer_tensors, restore_optimizer, save_state, state_path


class TrainingDiverged(JunoError, FloatingPointError):
    """A NaN or Inf in the loss or the gradients: the run stopped before the optimizer step."""


@dataclass
class TrainConfig:
    """Every number of a run that matters (the CLI's flags, with the same defaults)."""

    lr: float = 2e-3
    batch_size: int = 4
    accumulation: int = 1
    max_grad_norm: float = 1.0  # 0: no clipping
    weight_decay: float = 0.01  # on A only
    plus_ratio: float = 1.0  # LoRA+: B's rate is lr × plus_ratio
    schedule: str = "warmup-cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    max_steps: Optional[int] = None
    epochs: Optional[int] = 8
    loss_target: Optional[float] = None  # stop once the last epoch's worth of steps averages at or below it
    validation_every: Optional[int] = None  # optimizer steps between validations; None: once per epoch
    patience: int = 3  # validations without an improvement of min_delta before stopping; 0: never
    min_delta: float = 0.0
    overfit_ratio: float = 1.25  # stop at once when validation loss exceeds its best × this; 0: off
    bptt_window: int = 0  # 0: the whole sequence (exact)
    grad_checkpoint: bool = False
    cuda_graphs: str = "auto"  # capture each step on a GPU: auto (where it can), on (or fail), off
    pack: bool = False
    max_seq_len: int = 512
    pad_id: int = 0
    seed: int = 0
    save_every: int = 0  # optimizer steps between checkpoints; 0: only at the end
    lora_path: Optional[Path] = None  # where checkpoints go; None: nowhere (library use)


@dataclass
class TrainResult:
    steps: int
    epochs: float
    tokens: int
    seconds: float
    stop_reason: str
    first_loss: float
    last_loss: float
    best_validation: Optional[float] = None
    best_step: Optional[int] = None
    peak_rss: int = 0

    def summary(self) -> str:
        val = f"; best validation {self.best_validation:.4f} at step {self.best_step}" \
            if self.best_validation is not None else ""
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"trained {self.steps} steps ({self.epochs:.1f} epochs, {self.tokens} tokens) in {self.seconds:.1f} s, "
                f"{rate:.0f} tokens/s; loss {self.first_loss:.4f} -> {self.last_loss:.4f}{val}; "
                f"stopped: {self.stop_reason}; peak RSS {format_bytes(self.peak_rss)}")


@dataclass
class RunState:
    """Where a run stands: all of it goes into the resume state."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # next batch within the epoch
    tokens: int = 0
    recent: list = field(default_factory=list)  # (loss sum, supervised tokens) of the last steps, for loss_target
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    best_val: Optional[float] = None
    best_step: Optional[int] = None
    bad_evals: int = 0
    last_val_step: Optional[int] = None
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------------ memory
LOGITS_BYTES = 64 << 20  # fp32 logits of one loss chunk: bounds the loss's transient memory
# on a GPU: larger chunks, so the output projection's products have enough rows for cuBLAS (130 positions of a
# 128256-token vocabulary made the loss about 2/3 of a Llama-8B-shaped 4-layer step on the H200)
LOGITS_BYTES_GPU = 512 << 20


def loss_chunk(model) -> int:
    """Positions per loss chunk: as many as keep one chunk's fp32 logits within LOGITS_BYTES (LOGITS_BYTES_GPU when
    the model is on a GPU), at least 128."""
    head = model.loss_head() if hasattr(model, "loss_head") else None
    if head is not None:  # one block of logits at a time: a quarter of the budget per block
        return max(128, LOGITS_BYTES // 4 // (4 * head.block_rows))
    budget = LOGITS_BYTES_GPU if model.embed.device.type == "cuda" else LOGITS_BYTES
    return max(128, budget // (4 * model.output.out_features))


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim) after each step. Without it, the activations
    freed after backward stay in glibc's arenas and the next steps' fragments raise peak RSS by about a third
    (1.65 -> 1.32 GiB on SmolLM2, 8 x 64 tokens); it costs about a millisecond."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# ------------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(model, examples: Sequence[Example], batch_size: int = 8, pad_id: int = 0) -> dict:
    """Token-weighted cross-entropy over the supervised tokens of `examples`: {"loss", "ppl", "tokens"}."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    ordered = sorted(examples, key=lambda e: len(e.ids))  # similar lengths together: less padding
    for i in range(0, len(ordered), max(1, batch_size)):
        b = pad_batch(ordered[i:i + batch_size], pad_id)
        total += float(model.loss(b.tokens, b.targets, b.positions, b.mask, chunk=loss_chunk(model), reduction="sum"))
        n += b.n_supervised
    model.train(was_training)
    loss = total / n if n else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)) if n else float("nan"), "tokens": n}


# ---------------------------------------------------------------------------------------- one micro-batch
def _detach_cache(cache) -> None:
    """Truncated BPTT: later windows see the cached keys and values as constants."""
    cache.k = [k.detach() for k in cache.k]
    cache.v = [v.detach() for v in cache.v]


def forward_backward(model, batch: Batch, denominator: float, window: int = 0, times: Optional[dict] = None,
                     net=None, sync: bool = True, graphs: Optional[GraphedSteps] = None) -> float:
    """Forward and backward of one micro-batch; gradients of (summed token loss / denominator) accumulate in the
    adapters. `window` tokens at a time (0: the whole sequence), each window attending to the cached K/V of the
    earlier ones with gradients stopped there. Returns the summed token loss; raises TrainingDiverged on a
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
        mask = batch.mask[:, a:b, :b] if batch.mask is not None else None
        # rows of one unpadded example each are causal by index: no positions, so attention takes its causal kernels
        positions = batch.positions[:, a:b] if mask is not None or cache is not None else None
        t0 = time.perf_counter()
        with distributed.sync_context(net, sync and b == T):
            hidden = (net or model)(batch.tokens[:, a:b], positions, mask, cache)
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


def model_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token cross-entropy of `hidden` under the model's output projection, chunked (see loss_chunk)."""
    return chunked_cross_entropy(hidden, targets, model.project, chunk=loss_chunk(model), reduction="sum",
                                 hold=model.output_decoded(), head=model.loss_head())


def grad_norm(params: Sequence[torch.Tensor]) -> float:
    """Global L2 norm of the gradients (fp64 accumulation). On a GPU the squares are summed there and read once:
    one read per parameter would wait for the device hundreds of times a step."""
    grads = [p.grad for p in params if p.grad is not None]
    # vector_norm accumulates in fp64 without an fp64 copy of the gradient (5x faster on the CPU than
    # g.double().square().sum(): it matters for full training's 106M-value gradients)
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    if grads and grads[0].device.type != "cpu":
        return math.sqrt(float(torch.stack(norms).square().sum()))
    return math.sqrt(sum(float(n) ** 2 for n in norms))


def refresh_dora_norms(adapters) -> int:
    """Recompute DoRA's detached row norms once per step (the forward then reuses them); returns how many."""
    n = 0
    with torch.no_grad():
        for mod in adapters.modules.values():
            if mod.dora is not None:
                mod.dora_scale()
                n += 1
    return n


def data_fingerprint(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(len(e.ids).to_bytes(4, "little"))
        h.update(torch.tensor(e.ids, dtype=torch.int64).numpy().tobytes())
        h.update(bytes(e.supervised))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------- the loop
def train(model, adapters, train_set: Sequence[Example], cfg: TrainConfig, val_set: Sequence[Example] = (),
          recorder: Optional[MetricsRecorder] = None, resume: bool = False,
          stop_requested: Optional[Callable[[], bool]] = None, progress: Optional[bool] = None,
          log: Optional[Callable[[str], None]] = None,
          optimizer: Optional[torch.optim.Optimizer] = None) -> TrainResult:
    """Train `adapters` (attached to `model`) on `train_set`; see TrainConfig for every knob.

    `stop_requested()` is asked after each step (Ctrl-C sets it): the run saves and returns. `progress`: a tqdm
    bar on stderr (None: when stderr is a terminal). `log` receives one-line messages (default: stderr).
    `adapters` may be any trainable set with an AdapterSet's surface (`juno_py.train.dense.DenseTargets`: dense
    weights for full training). `optimizer`: default AdamW over the adapter groups; one with a `grad_norm(params)`
    method reports the step's norm itself (GaLore's per-layer mode updates during backward and frees gradients).
    """
    if not train_set:
        raise ValueError("no training examples")
    world = distributed.current()  # the data-parallel ranks under torchrun, else a single process
    say = (log or (lambda msg: print(msg, file=sys.stderr))) if world.is_main else (lambda msg: None)
    recorder = recorder or MetricsRecorder(Identity())
    params = list(adapters.parameters())
    names = {id(p): n for n, p in adapters.named_parameters()}
    optimizer = optimizer or build_optimizer(adapters, cfg.lr, cfg.weight_decay, cfg.plus_ratio)
    model.checkpoint_blocks = cfg.grad_checkpoint
    torch.manual_seed(cfg.seed)  # dropout

    def plan(epoch: int):
        return plan_epoch(train_set, cfg.batch_size, cfg.seed, epoch, cfg.pack, cfg.max_seq_len)

    # how long the run is: --max-steps, else --epochs, whichever comes first when both are given
    steps_per_epoch = math.ceil(len(plan(0)) / cfg.accumulation)
    total_steps = cfg.max_steps if cfg.max_steps is not None else None
    if cfg.epochs is not None:
        epoch_steps = sum(math.ceil(len(plan(e)) / cfg.accumulation) for e in range(cfg.epochs))
        total_steps = epoch_steps if total_steps is None else min(total_steps, epoch_steps)
    if total_steps is None:
        raise ValueError("give --max-steps or --epochs: the run needs an end")
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0

    # the settings a resume must share with the run it continues
    identity = {"data": data_fingerprint(train_set), "params": sorted(names.values()),
                "shapes": [list(p.shape) for p in params], "seed": cfg.seed, "batch_size": cfg.batch_size,
                "accumulation": cfg.accumulation, "pack": cfg.pack, "max_seq_len": cfg.max_seq_len}
    if world.active:  # every rank must plan the same epochs from the same data
        distributed.check_same_data(world, {"training data": identity["data"],
                                            "validation data": data_fingerprint(val_set)})
    run = RunState()
    best_weights: Optional[list[torch.Tensor]] = None
    if resume:
        best_weights = _restore(cfg, run, params, names, optimizer, identity,
                                getattr(adapters, "state_format", FORMAT))
        say(f"resumed from {state_path(cfg.lora_path)} at step {run.step} (epoch {run.epoch}, batch {run.batch})")
    # A may hold other values than a DoRA layer's running U was moved to (a resume, an earlier run in this
    # process): the first step computes U afresh
    for mod in getattr(adapters, "modules", {}).values():
        if hasattr(mod, "reset_running_u"):
            mod.reset_running_u()

    def checkpoint(reason: str) -> None:
        if cfg.lora_path is None:
            return
        if not world.is_main:  # rank 0 writes; the others wait for it, so no failure elsewhere cuts a save short
            return world.barrier()
        t0 = time.perf_counter()
        written = adapters.save(cfg.lora_path)  # None: the resume state holds the weights (dense targets)
        _save(cfg, run, params, names, optimizer, identity, best_weights, getattr(adapters, "state_format", FORMAT))
        size = Path(written or state_path(cfg.lora_path)).stat().st_size
        recorder.emit("checkpoint", step=run.step, path=str(cfg.lora_path), bytes=size, reason=reason,
                      ms=1e3 * (time.perf_counter() - t0))
        world.barrier()

    def validate() -> Optional[dict]:
        if not val_set:
            return None
        v = distributed.evaluate(model, val_set, cfg.batch_size, cfg.pad_id, world)  # the same on every rank
        improved = run.best_val is None or v["loss"] < run.best_val - cfg.min_delta
        if improved:
            nonlocal best_weights
            run.best_val, run.best_step, run.bad_evals = v["loss"], run.step, 0
            best_weights = [p.detach().clone() for p in params]
        else:
            run.bad_evals += 1
        run.last_val_step = run.step
        recorder.emit("validation", step=run.step, loss=v["loss"], ppl=v["ppl"], tokens=v["tokens"],
                      best=run.best_val, improved=improved)
        return v

    model.train()
    adapters.train()
    net = distributed.wrap(model, world, getattr(optimizer, "updates_in_backward", False))  # DDP, or None
    graphs = None
    if resolve_graphs(cfg.cuda_graphs, graph_blocker(model, cfg, net, optimizer, adapters)):
        graphs = GraphedSteps(model, params, functools.partial(model_loss, model), log=say)
    step_fn = functools.partial(forward_backward, graphs=graphs)
    lazy_norms = model.embed.device.type != "cpu"  # see the norm refresh below
    bar = _progress_bar(total_steps, run.step, progress if world.is_main else False)
    started = time.perf_counter() - run.seconds
    stop_reason = None
    batches, batches_epoch = [], None
    try:
        while stop_reason is None:
            if run.step >= total_steps:
                stop_reason = "max steps" if cfg.max_steps is not None and run.step >= cfg.max_steps else "epochs"
                break
            # --- the group of micro-batches of this step
            if batches_epoch != run.epoch:
                batches, batches_epoch = plan(run.epoch), run.epoch
            step_batches = batches[run.batch:run.batch + cfg.accumulation]
            share = distributed.StepShare(step_batches, cfg.batch_size, cfg.pad_id, world, cfg.seed, run.step)
            n_sup, n_tok = share.n_supervised, share.n_tokens  # of the global batch, all ranks together
            lrs = set_learning_rates(optimizer, lr_factor(cfg.schedule, run.step, total_steps, cfg.warmup_steps,
                                                          min_ratio))
            times: dict = {}
            t0 = time.perf_counter()
            if lazy_norms:
                # each stale norm is recomputed by the step's own forward (inside a CUDA graph, or eagerly), from the
                # tiles it decodes for its base product anyway (`FrozenQuantLinear.matmul_with_exact`): not twice
                n_dora = sum(1 for m in getattr(adapters, "modules", {}).values() if getattr(m, "dora", None))
                if n_dora:
                    recorder.emit("norm_refresh", step=run.step, modules=n_dora, ms=0.0, in_step=True)
            else:
                n_dora = refresh_dora_norms(adapters)
                if n_dora:
                    recorder.emit("norm_refresh", step=run.step, modules=n_dora, ms=1e3 * (time.perf_counter() - t0))

            # --- forward and backward; nothing is updated before every number is known to be finite
            try:
                loss_sum = share.forward_backward(step_fn, model, net, cfg.bptt_window, times)
                if not math.isfinite(loss_sum):
                    raise TrainingDiverged(f"the loss is {loss_sum}")
                norm = optimizer.grad_norm(params) if hasattr(optimizer, "grad_norm") else grad_norm(params)
                if not math.isfinite(norm):
                    raise TrainingDiverged(f"the gradient norm is {norm}")
            except TrainingDiverged as e:
                optimizer.zero_grad(set_to_none=True)
                kept = _keep_last_good(checkpoint, params, cfg, getattr(optimizer, "updates_in_backward", False))
                raise TrainingDiverged(f"step {run.step + 1}: {e}: stopped before the optimizer step; {kept}") \
                    from None

            # --- clip, step
            t_opt = time.perf_counter()
            clipped = cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm
            if clipped:
                scale = cfg.max_grad_norm / (norm + 1e-6)
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if hasattr(adapters, "weights_changed"):  # DoRA's cached norms go: a fused optimizer bumps no versions
                adapters.weights_changed()
            times["optimizer_ms"] = 1e3 * (time.perf_counter() - t_opt)

            # --- bookkeeping
            loss = loss_sum / max(n_sup, 1)
            run.step += 1
            run.batch += len(step_batches)
            run.tokens += n_tok
            if math.isnan(run.first_loss):
                run.first_loss = loss
            run.last_loss = loss
            run.recent = (run.recent + [(loss_sum, n_sup)])[-steps_per_epoch:]
            epoch_done = run.batch >= len(batches)
            if epoch_done:
                run.epoch, run.batch = run.epoch + 1, 0
            run.seconds = time.perf_counter() - started
            recorder.emit("train_step", step=run.step, epoch=run.epoch, tokens=n_tok, supervised_tokens=n_sup,
                          loss=loss, grad_norm=norm, clipped=clipped, lr_a=lrs.get("A", lrs.get("weights", 0.0)),
                          lr_b=lrs.get("B", 0.0), **times)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f} | {run.tokens / max(run.seconds, 1e-9):.0f} tok/s | "
                                    f"RSS {format_bytes(rss_bytes())}", refresh=False)

            # --- validation and stop rules
            due = run.step % cfg.validation_every == 0 if cfg.validation_every else epoch_done
            v = validate() if due else None
            if v is not None:
                say(f"step {run.step}: validation loss {v['loss']:.4f} (best {run.best_val:.4f} at step "
                    f"{run.best_step})")
                if cfg.patience and run.bad_evals >= cfg.patience:
                    stop_reason = f"validation patience ({cfg.patience} validations without improvement)"
                elif cfg.overfit_ratio and v["loss"] > run.best_val * cfg.overfit_ratio:
                    stop_reason = (f"overfit guard (validation loss {v['loss']:.4f} > {cfg.overfit_ratio} x best "
                                   f"{run.best_val:.4f})")
            if stop_reason is None and cfg.loss_target is not None and len(run.recent) >= steps_per_epoch:
                recent = sum(s for s, _ in run.recent) / max(1, sum(n for _, n in run.recent))
                if recent <= cfg.loss_target:
                    stop_reason = f"loss target ({recent:.4f} <= {cfg.loss_target} over the last epoch)"
            if stop_reason is None and stop_requested is not None and stop_requested():
                stop_reason = "interrupted"
            stop_reason = distributed.agree_stop(stop_reason, world)
            if stop_reason is None and cfg.save_every and run.step % cfg.save_every == 0:
                checkpoint("save-every")
    finally:
        if bar is not None:
            bar.close()

    # the end: validate the final weights if not yet done, keep the best ones, save
    if stop_reason != "interrupted" and val_set and run.last_val_step != run.step and run.step > 0:
        validate()
    if best_weights is not None and run.best_step != run.step and stop_reason != "interrupted":
        with torch.no_grad():
            for p, w in zip(params, best_weights):
                p.copy_(w)
        say(f"restored the best weights (validation loss {run.best_val:.4f} at step {run.best_step})")
    run.seconds = time.perf_counter() - started
    checkpoint("interrupted" if stop_reason == "interrupted" else "final")
    return TrainResult(run.step, run.epoch + run.batch / max(1, len(plan(run.epoch))), run.tokens, run.seconds,
                       stop_reason, run.first_loss, run.last_loss, run.best_val, run.best_step, peak_rss_bytes())


def _keep_last_good(checkpoint: Callable[[str], None], params, cfg: TrainConfig, partial: bool = False) -> str:
    """After a divergence: the adapter still holds the last good step's weights; save them if they are finite.
    `partial`: the optimizer updated some weights during this step's backward (per-layer mode), so the weights
    are not the last good step's: the last checkpoint stays."""
    if partial:
        where = f"the last checkpoint {cfg.lora_path} is kept as it was" if cfg.lora_path else "nothing was saved"
        return f"per-layer updates had already changed some weights during this backward pass; {where}"
    if cfg.lora_path is None:
        return "the adapter keeps the last good step's weights"
    if all(bool(torch.isfinite(p).all()) for p in params):
        checkpoint("diverged")
        return f"the last good weights are saved in {cfg.lora_path}"
    return f"the weights are not finite; the last checkpoint {cfg.lora_path} is kept as it was"


def _progress_bar(total: int, initial: int, progress: Optional[bool]):
    from tqdm import tqdm

    disable = None if progress is None else not progress  # None: only on a terminal
    return tqdm(total=total, initial=initial, file=sys.stderr, disable=disable, unit="step", dynamic_ncols=True,
                desc="train")


# ------------------------------------------------------------------------------------------- resume state
def _save(cfg: TrainConfig, run: RunState, params, names, optimizer, identity: dict, best_weights,
          fmt: str = FORMAT) -> None:
    tensors, steps = optimizer_tensors(optimizer, names)
    for p in params:
        tensors[f"param/{names[id(p)]}"] = p
    if best_weights is not None:
        for p, w in zip(params, best_weights):
            tensors[f"best/{names[id(p)]}"] = w
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"identity": identity, "run": run.__dict__, "adam_steps": steps}
    save_state(state_path(cfg.lora_path), tensors, meta, fmt)


def _restore(cfg: TrainConfig, run: RunState, params, names, optimizer, identity: dict, fmt: str = FORMAT):
    if cfg.lora_path is None:
        raise StateError("--resume needs --lora-path (its .state file holds the run)")
    where = state_path(cfg.lora_path)
    tensors, meta = distributed.read_state(where, fmt)  # rank 0 reads, every rank gets it
    saved = meta.get("identity", {})
    for key, value in identity.items():
        if saved.get(key) != value:
            raise StateError(f"{where}: the run's {key} differs from this one's ({_short(saved.get(key))} vs "
                             f"{_short(value)}); resume with the same data and settings")
    with torch.no_grad():
        for p in params:
            p.copy_(tensors[f"param/{names[id(p)]}"])
    restore_optimizer(optimizer, names, tensors, meta["adam_steps"], str(where))
    for k, v in meta["run"].items():
        setattr(run, k, [tuple(x) for x in v] if k == "recent" else v)
    torch.set_rng_state(tensors["rng/torch"])
    if f"best/{names[id(params[0])]}" in tensors:
        return [tensors[f"best/{names[id(p)]}"].clone() for p in params]
    return None


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
