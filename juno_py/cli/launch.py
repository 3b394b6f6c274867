"""`--nproc N`: run the same command as N data-parallel processes on this host through torchrun (PyTorch's
launcher, run in this process). The children get the options the user gave, minus `--nproc`."""

from __future__ import annotations

import os
from typing import Sequence

import click
from click.core import ParameterSource

# seconds torchrun gives the processes to finish their step and save after Ctrl-C, before it kills them
SHUTDOWN_GRACE_S = 120


def forwarded_args(ctx: click.Context, drop: Sequence[str] = ("nproc",)) -> list[str]:
    """The options given on the command line (or through the environment), as command-line words again;
    defaults are left out, so each child resolves them itself exactly as this process would."""
    out: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in drop:
            continue
        if ctx.get_parameter_source(param.name) not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        value = ctx.params[param.name]
        name = max(param.opts, key=len)
        if param.is_flag:
            if param.secondary_opts:
                out.append(name if value else max(param.secondary_opts, key=len))
            elif value:
                out.append(name)
            continue
        for v in value if param.multiple else [value]:
            out += [name, str(v)]
    return out


def torchrun_argv(ctx: click.Context, nproc: int) -> list[str]:
    """torchrun's arguments: one host, a free port (`--standalone`), `python -m juno_py <command> <options>`."""
    return [
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--module",
        "juno_py",
        ctx.command.name,
        *forwarded_args(ctx),
    ]


def run_torchrun(ctx: click.Context, nproc: int, device: str) -> int:
    """Launch the command on `nproc` processes and wait; the exit status of the job (0: every rank succeeded).
    A failing rank's own message is on stderr; torchrun stops the others at once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from juno_py.train.distributed import launched_by_torchrun

    if launched_by_torchrun():
        raise click.UsageError("--nproc inside a torchrun job: torchrun already started the processes; drop --nproc")
    if str(device).startswith("cuda"):
        import torch

        if ":" in str(device):
            raise click.UsageError(f"--nproc with --device {device}: give --device cuda; rank i uses GPU i")
        if torch.cuda.device_count() < nproc:
            raise click.UsageError(f"--nproc {nproc} with --device cuda: {torch.cuda.device_count()} GPUs visible")
    else:  # share the cores; torchrun would set 1 thread per process
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    click.echo(
        f"juno-py: starting {nproc} processes with torchrun (data parallel, "
        f"{'NCCL' if str(device).startswith('cuda') else 'Gloo'})",
        err=True,
    )
    try:
        run(parse_args(torchrun_argv(ctx, nproc)))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        click.echo(
            f"juno-py: error: the process of rank {rank} exited with status {failure.exitcode} (its message "
            f"is above); torchrun stopped the others",
            err=True,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as e:
        click.echo(f"juno-py: {e.sigval.name}: the processes were asked to save and stop", err=True)
        return 130
    return 0
