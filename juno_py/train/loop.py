"""The training loop: read it top to bottom in `train`.

One optimizer step = one group of `accumulation` micro-batches. Each micro-batch's summed token loss is divided by
the supervised tokens of the whole group before backward, so the step's loss is the mean over the group's
supervised tokens whatever the split into micro-batches. Then: a non-finite loss or gradient stops the run before
the optimizer touches anything; the global gradient norm is clipped; AdamW steps with the scheduled rates.
Validation, stop rules and checkpoints follow. The loop trains any `Trainable` (`juno_py.train.trainable`) with any
`TrainOptimizer` (`juno_py.train.optim`); one micro-batch's forward and backward, the loss and evaluation are in
`juno_py.train.steps`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union, cast

import torch

from juno_py.atomic import OutputError, reason, release, reserve
from juno_py.lora.format import MAX_ABS_VALUE
from juno_py.metrics import Identity, MetricsRecorder, format_bytes, peak_rss_bytes
from juno_py.progress import DEFAULT_INTERVAL, Progress
from juno_py.threads import StallGuard
from juno_py.train import distributed
from juno_py.train.cuda_graph import GraphedSteps, graph_blocker, resolve_graphs
from juno_py.train.data import Example, plan_epoch
from juno_py.train.optim import TrainOptimizer, as_train_optimizer, build_optimizer, lr_factor, set_learning_rates
from juno_py.train.sharded import ShardedModel, local_part, shard_state_path, sharded_like
from juno_py.train.state import StateError, load_state, save_state, state_path
from juno_py.train.steps import TrainingDiverged, forward_backward, model_loss, resolve_checkpointing
from juno_py.train.trainable import Trainable

# Divergence: a step whose loss or gradient is not finite stops the run before the optimizer touches anything, and
# the weights kept are the last good ones: their loss finite and at most EXPLODED_RATIO times the run's first loss
# (floored at 1 nat), and every value at most MAX_WEIGHT in magnitude (what an adapter file holds at most). Weights
# past either bound have exploded, even while their numbers are still finite.
EXPLODED_RATIO = 4.0
MAX_WEIGHT = MAX_ABS_VALUE
# slack on the resume state's estimated size: its JSON document, the RNG state, safetensors' header
STATE_SLACK_BYTES = 1 << 20


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
    schedule_steps: Optional[int] = None  # the schedule's length; None: the epochs' steps, else max_steps
    loss_target: Optional[float] = None  # stop once the last epoch's worth of steps averages at or below it
    validation_every: Optional[int] = None  # optimizer steps between validations; None: once per epoch
    patience: int = 3  # validations without an improvement of min_delta before stopping; 0: never
    min_delta: float = 0.0
    overfit_ratio: float = 1.25  # stop at once when validation loss exceeds its best × this; 0: off
    bptt_window: int = 0  # 0: the whole sequence (exact)
    grad_checkpoint: Optional[bool] = None  # None: auto, on where a micro-batch's activations would not fit
    cuda_graphs: str = "auto"  # capture each step on a GPU: auto (where it can), on (or fail), off
    pack: bool = False
    max_seq_len: int = 512
    pad_id: int = 0
    seed: int = 0
    save_every: int = 0  # optimizer steps between checkpoints; 0: only at the end
    lora_path: Optional[Path] = None  # where checkpoints go; None: nowhere (library use)
    shard: bool = False  # under torchrun: FSDP2 shards the base and the trainable (`juno_py.train.sharded`)
    prefetch: Optional[int] = None  # sharded: blocks gathered ahead (None: 1 on a GPU, 0 on the CPU)


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
    peak_gpu: Optional[int] = None  # bytes, max_memory_allocated of the run's CUDA device; None off CUDA

    def summary(self) -> str:
        val = (
            f"; best validation {self.best_validation:.4f} at step {self.best_step}"
            if self.best_validation is not None
            else ""
        )
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"trained {self.steps} steps ({self.epochs:.1f} epochs, {self.tokens} tokens) in {self.seconds:.1f} s, "
            f"{rate:.0f} tokens/s; loss {self.first_loss:.4f} -> {self.last_loss:.4f}{val}; "
            f"stopped: {self.stop_reason}; peak RSS {format_bytes(self.peak_rss)}"
            + (f", peak GPU {format_bytes(self.peak_gpu)}" if self.peak_gpu is not None else "")
        )


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


def data_fingerprint(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(len(e.ids).to_bytes(4, "little"))
        h.update(torch.tensor(e.ids, dtype=torch.int64).numpy().tobytes())
        h.update(bytes(e.supervised))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------- the loop
def train(
    model,
    trainable: Trainable,
    train_set: Sequence[Example],
    cfg: TrainConfig,
    val_set: Sequence[Example] = (),
    recorder: Optional[MetricsRecorder] = None,
    resume: bool = False,
    stop_requested: Optional[Callable[[], bool]] = None,
    progress: Optional[bool] = None,
    log: Optional[Callable[[str], None]] = None,
    optimizer: Union[TrainOptimizer, torch.optim.Optimizer, Callable[[], object], None] = None,
    progress_interval: float = DEFAULT_INTERVAL,
    thread_guard: Optional[StallGuard] = None,
) -> TrainResult:
    """Train `trainable` (set up on `model`) on `train_set`; see TrainConfig for every knob.

    `stop_requested()` is asked after each step (Ctrl-C sets it): the run saves and returns. `progress`: None
    shows a tqdm bar on stderr when it is a terminal, else one line (step, loss, tokens/s, ETA, memory) every
    `progress_interval` seconds and at the end; True: the bar; False: nothing. `log` receives one-line messages
    (default: stderr).
    `trainable`: the adapters attached to the model or dense weights for full training
    (`juno_py.train.dense.densify`). `optimizer`: default AdamW over the trainable's groups; a `TrainOptimizer` may
    report the step's norm itself (GaLore's per-layer mode updates during backward and frees gradients); a torch
    optimizer with Adam's state runs as it is (`optim.TorchOptimizer`); a function of no arguments that returns one is
    called once the model is set up (after `cfg.shard`'s FSDP2 replaced the parameters by their shards: a sharded
    run takes its optimizer this way). `thread_guard`: told each step's wall time
    and tokens, it drops CPU threads when steps stall (`juno_py.threads.StallGuard`); each change is logged and
    recorded as a "threads" event.
    """
    if not train_set:
        raise ValueError("no training examples")
    world = distributed.current()  # the data-parallel ranks under torchrun, else a single process
    say = (log or (lambda msg: print(msg, file=sys.stderr))) if world.is_main else (lambda msg: None)
    recorder = recorder or MetricsRecorder(Identity())
    sharded = _shard(model, trainable, cfg, world, optimizer) if cfg.shard else None
    materialize = getattr(trainable, "materialize", None)  # dense weights left undecoded for sharding
    if sharded is None and materialize is not None:
        materialize()
    if callable(optimizer):
        optimizer = cast(Union[TrainOptimizer, torch.optim.Optimizer], optimizer())
    params = list(trainable.parameters())
    names = {id(p): n for n, p in trainable.named_parameters()}
    optimizer = (
        as_train_optimizer(optimizer)
        if optimizer is not None
        else build_optimizer(trainable, cfg.lr, cfg.weight_decay, cfg.plus_ratio)
    )
    model.checkpoint_blocks = resolve_checkpointing(
        model, cfg.grad_checkpoint, cfg.batch_size * cfg.max_seq_len, cfg.bptt_window
    )
    if model.checkpoint_blocks and cfg.grad_checkpoint is None:
        say(f"activation checkpointing on: micro-batches of up to {cfg.batch_size} x {cfg.max_seq_len} tokens")
    torch.manual_seed(cfg.seed)  # dropout

    def plan(epoch: int):
        return plan_epoch(train_set, cfg.batch_size, cfg.seed, epoch, cfg.pack, cfg.max_seq_len)

    # how long the run is: --max-steps, else --epochs, whichever comes first when both are given
    steps_per_epoch = math.ceil(len(plan(0)) / cfg.accumulation)
    total_steps = cfg.max_steps if cfg.max_steps is not None else None
    epoch_steps = None
    if cfg.epochs is not None:
        epoch_steps = sum(math.ceil(len(plan(e)) / cfg.accumulation) for e in range(cfg.epochs))
        total_steps = epoch_steps if total_steps is None else min(total_steps, epoch_steps)
    if total_steps is None:
        raise ValueError("give --max-steps or --epochs: the run needs an end")
    # how long the schedule is: the run's planned length (--schedule-steps, else the epochs), not where --max-steps
    # stops it, so a run stopped there and resumed with a larger --max-steps continues the same schedule
    schedule_steps = cfg.schedule_steps or epoch_steps or total_steps
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    schedule = {
        "kind": cfg.schedule,
        "steps": schedule_steps,
        "warmup_steps": cfg.warmup_steps,
        "lr": cfg.lr,
        "min_lr": cfg.min_lr,
    }

    # the settings a resume must share with the run it continues
    identity = {
        "data": data_fingerprint(train_set),
        "params": sorted(names.values()),
        "shapes": [list(p.shape) for p in params],
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "accumulation": cfg.accumulation,
        "pack": cfg.pack,
        "max_seq_len": cfg.max_seq_len,
    }
    if world.active:  # every rank must plan the same epochs from the same data
        distributed.check_same_data(
            world, {"training data": identity["data"], "validation data": data_fingerprint(val_set)}
        )
    run = RunState()
    best_weights: Optional[list[torch.Tensor]] = None
    if resume:
        best_weights, saved_schedule = _restore(
            cfg, run, params, names, optimizer, identity, trainable.state_format, sharded
        )
        say(f"resumed from {state_path(cfg.lora_path)} at step {run.step} (epoch {run.epoch}, batch {run.batch})")
        if saved_schedule is not None and saved_schedule != schedule:
            changed = ", ".join(
                f"{k} {saved_schedule.get(k)} -> {v}" for k, v in schedule.items() if saved_schedule.get(k) != v
            )
            say(f"note: the learning-rate schedule differs from the saved run's ({changed}); the rates follow this one")
    trainable.start_run()
    fmt = trainable.state_format
    start_step = run.step
    # the last weights whose loss was finite and not exploded: (step, loss, a copy of the weights); not kept when
    # the optimizer updates during backward (the weights change before the step's loss is known)
    good: Optional[tuple[int, float, list[torch.Tensor]]] = None
    keep_good = not optimizer.updates_in_backward
    # where the weights go: the trainable's own file, else (juno-py full) the resume state (sharded: each rank's)
    writes_file = getattr(trainable, "writes_file", True)
    if cfg.lora_path is None:
        own_bytes = 0
    elif sharded is not None:  # the adapter's whole tensors live across the ranks: their fp32 bytes and a margin
        own_bytes = sum(4 * p.numel() for p in params) + STATE_SLACK_BYTES if writes_file else 0
    else:
        own_bytes = trainable.saved_bytes()
    if cfg.lora_path is None:
        where = None
    elif own_bytes:
        where = cfg.lora_path
    else:
        where = (
            state_path(cfg.lora_path) if sharded is None else shard_state_path(cfg.lora_path, world.rank, world.size)
        )
    if cfg.lora_path is not None and world.is_main:
        _reserve_outputs(cfg, own_bytes, optimizer, params, bool(val_set))

    def bounded() -> bool:
        return _bounded(params, world, sharded)

    def checkpoint(why: str) -> None:
        if cfg.lora_path is None:
            return
        if sharded is not None:
            return sharded_checkpoint(why)
        if not world.is_main:  # rank 0 writes; the others wait for it, so no failure elsewhere cuts a save short
            return world.barrier()
        t0 = time.perf_counter()
        try:
            written = trainable.save(cfg.lora_path)  # None: the resume state holds the weights
            _save(state_path(cfg.lora_path), run, params, names, optimizer, identity, best_weights, schedule, fmt)
        except OSError as e:
            rescued = _rescue(cfg.lora_path, trainable, run, params, names, optimizer, identity, best_weights, schedule)
            raise OutputError(f"{cfg.lora_path}: cannot write ({reason(e)}); {rescued}") from e
        size = Path(written or state_path(cfg.lora_path)).stat().st_size
        recorder.emit(
            "checkpoint",
            step=run.step,
            path=str(cfg.lora_path),
            bytes=size,
            reason=why,
            ms=1e3 * (time.perf_counter() - t0),
        )
        if why == "save-every":  # space for the next checkpoint
            try:
                _reserve_outputs(cfg, own_bytes, optimizer, params, bool(val_set))
            except OutputError as e:
                say(f"juno-py: warning: {e}")
        world.barrier()

    def sharded_checkpoint(why: str) -> None:
        """Every rank writes its shard of the resume state (atomically); the adapter's whole tensors are gathered
        and rank 0 writes adapter.bin, the file one process writes (dense weights write no file of their own: the
        shards are the checkpoint)."""
        assert sharded is not None and cfg.lora_path is not None
        t0 = time.perf_counter()
        where = shard_state_path(cfg.lora_path, world.rank, world.size)
        _save(where, run, params, names, optimizer, identity, best_weights, schedule, trainable.state_format, sharded)
        values = {n: sharded.full(p) for n, p in trainable.named_parameters()} if writes_file else {}  # collectives
        world.barrier()  # every shard is written before adapter.bin names the step
        if world.is_main:
            written = trainable.save(cfg.lora_path, values) if writes_file else None  # type: ignore[call-arg]
            recorder.emit(
                "checkpoint",
                step=run.step,
                path=str(cfg.lora_path),
                bytes=Path(written or where).stat().st_size,
                reason=why,
                ms=1e3 * (time.perf_counter() - t0),
            )
        world.barrier()

    def validate() -> Optional[dict]:
        if not val_set:
            return None
        # the same on every rank
        v = distributed.evaluate(model, val_set, cfg.batch_size, cfg.pad_id, world, sharded=sharded is not None)
        improved = run.best_val is None or v["loss"] < run.best_val - cfg.min_delta
        if improved:
            nonlocal best_weights
            run.best_val, run.best_step, run.bad_evals = v["loss"], run.step, 0
            best_weights = [p.detach().clone() for p in params]
        else:
            run.bad_evals += 1
        run.last_val_step = run.step
        recorder.emit(
            "validation",
            step=run.step,
            loss=v["loss"],
            ppl=v["ppl"],
            tokens=v["tokens"],
            best=run.best_val,
            improved=improved,
        )
        return v

    model.train()
    trainable.train()
    # DDP, FSDP2 (sharded), or None
    net = sharded if sharded is not None else distributed.wrap(model, world, optimizer.updates_in_backward)
    graphs = None
    if resolve_graphs(cfg.cuda_graphs, graph_blocker(model, cfg, net, optimizer, trainable)):
        graphs = GraphedSteps(model, trainable, functools.partial(model_loss, model), log=say)
    step_fn = functools.partial(forward_backward, graphs=graphs)
    bar = Progress(total_steps, "train", "step", run.step, progress if world.is_main else False, progress_interval)
    started = time.perf_counter() - run.seconds
    resumed_at = (run.tokens, run.seconds)
    stop_reason = None
    batches, batches_epoch = [], None
    try:
        while stop_reason is None:
            if run.step >= total_steps:
                stop_reason = "max steps" if cfg.max_steps is not None and run.step >= cfg.max_steps else "epochs"
                break
            # --- the group of micro-batches of this step
            t_step = time.perf_counter()
            if batches_epoch != run.epoch:
                batches, batches_epoch = plan(run.epoch), run.epoch
            step_batches = batches[run.batch : run.batch + cfg.accumulation]
            share = distributed.StepShare(
                step_batches, cfg.batch_size, cfg.pad_id, world, cfg.seed, run.step, sharded=sharded is not None
            )
            n_sup, n_tok = share.n_supervised, share.n_tokens  # of the global batch, all ranks together
            lrs = set_learning_rates(
                optimizer, lr_factor(cfg.schedule, run.step, schedule_steps, cfg.warmup_steps, min_ratio)
            )
            times: dict = {}
            note = trainable.before_step()
            if note is not None:
                recorder.emit(note.event, step=run.step, **note.values)

            # --- forward and backward; nothing is updated before every number is known to be finite
            moe_load = getattr(model, "expert_load", None)
            if moe_load is not None:
                moe_load(reset=True)  # the router's load of this step only (not of a validation pass)
            try:
                loss_sum = share.forward_backward(step_fn, model, net, cfg.bptt_window, times)
                if not math.isfinite(loss_sum):
                    raise TrainingDiverged(f"the loss is {loss_sum}")
                step_loss = loss_sum / max(n_sup, 1)
                reference = run.first_loss if not math.isnan(run.first_loss) else step_loss
                if keep_good and step_loss <= EXPLODED_RATIO * max(reference, 1.0) and bounded():
                    good = _remember(good, run.step, step_loss, params)
                norm = sharded.grad_norm(params) if sharded is not None else optimizer.grad_norm(params)
                if not math.isfinite(norm):
                    raise TrainingDiverged(f"the gradient norm is {norm}")
            except TrainingDiverged as e:
                optimizer.zero_grad(set_to_none=True)
                kept = _keep_last_good(checkpoint, params, where, good, start_step, optimizer.updates_in_backward)
                raise TrainingDiverged(f"step {run.step + 1}: {e}: stopped before the optimizer step; {kept}") from None

            # --- clip, step
            t_opt = time.perf_counter()
            clipped = cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm
            if clipped:
                scale = cfg.max_grad_norm / (norm + 1e-6)
                _scale_all([p.grad for p in params if p.grad is not None], scale)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trainable.after_optimizer_step()
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
            step_seconds = time.perf_counter() - t_step
            if thread_guard is not None:
                before = thread_guard.threads
                after = thread_guard.observe(time.perf_counter() - t_step, n_tok)
                if after != before:
                    say(f"step {run.step}: {after} CPU threads from now on (were {before}: the steps' wall time)")
                    recorder.emit("threads", step=run.step, threads=after, previous=before)
            recorder.emit(
                "train_step",
                step=run.step,
                epoch=run.epoch,
                tokens=n_tok,
                supervised_tokens=n_sup,
                loss=loss,
                grad_norm=norm,
                clipped=clipped,
                lr_a=lrs.get("A", lrs.get("weights", 0.0)),
                lr_b=lrs.get("B", 0.0),
                step_ms=1e3 * step_seconds,
                tokens_per_s=n_tok / max(step_seconds, 1e-9),
                **times,
            )
            if moe_load is not None:
                from juno_py.models.moe import load_summary

                load = load_summary(moe_load(reset=True))
                if load:
                    recorder.emit("expert_load", step=run.step, **load)
            bar.update(1, f"loss {loss:.4f} | {_rate_since_start(run, resumed_at):.0f} tokens/s")

            # --- validation and stop rules
            due = run.step % cfg.validation_every == 0 if cfg.validation_every else epoch_done
            v = validate() if due else None
            if v is not None:
                say(
                    f"step {run.step}: validation loss {v['loss']:.4f} (best {run.best_val:.4f} at step "
                    f"{run.best_step})"
                )
                if cfg.patience and run.bad_evals >= cfg.patience:
                    stop_reason = f"validation patience ({cfg.patience} validations without improvement)"
                elif cfg.overfit_ratio and v["loss"] > run.best_val * cfg.overfit_ratio:
                    stop_reason = (
                        f"overfit guard (validation loss {v['loss']:.4f} > {cfg.overfit_ratio} x best "
                        f"{run.best_val:.4f})"
                    )
            if stop_reason is None and cfg.loss_target is not None and len(run.recent) >= steps_per_epoch:
                recent = sum(s for s, _ in run.recent) / max(1, sum(n for _, n in run.recent))
                if recent <= cfg.loss_target:
                    stop_reason = f"loss target ({recent:.4f} <= {cfg.loss_target} over the last epoch)"
            if stop_reason is None and stop_requested is not None and stop_requested():
                stop_reason = "interrupted"
            stop_reason = distributed.agree_stop(stop_reason, world)
            if stop_reason is None and cfg.save_every and run.step % cfg.save_every == 0:
                if keep_good and not bounded():  # an adapter file could not even hold them
                    say(f"step {run.step}: weights above {MAX_WEIGHT:g} in magnitude; checkpoint skipped")
                else:
                    checkpoint("save-every")
    except BaseException:
        bar.close(aborted=True)
        if cfg.lora_path is not None:  # give the reserved space back
            release(cfg.lora_path)
            release(state_path(cfg.lora_path))
        raise
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
    try:
        if keep_good and not bounded():  # exploded without a non-finite number along the way
            kept = _keep_last_good(checkpoint, params, where, good, start_step)
            raise TrainingDiverged(f"after step {run.step}: weights above {MAX_WEIGHT:g} in magnitude; {kept}")
        checkpoint("interrupted" if stop_reason == "interrupted" else "final")
    finally:
        if cfg.lora_path is not None:
            release(cfg.lora_path)
            release(state_path(cfg.lora_path))
    return TrainResult(
        run.step,
        run.epoch + run.batch / max(1, len(plan(run.epoch))),
        run.tokens,
        run.seconds,
        stop_reason,
        run.first_loss,
        run.last_loss,
        run.best_val,
        run.best_step,
        peak_rss_bytes(),
        _peak_gpu_bytes(trainable.parameters()),
    )


def _peak_gpu_bytes(params) -> Optional[int]:
    """The CUDA allocator's peak on the device of the trained weights since the process started (None off CUDA)."""
    device = next(iter(params), torch.empty(0)).device
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _bounded(params, world: distributed.World = distributed.SINGLE, sharded=None) -> bool:
    """Whether every weight is at most MAX_WEIGHT in magnitude (one read from the device; sharded: every rank's
    parts, the ranks agreeing)."""
    # a rank's part (a plain tensor) may be empty
    parts = [t for t in (local_part(p).detach() for p in params) if t.numel()]
    peaks = list(torch._foreach_norm(parts, math.inf)) if parts else []  # one launch, not one per parameter
    ok = bool(torch.stack(peaks).max() <= MAX_WEIGHT) if peaks else True
    if sharded is not None:
        ok = world.max(0 if ok else 1) == 0
    return ok


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Whether these are plain tensors, which torch's multi-tensor (`_foreach_`) ops take in one launch; a sharded
    run's parameters and gradients are DTensors, which have no sharding rule for some of them."""
    return all(type(t) is torch.Tensor for t in tensors)


def _scale_all(tensors: list[torch.Tensor], scale: float) -> None:
    """Multiply every tensor by `scale` in place: one multi-tensor launch for plain tensors."""
    if _plain(tensors):
        torch._foreach_mul_(tensors, scale)
        return
    for t in tensors:
        t.mul_(scale)


def _remember(good, step: int, loss: float, params) -> tuple[int, float, list[torch.Tensor]]:
    """Copy the weights into the buffers of the last good weights (allocated once)."""
    buffers = good[2] if good is not None else [torch.empty_like(p) for p in params]
    sources = [p.detach() for p in params]
    with torch.no_grad():
        if _plain(sources):
            torch._foreach_copy_(buffers, sources)  # one launch, not one per parameter
        else:
            for b, p in zip(buffers, sources):
                b.copy_(p)
    return step, loss, buffers


def _keep_last_good(
    checkpoint: Callable[[str], None],
    params,
    where: Optional[Path],
    good: Optional[tuple[int, float, list[torch.Tensor]]],
    start_step: int,
    partial: bool = False,
) -> str:
    """After a divergence: put back the last weights whose loss was finite and not exploded, and save them at
    `where` (None: nowhere); when no step of this run produced such weights, save nothing. Returns what was done,
    for the message."""
    on_disk = where is not None and Path(where).exists()
    kept = f"the last checkpoint {where} is kept as it was" if on_disk else "nothing was saved"
    if partial:
        return f"per-layer updates had already changed some weights during this backward pass; {kept}"
    if good is None or good[0] == start_step:
        return (
            f"no step of this run left good weights (a finite loss at most {EXPLODED_RATIO:g}x the first, values at "
            f"most {MAX_WEIGHT:g}); {kept}"
        )
    step, loss, weights = good
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    what = f"the last good weights (after step {step}, loss {loss:.4f})"
    if where is None:
        return f"the trained weights are {what}"
    checkpoint("diverged")
    return f"{what} are saved in {where}"


def _rate_since_start(run: RunState, resumed_at: tuple[int, float]) -> float:
    """Tokens per second since this process started training (a resumed run's earlier time is not counted)."""
    tokens, seconds = resumed_at
    return (run.tokens - tokens) / max(run.seconds - seconds, 1e-9)


def _shard(model, trainable: Trainable, cfg: TrainConfig, world: distributed.World, optimizer) -> ShardedModel:
    """FSDP2 over the model's blocks (`juno_py.train.sharded`), for adapters or dense targets (whose deferred
    weights are decoded block by block, each just before its block is sharded)."""
    from juno_py.lora.adapters import AdapterSet
    from juno_py.train.dense import DenseTargets
    from juno_py.train.sharded import shard

    if not isinstance(trainable, (AdapterSet, DenseTargets)):
        raise distributed.DistributedError(
            f"--shard trains adapters (juno-py lora) or dense targets (juno-py full), not a {type(trainable).__name__}"
        )
    if optimizer is not None and not callable(optimizer):
        raise distributed.DistributedError(
            "--shard replaces the parameters by their shards: pass the optimizer as a function that builds it "
            "(train(..., optimizer=lambda: build_dense_optimizer(...))), or none for the loop's AdamW"
        )
    if cfg.bptt_window:
        raise distributed.DistributedError("--shard with --bptt-window: train whole sequences (--bptt-window 0)")
    before_block = trainable.materialize if isinstance(trainable, DenseTargets) else None
    return shard(model, world, cfg.prefetch, before_block=before_block)


# ------------------------------------------------------------------------------------------- resume state
def _reserve_outputs(cfg: TrainConfig, own: int, optimizer: TrainOptimizer, params, keep_best: bool) -> None:
    """Hold disk space for the next checkpoint: the trainable's file (`own` bytes) and the resume state (weights,
    the best weights when validating, the optimizer's state), so that a disk filling up cannot take it."""
    weights = sum(p.numel() * p.element_size() for p in params)
    state = weights * (2 if keep_best else 1) + optimizer.state_bytes(params) + STATE_SLACK_BYTES
    try:
        if own:
            reserve(cfg.lora_path, own)
        reserve(state_path(cfg.lora_path), state)
    except OutputError:
        release(cfg.lora_path)
        raise


def _rescue(target, trainable: Trainable, run, params, names, optimizer, identity, best_weights, schedule) -> str:
    """The weights saved where they can be when `target` cannot be written: $JUNO_PY_HOME/rescued/, else the
    current folder, else the temporary folder. Returns where, as the end of the error message."""
    import tempfile

    from juno_py.store import home

    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(target).name}"
    for folder in (home() / "rescued", Path.cwd(), Path(tempfile.gettempdir())):
        path = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            written = trainable.save(path)
            fmt = trainable.state_format
            _save(state_path(path), run, params, names, optimizer, identity, best_weights, schedule, fmt)
        except OSError:
            for p in (path, state_path(path)):
                p.unlink(missing_ok=True)
            continue
        saved = f"{path} (resume state {state_path(path)})" if written else str(state_path(path))
        return f"the trained weights are saved in {saved}; move them to the target, or resume with that path"
    return "the trained weights could not be saved anywhere"


def _save(
    where: Path,
    run: RunState,
    params,
    names,
    optimizer: TrainOptimizer,
    identity: dict,
    best_weights,
    schedule: dict,
    fmt: str,
    sharded: Optional[ShardedModel] = None,
) -> None:
    """The resume state; sharded: this rank's parts of every tensor, at `where`."""
    tensors, steps = optimizer.state_tensors(names)
    for p in params:
        tensors[f"param/{names[id(p)]}"] = p
    if best_weights is not None:
        for p, w in zip(params, best_weights):
            tensors[f"best/{names[id(p)]}"] = w
    tensors = {k: local_part(v) for k, v in tensors.items()}
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"identity": identity, "run": run.__dict__, "adam_steps": steps, "schedule": schedule}
    if sharded is not None:
        meta["shard"] = {"rank": sharded.world.rank, "world_size": sharded.world.size}
    save_state(where, tensors, meta, fmt)


def _read_shard(cfg: TrainConfig, sharded: ShardedModel, fmt: str) -> tuple[Path, dict, dict]:
    """This rank's shard of a sharded resume state, checked to belong to this world and to the others' step."""
    world = sharded.world
    where = shard_state_path(cfg.lora_path, world.rank, world.size)
    if not where.exists():
        others = sorted(where.parent.glob(Path(str(state_path(cfg.lora_path))).name + ".rank*"))
        found = f"; found {', '.join(o.name for o in others[:3])}" if others else ""
        raise StateError(
            f"{where}: no sharded resume state for rank {world.rank} of {world.size}{found}; a sharded run resumes "
            f"sharded on as many processes as wrote it"
        )
    tensors, meta = load_state(where, fmt)
    shard = meta.get("shard", {})
    if shard != {"rank": world.rank, "world_size": world.size}:
        raise StateError(f"{where}: field 'shard' is {_short(shard)}, expected rank {world.rank} of {world.size}")
    step = int(meta.get("run", {}).get("step", -1))
    if not world.same(step):
        raise StateError(
            f"{where}: the ranks' resume states are of different steps (rank {world.rank}: step {step}); a save "
            f"was cut short: resume from an earlier copy"
        )
    return where, tensors, meta


def _restore(
    cfg: TrainConfig,
    run: RunState,
    params,
    names,
    optimizer: TrainOptimizer,
    identity: dict,
    fmt: str,
    sharded: Optional[ShardedModel] = None,
):
    if cfg.lora_path is None:
        raise StateError("--resume needs --lora-path (its .state file holds the run)")
    if sharded is not None:
        where, tensors, meta = _read_shard(cfg, sharded, fmt)
        by_name = {names[id(p)]: p for p in params}
        for key in list(tensors):  # this rank's parts, as parts of the sharded tensors
            name = key.split("/", 1)[1].rsplit("/", 1)[0] if key.startswith("adam/") else key.split("/", 1)[-1]
            if key.split("/", 1)[0] in ("param", "best", "adam") and name in by_name:
                tensors[key] = sharded_like(tensors[key], by_name[name], str(where), key)
    else:
        where = state_path(cfg.lora_path)
        tensors, meta = distributed.read_state(where, fmt)  # rank 0 reads, every rank gets it
    saved = meta.get("identity", {})
    for key, value in identity.items():
        if saved.get(key) != value:
            raise StateError(
                f"{where}: the run's {key} differs from this one's ({_short(saved.get(key))} vs "
                f"{_short(value)}); resume with the same data and settings"
            )
    with torch.no_grad():
        for p in params:
            p.copy_(tensors[f"param/{names[id(p)]}"])
    optimizer.load_state_tensors(names, tensors, meta["adam_steps"], str(where))
    for k, v in meta["run"].items():
        setattr(run, k, [tuple(x) for x in v] if k == "recent" else v)
    torch.set_rng_state(tensors["rng/torch"])
    best = None
    if f"best/{names[id(params[0])]}" in tensors:
        best = [tensors[f"best/{names[id(p)]}"].clone() for p in params]
    return best, meta.get("schedule")


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
