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
from typing import Callable, Optional, Sequence, Union

import torch

from juno_py.metrics import Identity, MetricsRecorder, format_bytes, peak_rss_bytes, rss_bytes
from juno_py.threads import StallGuard
from juno_py.train import distributed
from juno_py.train.cuda_graph import GraphedSteps, graph_blocker, resolve_graphs
from juno_py.train.data import Example, plan_epoch
from juno_py.train.optim import TrainOptimizer, as_train_optimizer, build_optimizer, lr_factor, set_learning_rates
from juno_py.train.state import StateError, save_state, state_path
from juno_py.train.steps import TrainingDiverged, forward_backward, model_loss
from juno_py.train.trainable import Trainable


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
    optimizer: Union[TrainOptimizer, torch.optim.Optimizer, None] = None,
    thread_guard: Optional[StallGuard] = None,
) -> TrainResult:
    """Train `trainable` (set up on `model`) on `train_set`; see TrainConfig for every knob.

    `stop_requested()` is asked after each step (Ctrl-C sets it): the run saves and returns. `progress`: a tqdm
    bar on stderr (None: when stderr is a terminal). `log` receives one-line messages (default: stderr).
    `trainable`: the adapters attached to the model or dense weights for full training
    (`juno_py.train.dense.densify`). `optimizer`: default AdamW over the trainable's groups; a `TrainOptimizer` may
    report the step's norm itself (GaLore's per-layer mode updates during backward and frees gradients); a torch
    optimizer with Adam's state runs as it is (`optim.TorchOptimizer`). `thread_guard`: told each step's wall time
    and tokens, it drops CPU threads when steps stall (`juno_py.threads.StallGuard`); each change is logged and
    recorded as a "threads" event.
    """
    if not train_set:
        raise ValueError("no training examples")
    world = distributed.current()  # the data-parallel ranks under torchrun, else a single process
    say = (log or (lambda msg: print(msg, file=sys.stderr))) if world.is_main else (lambda msg: None)
    recorder = recorder or MetricsRecorder(Identity())
    params = list(trainable.parameters())
    names = {id(p): n for n, p in trainable.named_parameters()}
    optimizer = (
        as_train_optimizer(optimizer)
        if optimizer is not None
        else build_optimizer(trainable, cfg.lr, cfg.weight_decay, cfg.plus_ratio)
    )
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
        best_weights = _restore(cfg, run, params, names, optimizer, identity, trainable.state_format)
        say(f"resumed from {state_path(cfg.lora_path)} at step {run.step} (epoch {run.epoch}, batch {run.batch})")
    trainable.start_run()

    def checkpoint(reason: str) -> None:
        if cfg.lora_path is None:
            return
        if not world.is_main:  # rank 0 writes; the others wait for it, so no failure elsewhere cuts a save short
            return world.barrier()
        t0 = time.perf_counter()
        written = trainable.save(cfg.lora_path)  # None: the resume state holds the weights
        _save(cfg, run, params, names, optimizer, identity, best_weights, trainable.state_format)
        size = Path(written or state_path(cfg.lora_path)).stat().st_size
        recorder.emit(
            "checkpoint",
            step=run.step,
            path=str(cfg.lora_path),
            bytes=size,
            reason=reason,
            ms=1e3 * (time.perf_counter() - t0),
        )
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
    net = distributed.wrap(model, world, optimizer.updates_in_backward)  # DDP, or None
    graphs = None
    if resolve_graphs(cfg.cuda_graphs, graph_blocker(model, cfg, net, optimizer, trainable)):
        graphs = GraphedSteps(model, trainable, functools.partial(model_loss, model), log=say)
    step_fn = functools.partial(forward_backward, graphs=graphs)
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
            t_step = time.perf_counter()
            if batches_epoch != run.epoch:
                batches, batches_epoch = plan(run.epoch), run.epoch
            step_batches = batches[run.batch : run.batch + cfg.accumulation]
            share = distributed.StepShare(step_batches, cfg.batch_size, cfg.pad_id, world, cfg.seed, run.step)
            n_sup, n_tok = share.n_supervised, share.n_tokens  # of the global batch, all ranks together
            lrs = set_learning_rates(
                optimizer, lr_factor(cfg.schedule, run.step, total_steps, cfg.warmup_steps, min_ratio)
            )
            times: dict = {}
            note = trainable.before_step()
            if note is not None:
                recorder.emit(note.event, step=run.step, **note.values)

            # --- forward and backward; nothing is updated before every number is known to be finite
            try:
                loss_sum = share.forward_backward(step_fn, model, net, cfg.bptt_window, times)
                if not math.isfinite(loss_sum):
                    raise TrainingDiverged(f"the loss is {loss_sum}")
                norm = optimizer.grad_norm(params)
                if not math.isfinite(norm):
                    raise TrainingDiverged(f"the gradient norm is {norm}")
            except TrainingDiverged as e:
                optimizer.zero_grad(set_to_none=True)
                kept = _keep_last_good(checkpoint, params, cfg, optimizer.updates_in_backward)
                raise TrainingDiverged(f"step {run.step + 1}: {e}: stopped before the optimizer step; {kept}") from None

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
                **times,
            )
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(
                    f"loss {loss:.4f} | {run.tokens / max(run.seconds, 1e-9):.0f} tok/s | "
                    f"RSS {format_bytes(rss_bytes())}",
                    refresh=False,
                )

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
    )


def _keep_last_good(checkpoint: Callable[[str], None], params, cfg: TrainConfig, partial: bool = False) -> str:
    """After a divergence: the trainable still holds the last good step's weights; save them if they are finite.
    `partial`: the optimizer updated some weights during this step's backward (per-layer mode), so the weights
    are not the last good step's: the last checkpoint stays."""
    if partial:
        where = f"the last checkpoint {cfg.lora_path} is kept as it was" if cfg.lora_path else "nothing was saved"
        return f"per-layer updates had already changed some weights during this backward pass; {where}"
    if cfg.lora_path is None:
        return "the trained weights are the last good step's"
    if all(bool(torch.isfinite(p).all()) for p in params):
        checkpoint("diverged")
        return f"the last good weights are saved in {cfg.lora_path}"
    return f"the weights are not finite; the last checkpoint {cfg.lora_path} is kept as it was"


def _progress_bar(total: int, initial: int, progress: Optional[bool]):
    from tqdm import tqdm

    disable = None if progress is None else not progress  # None: only on a terminal
    return tqdm(
        total=total, initial=initial, file=sys.stderr, disable=disable, unit="step", dynamic_ncols=True, desc="train"
    )


# ------------------------------------------------------------------------------------------- resume state
def _save(
    cfg: TrainConfig, run: RunState, params, names, optimizer: TrainOptimizer, identity: dict, best_weights, fmt: str
) -> None:
    tensors, steps = optimizer.state_tensors(names)
    for p in params:
        tensors[f"param/{names[id(p)]}"] = p
    if best_weights is not None:
        for p, w in zip(params, best_weights):
            tensors[f"best/{names[id(p)]}"] = w
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"identity": identity, "run": run.__dict__, "adam_steps": steps}
    save_state(state_path(cfg.lora_path), tensors, meta, fmt)


def _restore(cfg: TrainConfig, run: RunState, params, names, optimizer: TrainOptimizer, identity: dict, fmt: str):
    if cfg.lora_path is None:
        raise StateError("--resume needs --lora-path (its .state file holds the run)")
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
    if f"best/{names[id(params[0])]}" in tensors:
        return [tensors[f"best/{names[id(p)]}"].clone() for p in params]
    return None


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
