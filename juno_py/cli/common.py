"""Helpers shared by the `juno-py` commands: one-line errors and warnings, stderr messages, the Ctrl-C stop
flag, and opening the model and data the training commands train on."""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
import signal
import sys
import warnings
from pathlib import Path

import click

from juno_py.errors import JunoError, one_line


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses NaN and +-Inf: NaN compares false to every bound and Inf passes an
    open upper end, so a plain FloatRange lets both through into the arithmetic. Every float flag uses it."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def lora_targets_option(ctx, param, value):
    """Check --lora-targets when the flags are parsed, before the model or data load; the value stays the
    string the commands parse later."""
    from juno_py.lora import parse_targets

    if value is not None:
        try:
            parse_targets(value)
        except ValueError as e:
            raise click.BadParameter(str(e), ctx, param) from None
    return value


def check_output_options(**paths) -> None:
    """Each given output option's path (`metrics_out=...`) must be writable: checked before the model loads, so that
    no run ends in an error over a file written after it (`juno_py.atomic.check_writable`)."""
    from juno_py.atomic import check_writable

    for name, path in paths.items():
        if path:
            check_writable(path, "--" + name.replace("_", "-"))


def refuse_overwrite(path: Path, flag: str, *, overwrite: bool, resume: bool = False, state: bool = True) -> None:
    """Stop before anything loads when `path` (or, for a training output, its resume state `<path>.state`, or a
    sharded run's `<path>.state.rank<r>-of-<n>`) exists and neither --overwrite nor --resume (which continues from
    that state) was given: a rerun must not silently replace a trained output."""
    if overwrite or resume:
        return
    path = Path(path)
    state_file = Path(f"{path}.state")
    shards = sorted(path.parent.glob(f"{glob.escape(path.name)}.state.rank*-of-*")) if state else []
    for existing in [*((path, state_file) if state else (path,)), *shards[:1]]:
        if existing.exists():
            hint = " (or --resume to continue its run)" if state and (state_file.exists() or shards) else ""
            raise click.UsageError(f"{existing} exists: pass --overwrite to replace it{hint}, or choose another {flag}")


def one_line_errors(fn):
    """Turn a JunoError (or a missing file) into one line on stderr and exit status 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (JunoError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
            rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else None
            where = f" (rank {rank})" if rank else ""  # under torchrun
            click.echo(f"juno-py: error{where}: {one_line(str(e))}", err=True)  # one bounded line, whatever raised
            sys.exit(1)

    return wrapper


@contextlib.contextmanager
def warnings_to_stderr():
    """Library warnings (a differing fingerprint, a skipped tensor) as one `juno-py: warning:` line each, each
    distinct message once, cut to one line of at most MAX_MESSAGE characters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for text in dict.fromkeys(one_line(str(w.message)) for w in caught):
                click.echo(f"juno-py: warning: {text}", err=True)


_quiet = False  # under torchrun, ranks other than 0 keep quiet (errors still reach stderr)


def set_quiet(quiet: bool) -> None:
    """Silence `say` (ranks other than 0 of a torchrun job)."""
    global _quiet
    _quiet = quiet


def join_world(o: dict):
    """This process's place in a torchrun job (or a single process): only rank 0 speaks, and `--shard` without
    other processes is refused in one line."""
    from juno_py.train import distributed

    world = distributed.init_from_env(o["device"])
    set_quiet(not world.is_main)
    if o.get("shard") and not world.active:
        raise click.UsageError("--shard splits the model across processes: add --nproc N, or run under torchrun")
    return world


def say(msg: str) -> None:
    if not _quiet:
        click.echo(msg, err=True)


class StopFlag:
    """First Ctrl-C: finish the step, save, exit cleanly. Second: stop at once (the last checkpoint stays)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame):
        self.requested = True
        say("juno-py: interrupted: finishing this step, then saving (Ctrl-C again to stop without saving)")
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


def load_training_model(o: dict, model_file, shard: bool = False):
    """The model as the training commands open it (`juno-py lora`, `juno-py full`): compute dtype and weights
    cache resolved from their options. `shard`: left on the CPU, memory-mapped, with no weights cache (sharded
    training moves each rank's part to the device)."""
    from juno_py.models import load_model
    from juno_py.precision import resolve_compute_dtype, resolve_weights_cache

    compute = resolve_compute_dtype(o["compute_dtype"], o["device"])
    if shard:
        if o["weights_cache"] not in ("auto", "none"):
            raise click.UsageError(
                f"--shard with --weights-cache {o['weights_cache']}: a dequantized copy of the whole base cannot "
                f"be sharded; use --weights-cache none"
            )
        cache, device = "none", "cpu"
    else:
        cache, device = resolve_weights_cache(o["weights_cache"], model_file, compute, o["device"]), o["device"]
    model = load_model(model_file, device=device, weights_cache=cache, compute_dtype=compute)
    say(
        f"model: {model_file} ({model.args.architecture}, {model.args.n_layer} layers); compute "
        f"{str(compute).removeprefix('torch.')}, weights cache {cache}"
    )
    return model


def load_training_data(o: dict, model) -> tuple[list, list]:
    """Training and validation sequences from the data options (no --data: the built-in facts)."""
    from juno_py.train.data import BUILTIN_FACTS, load_dataset

    data = [Path(p) for p in o["data"]] or [BUILTIN_FACTS]
    if not o["data"]:
        say(f"data: the built-in facts ({BUILTIN_FACTS}); set --data to train on your own")
    train_set, val_set, stats = load_dataset(
        data,
        model.tokenizer,
        o["max_seq_len"],
        o["qa_variants"],
        o["skip_bad_records"],
        o["validation_split"],
        o["seed"],
        o["system"],
        [Path(p) for p in o["validation_data"]],
    )
    say(f"data: {stats.line()}; {len(val_set)} validation sequences")
    if not train_set:
        raise click.UsageError("no training sequences left (all records dropped by --max-seq-len?)")
    return train_set, val_set


def report_sinks(o: dict, output: Path) -> list:
    """The metrics sinks --report-to asks for (TensorBoard under --report-dir, default runs/<output name>)."""
    if o["report_to"] != "tensorboard":
        return []
    from juno_py.metrics.tensorboard import TensorBoardSink

    name = output.name[: -len(".bin")] if output.name.endswith(".bin") else output.stem
    return [TensorBoardSink(Path(o["report_dir"]) if o["report_dir"] else Path("runs") / name)]


def file_size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def say_written(label: str, *paths: Path, note: str = "") -> None:
    """One line naming where a written output went and its size (the resume state, a merged GGUF), so that no large
    file appears unannounced; files that do not exist are left out."""
    from juno_py.metrics import format_bytes

    found = [p for p in paths if p.exists()]
    if not found:
        return
    where = str(found[0]) if len(found) == 1 else f"{found[0]} and {len(found) - 1} more"
    say(f"{label}: {where} ({format_bytes(sum(file_size(p) for p in found))}){note}")


def say_metrics_files(o: dict, sinks: list) -> None:
    """Name the files the run's metrics went to, and how to look at them."""
    if o["events_out"]:
        say(f"metrics: every event in {o['events_out']} (draw the curves: juno-py plot {o['events_out']} -o loss.png)")
    else:
        say("metrics: not kept; --events-out metrics.jsonl keeps every step (juno-py plot draws it)")
    for sink in sinks:
        say(f"tensorboard: {sink.log_dir} (view: tensorboard --logdir {sink.log_dir})")


def thread_guard(o: dict, n_threads: int, distributed_run: bool):
    """The training loop's StallGuard on the CPU: fewer threads when steps stall, unless --threads (or
    OMP_NUM_THREADS) fixed the count; None on a GPU and for a data-parallel run (its launcher shares the cores)."""
    from juno_py import threads as cpu_threads

    if str(o["device"]).startswith("cuda") or distributed_run:
        return None
    fixed = o["threads"] is not None or cpu_threads.env_threads() is not None
    return cpu_threads.StallGuard(n_threads, fixed=fixed)
