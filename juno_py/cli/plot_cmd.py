"""`juno-py plot`: draw a run's curves from its metrics events file. stdout: the PNG's path only."""

from __future__ import annotations

import click

from juno_py.cli.common import FiniteFloatRange, one_line_errors, say


@click.command("plot")
@click.argument("events", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o", "--output", default="loss.png", show_default=True, type=click.Path(dir_okay=False), help="PNG to write."
)
@click.option("--width", default=10.0, show_default=True, type=FiniteFloatRange(2, 60), help="Width in inches.")
@click.option("--height", default=8.0, show_default=True, type=FiniteFloatRange(2, 60), help="Height in inches.")
@click.option("--dpi", default=100, show_default=True, type=click.IntRange(30, 600), help="Pixels per inch.")
@one_line_errors
def plot(events, output, width, height, dpi) -> None:
    """Draw training and validation loss, learning rate and tokens/s against steps from a --events-out file."""
    from juno_py.plot import plot_metrics

    curves, _ = plot_metrics(events, output, width, height, dpi)
    earlier = f"; {curves.earlier_runs} earlier run(s) in the file not drawn" if curves.earlier_runs else ""
    say(
        f"plot: {len(curves.train)} training steps, {len(curves.validation)} validations "
        f"({round(width * dpi)} x {round(height * dpi)} px){earlier}"
    )
    click.echo(output)
