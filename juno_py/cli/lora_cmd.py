"""`juno-py lora`: train a LoRA or DoRA adapter on a quantized GGUF model. stdout: the adapter's path only."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from juno_py.cli.common import (
    StopFlag,
    check_output_options,
    join_world,
    load_training_data,
    load_training_model,
    one_line_errors,
    refuse_overwrite,
    report_sinks,
    say,
    say_metrics_files,
    say_written,
    thread_guard,
)
from juno_py.cli.options import deprecated_alias, training_options


@click.command("lora")
@training_options
@deprecated_alias("--lora-path", "--output", "lora_path", type=click.Path(dir_okay=False))
@one_line_errors
def lora(**o) -> None:
    """Train an adapter on a quantized GGUF model; the base stays quantized. Prints the adapter's path."""
    from juno_py import threads as cpu_threads
    from juno_py.atomic import check_writable
    from juno_py.lora import attach, model_targets, parse_targets
    from juno_py.metrics import MetricsRecorder
    from juno_py.store import resolve_model
    from juno_py.train import distributed
    from juno_py.train.loop import train
    from juno_py.train.setup import default_adapter_path, run_identity

    if o["nproc"]:
        from juno_py.cli.launch import run_torchrun

        sys.exit(run_torchrun(click.get_current_context(), o["nproc"], o["device"]))
    world = join_world(o)  # a rank of a torchrun job, or a single process
    if world.active:
        o["device"] = str(world.device)
        say(f"data parallel: {world.size} processes ({world.backend}); each takes its share of every global batch")
    if o["shard"]:
        say("sharded: the quantized base, the adapters and their optimizer state are split across the processes")
    n_threads = cpu_threads.setup(o["threads"])
    if o["lora_path"]:  # an unwritable output fails now, before a model is pulled or loaded
        check_writable(o["lora_path"], "--output")
    check_output_options(metrics_out=o["metrics_out"], events_out=o["events_out"])
    model_file = distributed.local_first(world, resolve_model, o["model_path"])  # pulled once per host
    lora_path = Path(o["lora_path"]) if o["lora_path"] else default_adapter_path(o["model_path"], model_file)
    if not o["lora_path"]:
        say(f"adapter: {lora_path} (set --output to choose)")
        check_writable(lora_path, "adapter")
    refuse_overwrite(lora_path, "--output", overwrite=o["overwrite"], resume=o["resume"])
    model = load_training_model(o, model_file, shard=o["shard"])
    train_set, val_set = load_training_data(o, model)

    config = adapter_config_from_options(o)
    targets = model_targets(model, parse_targets(o["lora_targets"]))
    adapters = attach(model, targets, config, seed=o["seed"], experts=o["lora_experts"])
    say(
        f"adapter: {o['lora_mode']} r={config.rank} alpha={config.alpha} on {','.join(targets)}, "
        f"{adapters.n_parameters():,} trainable parameters"
    )

    sinks = report_sinks(o, lora_path) if world.is_main else []
    recorder = MetricsRecorder(
        run_identity(model, config, targets, o["device"]), o["events_out"] if world.is_main else None, sinks
    )
    cfg = train_config_from_options(o, pad_id=model.tokenizer.pad_id or 0, lora_path=lora_path)
    try:
        with StopFlag() as stop:
            result = train(
                model,
                adapters,
                train_set,
                cfg,
                val_set,
                recorder,
                resume=o["resume"],
                stop_requested=stop,
                progress=o["progress"],
                log=say,
                progress_interval=o["progress_interval"],
                thread_guard=thread_guard(o, n_threads, world.active),
            )
    except KeyboardInterrupt:
        say(f"juno-py: stopped without saving; the last checkpoint ({lora_path}, if any) is kept")
        sys.exit(130)
    finally:
        if o["metrics_out"] and world.is_main:
            recorder.write_summary(o["metrics_out"])
        recorder.close()
    say(result.summary())
    say_metrics_files(o, sinks)
    if world.is_main:
        say_written("adapter", lora_path)
        states = [Path(f"{lora_path}.state"), *sorted(lora_path.parent.glob(f"{lora_path.name}.state.rank*"))]
        say_written("resume state", *states, note="; --resume continues from it, delete it once done")
    if result.stop_reason == "interrupted":
        state = f"{lora_path}.state" + (f".rank*-of-{world.size}, one per process" if o["shard"] else "")
        say(f"saved; continue with the same command and --resume (state: {state})")
    if world.is_main:
        click.echo(str(lora_path))
    distributed.shutdown()


def adapter_config_from_options(o: dict):
    """`juno-py lora`'s adapter options as an AdapterConfig."""
    from juno_py.lora import AdapterConfig, Init, Mode, Scaling

    return AdapterConfig(
        rank=o["lora_rank"],
        alpha=o["lora_alpha"],
        mode=Mode[o["lora_mode"].upper()],
        scaling=Scaling[o["lora_scaling"].upper()],
        init=Init[o["lora_init"].upper().replace("-", "_")],
        dropout=o["lora_dropout"],
    )


def train_config_from_options(o: dict, *, pad_id: int, lora_path: Path):
    """`juno-py lora`'s options as the training loop's TrainConfig (pad_id from the model's tokenizer)."""
    from juno_py.train.loop import TrainConfig

    return TrainConfig(
        lr=o["lora_lr"],
        batch_size=o["batch_size"],
        accumulation=o["lora_gradient_accumulation"],
        max_grad_norm=o["lora_max_grad_norm"],
        weight_decay=o["lora_weight_decay"],
        plus_ratio=o["lora_plus_ratio"],
        schedule=o["lora_schedule"],
        warmup_steps=o["lora_warmup_steps"],
        min_lr=o["lora_min_lr"],
        max_steps=o["max_steps"],
        epochs=o["epochs"],
        schedule_steps=o["schedule_steps"],
        loss_target=o["lora_loss_target"],
        validation_every=o["validation_every"],
        patience=o["lora_validation_patience"],
        min_delta=o["lora_validation_min_delta"],
        overfit_ratio=o["lora_overfit_ratio"],
        bptt_window=o["bptt_window"],
        grad_checkpoint=o["grad_checkpoint"],
        cuda_graphs=o["cuda_graphs"],
        pack=o["pack"],
        max_seq_len=o["max_seq_len"],
        pad_id=pad_id,
        seed=o["seed"],
        save_every=o["save_every"],
        lora_path=lora_path,
        shard=o.get("shard", False),
    )
