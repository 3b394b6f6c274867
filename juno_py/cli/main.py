"""The `juno-py` command: a click group whose subcommands live one per module in this package."""

from __future__ import annotations

import functools
import os
import sys

import click

from juno_py.errors import JunoError


def one_line_errors(fn):
    """Turn a JunoError (or a missing file) into one line on stderr and exit status 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (JunoError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
            rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else None
            click.echo(f"juno-py: error{f' (rank {rank})' if rank else ''}: {e}", err=True)  # rank: under torchrun
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="juno-py")
def cli() -> None:
    """Train LoRA and DoRA adapters directly on quantized GGUF models, play them back, merge them."""


def _register() -> None:
    # each module adds its command(s) to `cli`
    from juno_py.cli import eval_cmd, export_cmd, inspect_cmd, local_cmd, lora_cmd, merge_cmd, models_cmd  # noqa: F401
    from juno_py.cli import full_cmd  # noqa: F401


def main() -> None:
    _register()
    cli(prog_name="juno-py")
