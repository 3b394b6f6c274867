"""`juno-py local`: chat with a model (and adapters) in the terminal, or answer one prompt."""

from __future__ import annotations

import contextlib
import os
import sys

import click

from juno_py.cli.common import FiniteFloatRange, one_line_errors
from juno_py.cli.options import model_options
from juno_py.playback import open_model


def _reply(
    model, messages, max_tokens, temperature, top_k, top_p, seed, stream_out, guard=None
) -> tuple[str, int, float]:
    from juno_py.playback import Sampling, complete

    def write(text: str) -> None:
        stream_out.write(text)
        stream_out.flush()

    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    done = complete(
        model, ids, Sampling(max_tokens, temperature, top_k, top_p, seed), on_text=write, thread_guard=guard
    )
    stream_out.write("\n")
    stream_out.flush()
    return model.tokenizer.decode(done.token_ids), done.completion_tokens, done.seconds


@click.command()
@model_options
@click.option("--prompt", help="Answer this one prompt (only the reply goes to stdout) instead of chatting.")
@click.option("--system", help="A system message placed before the conversation.")
@click.option("--max-tokens", default=256, show_default=True, help="Most tokens generated per reply.")
@click.option(
    "--temperature", default=0.7, show_default=True, type=FiniteFloatRange(), help="Sampling temperature; 0 is greedy."
)
@click.option("--top-k", default=40, show_default=True, help="Sample among the k most likely tokens (0: all).")
@click.option(
    "--top-p", default=0.95, show_default=True, type=FiniteFloatRange(), help="Nucleus sampling mass (1: off)."
)
@click.option("--seed", default=None, type=int, help="Seed for sampling (default: random).")
@one_line_errors
def local(prompt, system, max_tokens, temperature, top_k, top_p, seed, **model_kw) -> None:
    """Chat with a model; /reset clears the history, /exit (or Ctrl-D) leaves."""
    from juno_py import threads as cpu_threads

    model = open_model(**model_kw)
    # decode steps that stall (another process took a core) move to fewer threads, unless --threads fixed them
    fixed = model_kw.get("threads") is not None or cpu_threads.env_threads() is not None
    guard = cpu_threads.StallGuard(cpu_threads.native_threads(), fixed=fixed, one_step_stalls=False)
    base = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        _, n, dt = _reply(
            model,
            base + [{"role": "user", "content": prompt}],
            max_tokens,
            temperature,
            top_k or None,
            top_p,
            seed,
            sys.stdout,
            guard,
        )
        click.echo(f"[{n} tokens, {n / max(dt, 1e-9):.1f} tokens/s]", err=True)
        return
    history = list(base)
    click.echo("juno-py local: /reset clears the conversation, /exit leaves.", err=True)
    with line_editing():
        _chat(model, history, base, max_tokens, temperature, top_k, top_p, seed, guard)


HISTORY_LINES = 1000  # lines of the chat's input history kept in $JUNO_PY_HOME/chat_history


@contextlib.contextmanager
def line_editing():
    """On a terminal, readline's line editing (arrow keys, Ctrl-R) for `input()`, with the history of earlier chats
    read from and saved (atomically, the last HISTORY_LINES lines) to $JUNO_PY_HOME/chat_history. Not on a
    terminal (a pipe, a file), or where readline is missing (Windows): plain input()."""
    if not sys.stdin.isatty():
        yield None
        return
    try:
        import readline
    except ImportError:
        yield None
        return
    from juno_py.store import home

    path = home() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:  # no history yet, or unreadable: start empty
        pass
    readline.set_history_length(HISTORY_LINES)
    try:
        yield path
    finally:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(tmp)
            os.replace(tmp, path)
        except OSError as e:  # the chat is over; a history that cannot be kept is worth a note, not an error
            tmp.unlink(missing_ok=True)
            click.echo(f"juno-py: warning: chat history not saved to {path}: {e.strerror or e}", err=True)


def _chat(model, history, base, max_tokens, temperature, top_k, top_p, seed, guard=None) -> None:
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("", err=True)
            return
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            history = list(base)
            click.echo("(conversation cleared)", err=True)
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        text, n, dt = _reply(model, history, max_tokens, temperature, top_k or None, top_p, seed, sys.stdout, guard)
        history.append({"role": "assistant", "content": text})
        click.echo(f"[{n} tokens, {n / max(dt, 1e-9):.1f} tokens/s]", err=True)
