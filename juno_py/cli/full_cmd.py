"""`juno-py full`: full-parameter training of chosen targets (GaLore-AdamW or AdamW) on a quantized GGUF model,
written back as a GGUF through the merge stage. stdout: the output file's path only; the training summary, the
GaLore diagnostics and the merge report go to stderr."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from juno_py.cli.common import (
    FiniteFloatRange,
    StopFlag,
    check_output_options,
    join_world,
    load_training_data,
    load_training_model,
    lora_targets_option,
    one_line_errors,
    refuse_overwrite,
    report_sinks,
    say,
    say_metrics_files,
    say_written,
    thread_guard,
    warnings_to_stderr,
)
from juno_py.cli.options import training_options

# `juno-py lora`'s options that mean the same here (data, validation, schedule, batches, stop rules, precision,
# checkpoints, metrics); both commands take them from options.training_options, so they cannot drift apart. Those
# named --lora-* there are renamed here (RENAMED), and their --lora-* spellings stay as hidden deprecated aliases.
SHARED_OPTIONS = (
    "model_path",
    "data",
    "validation_data",
    "validation_split",
    "lora_targets",
    "lora_schedule",
    "lora_warmup_steps",
    "lora_min_lr",
    "batch_size",
    "lora_gradient_accumulation",
    "max_seq_len",
    "max_steps",
    "schedule_steps",
    "epochs",
    "lora_loss_target",
    "validation_every",
    "lora_validation_patience",
    "lora_validation_min_delta",
    "lora_overfit_ratio",
    "qa_variants",
    "system",
    "pack",
    "skip_bad_records",
    "seed",
    "bptt_window",
    "grad_checkpoint",
    "compute_dtype",
    "weights_cache",
    "device",
    "threads",
    "nproc",
    "shard",
    "save_every",
    "overwrite",
    "metrics_out",
    "events_out",
    "progress",
    "progress_interval",
    "report_to",
    "report_dir",
)
# full's option name -> the name of the same option on `juno-py lora` (and of the deprecated alias here)
RENAMED = {
    "lr": "lora_lr",
    "weight_decay": "lora_weight_decay",
    "max_grad_norm": "lora_max_grad_norm",
    "targets": "lora_targets",
    "schedule": "lora_schedule",
    "warmup_steps": "lora_warmup_steps",
    "min_lr": "lora_min_lr",
    "gradient_accumulation": "lora_gradient_accumulation",
    "loss_target": "lora_loss_target",
    "validation_patience": "lora_validation_patience",
    "validation_min_delta": "lora_validation_min_delta",
    "overfit_ratio": "lora_overfit_ratio",
}
# learning rates: GaLore's lifted step is scaled by α and spread by an r-column projector, so per weight it moves
# about an eighth of AdamW's at the same rate (1e-3 learns the built-in facts in 4 epochs on SmolLM2-135M)
DEFAULTS = dict(lr={"galore": 1e-3, "adamw": 1e-4}, rank=128, update_gap=200, scale=0.25)


def world_size() -> int:
    """Processes of a torchrun job (1 when run alone)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1


@click.command("full")
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="The trained model as GGUF (written at the end by the merge stage); the resume state goes to <output>.state.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["galore", "adamw"]),
    default="galore",
    show_default=True,
    help="GaLore-AdamW (moments in a low-rank subspace of each gradient) or AdamW (full moments).",
)
@click.option(
    "--lr",
    default=None,
    type=FiniteFloatRange(0, min_open=True),
    help="Peak learning rate (default: 1e-3 for galore, whose steps are further scaled by --galore-scale; "
    "1e-4 for adamw).",
)
@click.option(
    "--weight-decay",
    default=0.0,
    show_default=True,
    type=FiniteFloatRange(0),
    help="Decoupled weight decay on every trained matrix.",
)
@click.option(
    "--max-grad-norm",
    default=1.0,
    show_default=True,
    type=FiniteFloatRange(0),
    help="Clip gradients to this L2 norm (0: no clipping): globally or per matrix, see --grad-clip.",
)
@click.option(
    "--grad-clip",
    type=click.Choice(["auto", "global", "per-matrix"]),
    default="auto",
    show_default=True,
    help="Clip the global gradient norm, or each matrix's (auto: per matrix in GaLore's per-layer mode, "
    "which never holds all gradients at once; else global).",
)
@click.option(
    "--galore-rank",
    default=DEFAULTS["rank"],
    show_default=True,
    type=click.IntRange(1),
    help="Rank r of each matrix's gradient subspace (at most the matrix's smaller side).",
)
@click.option(
    "--galore-update-gap",
    default=DEFAULTS["update_gap"],
    show_default=True,
    type=click.IntRange(1),
    help="Steps T between refreshes of a matrix's projector (staggered across matrices).",
)
@click.option(
    "--galore-scale",
    default=DEFAULTS["scale"],
    show_default=True,
    type=FiniteFloatRange(0, min_open=True),
    help="α: the lifted update is multiplied by this (independent of the rank).",
)
@click.option(
    "--galore-svd",
    type=click.Choice(["randomized", "exact"]),
    default="randomized",
    show_default=True,
    help="How a projector is refreshed: randomized SVD (a sketch of r+8 columns, 2 power iterations) "
    "or torch.linalg.svd.",
)
@click.option(
    "--galore-row-chunks",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Project each matrix as N pieces of consecutive rows (torch.chunk's split), each with its own projector "
    "and moments: in one process, what --shard on N processes computes (docs/distributed.md).",
)
@click.option(
    "--galore-per-layer/--no-galore-per-layer",
    default=None,
    help="Update each matrix in its gradient hook during backward and free the gradient at once, so all "
    "gradients never coexist (default: on in a single process). Excludes gradient accumulation and "
    "global-norm clipping.",
)
@click.option(
    "--requant",
    default="auto",
    show_default=True,
    help="How trained tensors are encoded: auto (per tensor the smallest type from its own upward whose "
    "retention meets --min-retention), source (each keeps its type), or a GGML type (f16, q8_0, ...).",
)
@click.option(
    "--min-retention",
    default=0.9,
    show_default=True,
    type=FiniteFloatRange(0, 1),
    help="Target of --requant auto: 1 - |ΔW - ΔW_kept| / |ΔW| per tensor.",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the merge report (per tensor and summary) as JSON.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from <output>.state: trained weights, optimizer moments and "
    "projectors, step, schedule, RNG and data position.",
)
@one_line_errors
def full(**o) -> None:
    """Train every weight of the chosen targets (the rest stays quantized and frozen); write a GGUF. Prints its path."""
    from juno_py import threads as cpu_threads
    from juno_py.atomic import OutputError, check_writable
    from juno_py.lora import parse_targets
    from juno_py.merge import merge_trained, parse_requant
    from juno_py.merge.merge import check_output_path
    from juno_py.metrics import Identity, MetricsRecorder
    from juno_py.store import resolve_model
    from juno_py.train import distributed
    from juno_py.train.dense import build_dense_optimizer, densify
    from juno_py.train.galore import GaLoreConfig, resolve_update_mode
    from juno_py.train.loop import train
    from juno_py.train.optim import TrainOptimizer

    if o["nproc"]:
        from juno_py.cli.launch import run_torchrun

        sys.exit(run_torchrun(click.get_current_context(), o["nproc"], o["device"]))
    o = take_deprecated_aliases(o)
    world = join_world(o)  # a rank of a torchrun job, or a single process
    shard = o["shard"]
    if shard and o["bptt_window"]:
        raise click.UsageError(
            "--shard with --bptt-window: every process must run the same forwards; use --bptt-window 0"
        )
    galore = o["optimizer"] == "galore"
    lr = o["lr"] or DEFAULTS["lr"][o["optimizer"]]
    per_layer, clip, global_norm, matrix_norm = resolve_update_mode(
        o["optimizer"],
        o["galore_per_layer"],
        o["grad_clip"],
        o["max_grad_norm"],
        o["gradient_accumulation"],
        o["bptt_window"],
        world_size(),
        sharded=shard,
    )
    parse_requant(o["requant"])  # a bad type fails now, not after the training
    galore_cfg = GaLoreConfig(
        rank=o["galore_rank"],
        update_gap=o["galore_update_gap"],
        scale=o["galore_scale"],
        svd=o["galore_svd"],
        per_layer=per_layer,
        max_matrix_norm=matrix_norm,
        row_chunks=o["galore_row_chunks"],
    )
    if shard and galore_cfg.row_chunks != 1:
        raise click.UsageError(
            f"--galore-row-chunks {galore_cfg.row_chunks} with --shard: each process's shard is its piece of every "
            f"matrix; drop --galore-row-chunks"
        )
    output = Path(o["output"])
    check_writable(output, "--output")  # before a model is pulled or loaded
    refuse_overwrite(output, "--output", overwrite=o["overwrite"], resume=o["resume"])
    check_output_options(report=o["report_path"], metrics_out=o["metrics_out"], events_out=o["events_out"])
    if world.active:
        o["device"] = str(world.device)
        say(f"data parallel: {world.size} processes ({world.backend}); each takes its share of every global batch")
    if shard:
        say(
            "sharded: the quantized base, the dense targets, their gradients and optimizer state are split across "
            "the processes (each keeps its rows of every matrix)"
        )
    n_threads = cpu_threads.setup(o["threads"])
    model_file = distributed.local_first(world, resolve_model, o["model_path"])  # pulled once per host
    check_output_path(output, [Path(model_file)])

    model = load_training_model(o, model_file, shard=shard)
    train_set, val_set = load_training_data(o, model)
    targets = parse_targets(o["targets"])
    dense = densify(model, targets, deferred=shard)  # sharded: decoded block by block as FSDP2 shards them
    identity = Identity(
        algorithm=f"full-{o['optimizer']}",
        scaling="-",
        init="-",
        architecture=model.args.architecture,
        device=str(o["device"]),
        rank=galore_cfg.rank if galore else 0,
        alpha=galore_cfg.scale if galore else 1.0,
        targets=",".join(targets),
    )
    sinks = report_sinks(o, output) if world.is_main else []
    recorder = MetricsRecorder(identity, o["events_out"] if world.is_main else None, sinks)
    built: list[TrainOptimizer] = []

    def build_optimizer() -> TrainOptimizer:
        built.append(
            build_dense_optimizer(o["optimizer"], dense, lr, o["weight_decay"], galore_cfg, o["seed"], recorder)
        )
        return built[-1]

    # sharded: FSDP2 replaces the parameters by their shards, so the loop builds the optimizer after sharding
    optimizer = build_optimizer if shard else build_optimizer()
    what = (
        f"GaLore r={galore_cfg.rank} T={galore_cfg.update_gap} α={galore_cfg.scale} {galore_cfg.svd} SVD, "
        f"{'per-layer updates' if per_layer else 'updates after backward'}"
        if galore
        else "AdamW"
    )
    say(
        f"full training: {len(dense.linears)} matrices ({','.join(targets)}), {dense.n_parameters():,} trainable "
        f"weights (fp32 masters); {what}; lr {lr:g}; clipping {clip} at {o['max_grad_norm']}"
    )

    cfg = train_config_from_options(
        o, lr=lr, max_grad_norm=global_norm, pad_id=model.tokenizer.pad_id or 0, output=output
    )
    try:
        with StopFlag() as stop:
            result = train(
                model,
                dense,
                train_set,
                cfg,
                val_set,
                recorder,
                resume=o["resume"],
                stop_requested=stop,
                progress=o["progress"],
                log=say,
                optimizer=optimizer,
                progress_interval=o["progress_interval"],
                thread_guard=thread_guard(o, n_threads, world.active),
            )
        say(result.summary())
        say_metrics_files(o, sinks)
        if galore:
            for line in built[-1].summary_lines():
                say(line)
        states = state_files(output, world.size if shard else None)
        if result.stop_reason == "interrupted":
            where = f"{output}.state" + (f".rank*-of-{world.size}, one per process" if shard else "")
            say(f"saved; continue with the same command and --resume (state: {where}); no GGUF written")
            say_written("resume state", *states)
            return distributed.shutdown()
        dense.gather(keep=world.is_main)  # sharded: the whole trained matrices to rank 0 (collectives)
        report = None
        if world.is_main:  # the replicas hold the same weights: rank 0 writes the GGUF, the others wait for it
            try:
                with warnings_to_stderr():
                    report = merge_trained(
                        dense,
                        model_file,
                        output,
                        o["requant"],
                        o["min_retention"],
                        recorder,
                        progress=o["progress"],
                        progress_interval=o["progress_interval"],
                    )
            except OutputError as e:
                raise OutputError(
                    f"{e}; the trained weights are in {output}.state: run the same command with --resume to write "
                    f"the GGUF"
                ) from e
        world.barrier()
    except KeyboardInterrupt:
        say(f"juno-py: stopped without saving; the last checkpoint ({output}.state, if any) is kept")
        sys.exit(130)
    finally:
        if o["metrics_out"] and world.is_main:
            recorder.write_summary(o["metrics_out"])
        recorder.close()
    if report is not None:
        click.echo(report.table(), err=True)
        say_written("model", output)
        say_written("resume state", *states, note="; --resume continues from it, delete it once done")
        if o["report_path"]:
            report.write_json(o["report_path"])
        click.echo(str(output))
    distributed.shutdown()


def state_files(output: Path, shards: int | None) -> list[Path]:
    """The resume state beside `output`: `<output>.state`, or a sharded run's one file per rank."""
    if shards is None:
        return [Path(f"{output}.state")]
    return [Path(f"{output}.state.rank{r}-of-{shards}") for r in range(shards)]


def _deprecated(ctx, param, value):
    if value is not None and ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE:
        new = next(n for n, old in RENAMED.items() if old == param.name).replace("_", "-")
        click.echo(f"juno-py: note: juno-py full: {param.opts[0]} is deprecated; use --{new}", err=True)
    if param.name == "lora_targets":
        value = lora_targets_option(ctx, param, value)
    return value


def _share_lora_options() -> None:
    """Put `juno-py lora`'s SHARED_OPTIONS on `full`: those in RENAMED under full's name, each with its old --lora-*
    spelling as a hidden option (default None) that take_deprecated_aliases folds into the new one."""
    names = {p.name for p in full.params}
    training = click.command()(training_options(lambda **o: None))
    shared = [p for p in training.params if p.name in SHARED_OPTIONS and p.name not in names]
    missing = set(SHARED_OPTIONS) - {p.name for p in shared}
    if missing:  # a renamed `juno-py lora` option: say which, rather than lose it silently
        raise RuntimeError(f"juno-py full: options {sorted(missing)} not found on juno-py lora")
    renamed = {old: new for new, old in RENAMED.items()}
    for p in shared:
        if p.name in renamed:
            p.name, p.opts = renamed[p.name], [f"--{renamed[p.name].replace('_', '-')}"]
    aliases = [
        click.Option(
            [f"--{old.replace('_', '-')}", old],
            type=next((p.type for p in [*shared, *full.params] if p.name == new), None),
            default=None,
            hidden=True,
            callback=_deprecated,
            expose_value=True,
        )
        for new, old in RENAMED.items()
    ]
    full.params[:0] = shared
    full.params.extend(aliases)


def take_deprecated_aliases(o: dict) -> dict:
    """The options with each deprecated --lora-* spelling's value (when given) moved to its new name."""
    o = dict(o)
    for new, old in RENAMED.items():
        value = o.pop(old, None)
        if value is not None:
            o[new] = value
    return o


def train_config_from_options(o: dict, *, lr: float, max_grad_norm: float, pad_id: int, output: Path):
    """`juno-py full`'s options as the training loop's TrainConfig; lr and the global clipping norm are resolved
    by the caller (the optimizer's default rate; 0 when GaLore clips per matrix)."""
    from juno_py.train.loop import TrainConfig

    return TrainConfig(
        lr=lr,
        batch_size=o["batch_size"],
        accumulation=o["gradient_accumulation"],
        max_grad_norm=max_grad_norm,
        weight_decay=o["weight_decay"],
        schedule=o["schedule"],
        warmup_steps=o["warmup_steps"],
        min_lr=o["min_lr"],
        max_steps=o["max_steps"],
        epochs=o["epochs"],
        schedule_steps=o["schedule_steps"],
        loss_target=o["loss_target"],
        validation_every=o["validation_every"],
        patience=o["validation_patience"],
        min_delta=o["validation_min_delta"],
        overfit_ratio=o["overfit_ratio"],
        bptt_window=o["bptt_window"],
        grad_checkpoint=o["grad_checkpoint"],
        pack=o["pack"],
        max_seq_len=o["max_seq_len"],
        pad_id=pad_id,
        seed=o["seed"],
        save_every=o["save_every"],
        lora_path=output,
        shard=o.get("shard", False),
    )


_share_lora_options()
