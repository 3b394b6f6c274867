"""Options shared by the commands that open a model: where it is, how its weights are kept, its adapters."""

from __future__ import annotations

import functools

import click

from juno_py.cli.common import FiniteFloatRange, lora_targets_option
from juno_py.store import DEFAULT_MODEL

THREADS_HELP = (
    "CPU threads of the computation (torch's and the native products'); default: the idle CPUs this process "
    "may run on, measured at the start (a training run drops threads when its steps stall)."
)


def threads_option(fn):
    """`--threads N` (None: `juno_py.threads.choose()` picks), shared by every command that computes."""
    return click.option("--threads", default=None, type=click.IntRange(1), help=THREADS_HELP)(fn)


# one text per option, shared by every command (the rule: juno_py/precision.py)
COMPUTE_DTYPE_HELP = (
    "Dtype of the frozen matmuls (auto: bf16 on a GPU with bf16 support or a CPU with native bf16 "
    "(AVX-512 BF16/AMX), else fp32). Adapters and optimizer state stay fp32."
)
WEIGHTS_CACHE_HELP = (
    "Keep a dequantized copy of the frozen weights resident or read them from the quantized bytes (none). "
    "auto: with bf16 compute, a bf16 copy when it takes at most min(4 GiB, 1/8 of the device's memory); "
    "else none."
)


def base_model_options(fn):
    """The model and how it is kept: --model-path, --force, --weights-cache, --compute-dtype, --device."""

    @click.option(
        "--model-path",
        default=DEFAULT_MODEL,
        show_default=True,
        help="A .gguf file or a model-store name (pulled on first use).",
    )
    @click.option("--force", is_flag=True, help="Load a DoRA adapter whose base fingerprint differs.")
    @click.option(
        "--weights-cache",
        type=click.Choice(["auto", "none", "bf16", "fp32"]),
        default="auto",
        show_default=True,
        help=WEIGHTS_CACHE_HELP,
    )
    @click.option(
        "--compute-dtype",
        type=click.Choice(["auto", "fp32", "bf16"]),
        default="auto",
        show_default=True,
        help=COMPUTE_DTYPE_HELP,
    )
    @click.option(
        "--device",
        default="cpu",
        show_default=True,
        help="Torch device; on cuda the weights stay quantized on the GPU (Triton decodes them).",
    )
    @threads_option
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def deprecated_alias(old: str, new: str, dest: str, *, required: bool = False, type=None):
    """A hidden option `old` that still sets the option `new` (whose parameter is `dest`), with a one-line note on
    stderr when used; `required`: one of the two must be given (the new option itself is declared optional)."""
    alias = f"{dest}__{old.strip('-').replace('-', '_')}"

    def decorate(fn):
        @click.option(old, alias, default=None, hidden=True, type=type, help=f"Deprecated spelling of {new}.")
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            value = kwargs.pop(alias)
            command = click.get_current_context().command_path
            if value is not None:
                if kwargs.get(dest) is not None:
                    raise click.UsageError(f"{old} is the deprecated spelling of {new}: give {new} only")
                click.echo(f"juno-py: note: {command}: {old} is deprecated; use {new}", err=True)
                kwargs[dest] = value
            if required and kwargs.get(dest) is None:
                raise click.UsageError(f"Missing option '{new}'.")
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def model_options(fn):
    """base_model_options and --adapter (the adapters played on every reply; --lora-play, its old name, still works)."""

    @base_model_options
    @click.option(
        "--adapter",
        "lora_play",
        default=None,
        help="Adapters to play: A[:scale][,B[:scale]] (LoRAs add up; a DoRA adapter plays alone at 1).",
    )
    @deprecated_alias("--lora-play", "--adapter", "lora_play")
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


# the defaults of `juno-py lora`
LORA_DEFAULTS = dict(rank=32, alpha=64.0, targets="all", lr=2e-3, epochs=8, batch_size=4, qa_variants=4)


def training_options(fn):
    """Every option of `juno-py lora`; `juno-py full` takes the ones that mean the same there."""

    @click.option(
        "--model-path",
        default=DEFAULT_MODEL,
        show_default=True,
        help="A .gguf file or a model-store name (pulled on first use).",
    )
    @click.option(
        "--data",
        "data",
        multiple=True,
        type=click.Path(dir_okay=False),
        help="Training data: JSONL or a JSON array of {text}, {prompt, completion}, {messages} or {Q, A} "
        "records, or a .txt file; repeat for several files (default: the built-in facts).",
    )
    @click.option(
        "--validation-data",
        multiple=True,
        type=click.Path(dir_okay=False),
        help="Validation records (same formats) instead of --validation-split.",
    )
    @click.option(
        "--validation-split",
        default=0.0,
        show_default=True,
        type=FiniteFloatRange(0, 0.9),
        help="Fraction of the records (whole records) held out for validation.",
    )
    @click.option(
        "--output",
        "lora_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="Output adapter.bin (default: <model name>.adapter.bin in the current folder); its resume "
        "state goes to <path>.state.",
    )
    @click.option(
        "--lora-mode",
        type=click.Choice(["lora", "dora"]),
        default="lora",
        show_default=True,
        help="Plain LoRA, or DoRA (magnitude and direction).",
    )
    @click.option(
        "--lora-targets",
        default=LORA_DEFAULTS["targets"],
        show_default=True,
        callback=lora_targets_option,
        help="qv, all, attn, mlp, experts, or a comma list of wq,wk,wv,wo,wgate,wup,wdown,router (on a "
        "mixture-of-experts model the MLP targets are the experts' projections).",
    )
    @click.option(
        "--lora-experts",
        type=click.Choice(["per-expert", "shared"]),
        default="per-expert",
        show_default=True,
        help="Mixture-of-experts models: one adapter per expert and projection, or one shared by all experts "
        "of a block.",
    )
    @click.option(
        "--lora-rank", default=LORA_DEFAULTS["rank"], show_default=True, type=click.IntRange(1), help="Rank r."
    )
    @click.option(
        "--lora-alpha",
        default=LORA_DEFAULTS["alpha"],
        show_default=True,
        type=FiniteFloatRange(),
        help="Alpha: the scale is alpha/r (standard) or alpha/sqrt(r) (rslora).",
    )
    @click.option(
        "--lora-scaling",
        type=click.Choice(["standard", "rslora"]),
        default="standard",
        show_default=True,
        help="How alpha and r give the scale.",
    )
    @click.option(
        "--lora-init",
        type=click.Choice(["kaiming-uniform", "legacy-normal"]),
        default="kaiming-uniform",
        show_default=True,
        help="Initialisation of A (B starts at zero).",
    )
    @click.option(
        "--lora-dropout",
        default=0.0,
        show_default=True,
        type=FiniteFloatRange(0, 1, max_open=True),
        help="Dropout on the adapter's input.",
    )
    @click.option(
        "--lora-lr",
        default=LORA_DEFAULTS["lr"],
        show_default=True,
        type=FiniteFloatRange(0, min_open=True),
        help="Peak learning rate.",
    )
    @click.option(
        "--lora-weight-decay",
        default=0.01,
        show_default=True,
        type=FiniteFloatRange(0),
        help="AdamW decoupled weight decay, on A only (never B or the DoRA magnitude).",
    )
    @click.option(
        "--lora-plus-ratio",
        default=1.0,
        show_default=True,
        type=FiniteFloatRange(0, min_open=True),
        help="LoRA+: B's learning rate is this many times the rate of A.",
    )
    @click.option(
        "--lora-schedule",
        type=click.Choice(["constant", "warmup-cosine"]),
        default="warmup-cosine",
        show_default=True,
        help="Learning-rate schedule.",
    )
    @click.option(
        "--lora-warmup-steps", default=0, show_default=True, type=click.IntRange(0), help="Linear warmup steps."
    )
    @click.option(
        "--lora-min-lr",
        default=0.0,
        show_default=True,
        type=FiniteFloatRange(0),
        help="Learning rate at the end of the cosine.",
    )
    @click.option(
        "--batch-size",
        default=LORA_DEFAULTS["batch_size"],
        show_default=True,
        type=click.IntRange(1),
        help="Sequences (rows, when packed) per micro-batch.",
    )
    @click.option(
        "--lora-gradient-accumulation",
        default=1,
        show_default=True,
        type=click.IntRange(1),
        help="Micro-batches per optimizer step; the loss is averaged over the group's supervised tokens.",
    )
    @click.option(
        "--lora-max-grad-norm",
        default=1.0,
        show_default=True,
        type=FiniteFloatRange(0),
        help="Clip the global gradient L2 norm to this (0: no clipping).",
    )
    @click.option(
        "--max-seq-len",
        default=512,
        show_default=True,
        type=click.IntRange(2),
        help="Longest sequence: longer texts are split, longer chat/prompt/Q&A records dropped (counted).",
    )
    @click.option(
        "--max-steps",
        default=None,
        type=click.IntRange(1),
        help="Stop after this many optimizer steps (the schedule keeps the length of --epochs; resume with a "
        "larger --max-steps to continue it).",
    )
    @click.option(
        "--schedule-steps",
        default=None,
        type=click.IntRange(1),
        help="Length of the learning-rate schedule in optimizer steps (default: the steps of --epochs).",
    )
    @click.option(
        "--epochs",
        default=LORA_DEFAULTS["epochs"],
        show_default=True,
        type=click.IntRange(1),
        help="Passes over the training data.",
    )
    @click.option(
        "--lora-loss-target",
        default=None,
        type=FiniteFloatRange(0),
        help="Stop once the training loss over the last epoch's worth of steps is at or below this.",
    )
    @click.option(
        "--validation-every",
        default=None,
        type=click.IntRange(1),
        help="Validate every N optimizer steps (default: at the end of each epoch).",
    )
    @click.option(
        "--lora-validation-patience",
        default=3,
        show_default=True,
        type=click.IntRange(0),
        help="Stop after this many validations without improvement (0: never); the best weights are kept.",
    )
    @click.option(
        "--lora-validation-min-delta",
        default=0.0,
        show_default=True,
        type=FiniteFloatRange(0),
        help="Smallest decrease of the validation loss that counts as an improvement.",
    )
    @click.option(
        "--lora-overfit-ratio",
        default=1.25,
        show_default=True,
        type=FiniteFloatRange(0),
        help="Overfit guard: stop at once when the validation loss exceeds its best by this factor "
        "(0: off); the best weights are kept.",
    )
    @click.option(
        "--qa-variants",
        default=LORA_DEFAULTS["qa_variants"],
        show_default=True,
        type=click.IntRange(1, 8),
        help="Question rewordings per {Q, A} record.",
    )
    @click.option("--system", default=None, help="System prompt put in front of chat and Q&A records.")
    @click.option(
        "--pack/--no-pack",
        default=False,
        show_default=True,
        help="Pack several sequences per row (block-diagonal attention, per-document positions).",
    )
    @click.option("--skip-bad-records", is_flag=True, help="Skip malformed records (counted) instead of stopping.")
    @click.option("--seed", default=0, show_default=True, type=int, help="Seed of initialisation, shuffling, dropout.")
    @click.option(
        "--bptt-window",
        default=0,
        show_default=True,
        type=click.IntRange(0),
        help="Truncated backprop: windows of N tokens attend to earlier windows' cached K/V without "
        "gradients (0: whole sequence, exact).",
    )
    @click.option(
        "--grad-checkpoint/--no-grad-checkpoint",
        default=None,
        help="Recompute each block in backward: less memory, more time (default: on where a micro-batch's "
        "activations would take more than half the device's free memory, e.g. long sequences).",
    )
    @click.option(
        "--cuda-graphs",
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        show_default=True,
        help="On a GPU, capture each training step (forward, loss, backward) as a CUDA graph once per batch "
        "shape and replay it: one launch instead of thousands (auto: where the run allows it; not with "
        "--grad-checkpoint, --bptt-window, dropout or several processes).",
    )
    @click.option(
        "--compute-dtype",
        type=click.Choice(["auto", "fp32", "bf16"]),
        default="auto",
        show_default=True,
        help=COMPUTE_DTYPE_HELP,
    )
    @click.option(
        "--weights-cache",
        type=click.Choice(["auto", "none", "bf16", "fp32"]),
        default="auto",
        show_default=True,
        help=WEIGHTS_CACHE_HELP,
    )
    @click.option(
        "--device",
        default="cpu",
        show_default=True,
        help="Torch device; on cuda the base stays quantized on the GPU (Triton decodes it).",
    )
    @threads_option
    @click.option(
        "--nproc",
        default=None,
        type=click.IntRange(1),
        help="Data-parallel training on N processes on this host (one per GPU with --device cuda): runs "
        "torchrun for you. Same global batch as one process. See docs/distributed.md.",
    )
    @click.option(
        "--shard",
        is_flag=True,
        help="With several processes (--nproc, or under torchrun): split the quantized base, the trained weights "
        "(adapters; juno-py full: the dense targets) and their optimizer state across them (FSDP2; each block is "
        "gathered, the base still quantized, just before it runs) instead of copying the whole model into each. "
        "See docs/distributed.md.",
    )
    @click.option(
        "--save-every",
        default=0,
        show_default=True,
        type=click.IntRange(0),
        help="Write the adapter and its resume state every N optimizer steps (0: at the end only).",
    )
    @click.option(
        "--overwrite",
        is_flag=True,
        help="Replace an existing output and its resume state (without it, a run refuses to overwrite them).",
    )
    @click.option(
        "--resume",
        is_flag=True,
        help="Continue from <output>.state: weights, optimizer moments, step, schedule, RNG and data position.",
    )
    @click.option(
        "--metrics-out",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write a metrics.json summary (count, mean, last, p95 per series).",
    )
    @click.option(
        "--events-out",
        type=click.Path(dir_okay=False),
        default=None,
        help="Append every metrics event as one JSON line.",
    )
    @click.option(
        "--report-to",
        type=click.Choice(["none", "tensorboard"]),
        default="none",
        show_default=True,
        help="Also write training and validation loss, learning rate and tokens/s as TensorBoard scalars "
        "(needs the tensorboard extra).",
    )
    @click.option(
        "--report-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Folder of the TensorBoard event files (default: runs/<adapter or output name>).",
    )
    @progress_options
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def progress_options(fn):
    """--progress/--no-progress and --progress-interval: a bar on a terminal, else a line every N seconds."""

    @click.option(
        "--progress/--no-progress",
        default=None,
        help="Progress on stderr (default: a bar on a terminal, else one line every --progress-interval "
        "seconds and at the end); --progress forces the bar, --no-progress shows none.",
    )
    @click.option(
        "--progress-interval",
        default=10.0,
        show_default=True,
        type=FiniteFloatRange(0),
        help="Seconds between two progress lines when stderr is not a terminal (0: every step).",
    )
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper
