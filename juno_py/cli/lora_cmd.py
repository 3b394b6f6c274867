"""`juno-py lora`: train a LoRA or DoRA adapter on a quantized GGUF model. stdout: the adapter's path only."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from juno_py.cli.main import cli, one_line_errors
from juno_py.store import DEFAULT_MODEL

DEFAULTS = dict(rank=32, alpha=64.0, targets="all", lr=2e-3, epochs=8, batch_size=4, qa_variants=4)


_quiet = False  # under torchrun, ranks other than 0 keep quiet (errors still reach stderr)


def _say(msg: str) -> None:
    if not _quiet:
        click.echo(msg, err=True)


class _StopFlag:
    """First Ctrl-C: finish the step, save, exit cleanly. Second: stop at once (the last checkpoint stays)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame):
        self.requested = True
        _say("juno-py: interrupted: finishing this step, then saving (Ctrl-C again to stop without saving)")
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


def load_training_model(o: dict, model_file):
    """The model as the training commands open it (`juno-py lora`, `juno-py full`): compute dtype and weights
    cache resolved from their options."""
    from juno_py.models import load_model
    from juno_py.train.setup import resolve_compute_dtype, resolve_weights_cache

    compute = resolve_compute_dtype(o["compute_dtype"], o["device"])
    cache = resolve_weights_cache(o["weights_cache"], model_file, compute, o["device"])
    model = load_model(model_file, device=o["device"], weights_cache=cache, compute_dtype=compute)
    _say(f"model: {model_file} ({model.args.architecture}, {model.args.n_layer} layers); compute "
         f"{str(compute).removeprefix('torch.')}, weights cache {cache}")
    return model


def load_training_data(o: dict, model) -> tuple[list, list]:
    """Training and validation sequences from the data options (no --data: the built-in facts)."""
    from juno_py.train.data import BUILTIN_FACTS, load_dataset

    data = [Path(p) for p in o["data"]] or [BUILTIN_FACTS]
    if not o["data"]:
        _say(f"data: the built-in facts ({BUILTIN_FACTS}); set --data to train on your own")
    train_set, val_set, stats = load_dataset(
        data, model.tokenizer, o["max_seq_len"], o["qa_variants"], o["skip_bad_records"], o["validation_split"],
        o["seed"], o["system"], [Path(p) for p in o["validation_data"]])
    _say(f"data: {stats.line()}; {len(val_set)} validation sequences")
    if not train_set:
        raise click.UsageError("no training sequences left (all records dropped by --max-seq-len?)")
    return train_set, val_set


@cli.command("lora")
@click.option("--model-path", default=DEFAULT_MODEL, show_default=True,
              help="A .gguf file or a model-store name (pulled on first use).")
@click.option("--data", "data", multiple=True, type=click.Path(dir_okay=False),
              help="Training data: JSONL or a JSON array of {text}, {prompt, completion}, {messages} or {Q, A} "
                   "records, or a .txt file; repeat for several files (default: the built-in facts).")
@click.option("--validation-data", multiple=True, type=click.Path(dir_okay=False),
              help="Validation records (same formats) instead of --validation-split.")
@click.option("--validation-split", default=0.0, show_default=True, type=click.FloatRange(0, 0.9),
              help="Fraction of the records (whole records) held out for validation.")
@click.option("--lora-path", type=click.Path(dir_okay=False), default=None,
              help="Output adapter.bin (default: <model name>.adapter.bin in the current folder); its resume "
                   "state goes to <path>.state.")
@click.option("--lora-mode", type=click.Choice(["lora", "dora"]), default="lora", show_default=True,
              help="Plain LoRA, or DoRA (magnitude and direction).")
@click.option("--lora-targets", default=DEFAULTS["targets"], show_default=True,
              help="qv, all, attn, mlp, or a comma list of wq,wk,wv,wo,wgate,wup,wdown.")
@click.option("--lora-rank", default=DEFAULTS["rank"], show_default=True, type=click.IntRange(1), help="Rank r.")
@click.option("--lora-alpha", default=DEFAULTS["alpha"], show_default=True, type=float,
              help="Alpha: the scale is alpha/r (standard) or alpha/sqrt(r) (rslora).")
@click.option("--lora-scaling", type=click.Choice(["standard", "rslora"]), default="standard", show_default=True,
              help="How alpha and r give the scale.")
@click.option("--lora-init", type=click.Choice(["kaiming-uniform", "legacy-normal"]), default="kaiming-uniform",
              show_default=True, help="Initialisation of A (B starts at zero).")
@click.option("--lora-dropout", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Dropout on the adapter's input.")
@click.option("--lora-lr", default=DEFAULTS["lr"], show_default=True, type=click.FloatRange(0, min_open=True),
              help="Peak learning rate.")
@click.option("--lora-weight-decay", default=0.01, show_default=True, type=click.FloatRange(0),
              help="AdamW decoupled weight decay, on A only (never B or the DoRA magnitude).")
@click.option("--lora-plus-ratio", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="LoRA+: B's learning rate is this many times the rate of A.")
@click.option("--lora-schedule", type=click.Choice(["constant", "warmup-cosine"]), default="warmup-cosine",
              show_default=True, help="Learning-rate schedule.")
@click.option("--lora-warmup-steps", default=0, show_default=True, type=click.IntRange(0),
              help="Linear warmup steps.")
@click.option("--lora-min-lr", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Learning rate at the end of the cosine.")
@click.option("--batch-size", default=DEFAULTS["batch_size"], show_default=True, type=click.IntRange(1),
              help="Sequences (rows, when packed) per micro-batch.")
@click.option("--lora-gradient-accumulation", default=1, show_default=True, type=click.IntRange(1),
              help="Micro-batches per optimizer step; the loss is averaged over the group's supervised tokens.")
@click.option("--lora-max-grad-norm", default=1.0, show_default=True, type=click.FloatRange(0),
              help="Clip the global gradient L2 norm to this (0: no clipping).")
@click.option("--max-seq-len", default=512, show_default=True, type=click.IntRange(2),
              help="Longest sequence: longer texts are split, longer chat/prompt/Q&A records dropped (counted).")
@click.option("--max-steps", default=None, type=click.IntRange(1), help="Stop after this many optimizer steps.")
@click.option("--epochs", default=DEFAULTS["epochs"], show_default=True, type=click.IntRange(1),
              help="Passes over the training data.")
@click.option("--lora-loss-target", default=None, type=click.FloatRange(0),
              help="Stop once the training loss over the last epoch's worth of steps is at or below this.")
@click.option("--validation-every", default=None, type=click.IntRange(1),
              help="Validate every N optimizer steps (default: at the end of each epoch).")
@click.option("--lora-validation-patience", default=3, show_default=True, type=click.IntRange(0),
              help="Stop after this many validations without improvement (0: never); the best weights are kept.")
@click.option("--lora-validation-min-delta", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Smallest decrease of the validation loss that counts as an improvement.")
@click.option("--lora-overfit-ratio", default=1.25, show_default=True, type=click.FloatRange(0),
              help="Overfit guard: stop at once when the validation loss exceeds its best by this factor "
                   "(0: off); the best weights are kept.")
@click.option("--qa-variants", default=DEFAULTS["qa_variants"], show_default=True, type=click.IntRange(1, 8),
              help="Question rewordings per {Q, A} record.")
@click.option("--system", default=None, help="System prompt put in front of chat and Q&A records.")
@click.option("--pack/--no-pack", default=False, show_default=True,
              help="Pack several sequences per row (block-diagonal attention, per-document positions).")
@click.option("--skip-bad-records", is_flag=True, help="Skip malformed records (counted) instead of stopping.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of initialisation, shuffling, dropout.")
@click.option("--bptt-window", default=0, show_default=True, type=click.IntRange(0),
              help="Truncated backprop: windows of N tokens attend to earlier windows' cached K/V without "
                   "gradients (0: whole sequence, exact).")
@click.option("--grad-checkpoint", is_flag=True, help="Recompute each block in backward: less memory, more time.")
@click.option("--cuda-graphs", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="On a GPU, capture each training step (forward, loss, backward) as a CUDA graph once per batch "
                   "shape and replay it: one launch instead of thousands (auto: where the run allows it; not with "
                   "--grad-checkpoint, --bptt-window, dropout or several processes).")
@click.option("--compute-dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="Dtype of the frozen matmuls (auto: bf16 where the CPU has native bf16, and on a GPU, where "
                   "the activations run in bf16 too). Adapters and optimizer state stay fp32.")
@click.option("--weights-cache", type=click.Choice(["auto", "none", "bf16", "fp32"]), default="auto",
              show_default=True, help="Keep dequantized frozen weights resident (auto: bf16 for small models "
                                      "with bf16 compute) or stream them from the quantized bytes (none).")
@click.option("--device", default="cpu", show_default=True,
              help="Torch device; on cuda the base stays quantized on the GPU (Triton decodes it).")
@click.option("--threads", default=None, type=click.IntRange(1), help="CPU threads (default: torch's choice).")
@click.option("--nproc", default=None, type=click.IntRange(1),
              help="Data-parallel training on N processes on this host (one per GPU with --device cuda): runs "
                   "torchrun for you. Same global batch as one process. See docs/distributed.md.")
@click.option("--save-every", default=0, show_default=True, type=click.IntRange(0),
              help="Write the adapter and its resume state every N optimizer steps (0: at the end only).")
@click.option("--resume", is_flag=True, help="Continue from <lora-path>.state: weights, optimizer moments, step, "
                                             "schedule, RNG and data position.")
@click.option("--metrics-out", type=click.Path(dir_okay=False), default=None,
              help="Write a metrics.json summary (count, mean, last, p95 per series).")
@click.option("--events-out", type=click.Path(dir_okay=False), default=None,
              help="Append every metrics event as one JSON line.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: on a terminal).")
@one_line_errors
def lora(**o) -> None:
    """Train an adapter on a quantized GGUF model; the base stays quantized. Prints the adapter's path."""
    import torch

    from juno_py.lora import AdapterConfig, Init, Mode, Scaling, attach, parse_targets
    from juno_py.metrics import MetricsRecorder
    from juno_py.store import resolve_model
    from juno_py.train import distributed
    from juno_py.train.loop import TrainConfig, train
    from juno_py.train.setup import default_adapter_path, run_identity

    global _quiet
    if o["nproc"]:
        from juno_py.cli.launch import run_torchrun

        sys.exit(run_torchrun(click.get_current_context(), o["nproc"], o["device"]))
    world = distributed.init_from_env(o["device"])  # a rank of a torchrun job, or a single process
    _quiet = not world.is_main
    if world.active:
        o["device"] = str(world.device)
        _say(f"data parallel: {world.size} processes ({world.backend}); each takes its share of every global batch")
    if o["threads"]:
        torch.set_num_threads(o["threads"])
    model_file = distributed.local_first(world, resolve_model, o["model_path"])  # pulled once per host
    lora_path = Path(o["lora_path"]) if o["lora_path"] else default_adapter_path(o["model_path"], model_file)
    if not o["lora_path"]:
        _say(f"adapter: {lora_path} (set --lora-path to choose)")
    model = load_training_model(o, model_file)
    train_set, val_set = load_training_data(o, model)

    config = AdapterConfig(rank=o["lora_rank"], alpha=o["lora_alpha"], mode=Mode[o["lora_mode"].upper()],
                           scaling=Scaling[o["lora_scaling"].upper()],
                           init=Init[o["lora_init"].upper().replace("-", "_")], dropout=o["lora_dropout"])
    targets = parse_targets(o["lora_targets"])
    adapters = attach(model, targets, config, seed=o["seed"])
    _say(f"adapter: {o['lora_mode']} r={config.rank} alpha={config.alpha} on {','.join(targets)}, "
         f"{adapters.n_parameters():,} trainable parameters")

    recorder = MetricsRecorder(run_identity(model, config, targets, o["device"]),
                               o["events_out"] if world.is_main else None)
    cfg = TrainConfig(
        lr=o["lora_lr"], batch_size=o["batch_size"], accumulation=o["lora_gradient_accumulation"],
        max_grad_norm=o["lora_max_grad_norm"], weight_decay=o["lora_weight_decay"], plus_ratio=o["lora_plus_ratio"],
        schedule=o["lora_schedule"], warmup_steps=o["lora_warmup_steps"], min_lr=o["lora_min_lr"],
        max_steps=o["max_steps"], epochs=o["epochs"], loss_target=o["lora_loss_target"],
        validation_every=o["validation_every"], patience=o["lora_validation_patience"],
        min_delta=o["lora_validation_min_delta"], overfit_ratio=o["lora_overfit_ratio"],
        bptt_window=o["bptt_window"], grad_checkpoint=o["grad_checkpoint"], cuda_graphs=o["cuda_graphs"],
        pack=o["pack"],
        max_seq_len=o["max_seq_len"], pad_id=model.tokenizer.pad_id or 0, seed=o["seed"],
        save_every=o["save_every"], lora_path=lora_path)
    try:
        with _StopFlag() as stop:
            result = train(model, adapters, train_set, cfg, val_set, recorder, resume=o["resume"],
                           stop_requested=stop, progress=o["progress"], log=_say)
    except KeyboardInterrupt:
        _say(f"juno-py: stopped without saving; the last checkpoint ({lora_path}, if any) is kept")
        sys.exit(130)
    finally:
        if o["metrics_out"] and world.is_main:
            recorder.write_summary(o["metrics_out"])
        recorder.close()
    _say(result.summary())
    if result.stop_reason == "interrupted":
        _say(f"saved; continue with the same command and --resume (state: {lora_path}.state)")
    if world.is_main:
        click.echo(str(lora_path))
    distributed.shutdown()
