"""`juno-py plot`: the curves of a metrics events file (`--events-out`, one JSON object per line) as a PNG:
training and validation loss, learning rate and tokens/s against the optimizer step, one panel each.

An events file is appended to by every run that names it; a step that does not follow the one before starts a
new run (a resumed run carries on counting), and the last run is drawn. Lines that are not events (other kinds,
other fields) are skipped; a line that is not JSON is an error naming the file and line.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from juno_py.atomic import atomic_write_bytes
from juno_py.errors import JunoError, show

# the curves' colours (the tests find the curves by them)
COLORS = {"train": "#1f4fd8", "validation": "#e8590c", "lr": "#2b8a3e", "tokens_per_s": "#9c36b5"}


class PlotError(JunoError, ValueError):
    """An events file that cannot be drawn."""


@dataclass
class Curves:
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    validation: list[tuple[int, float]] = field(default_factory=list)
    lr: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: list[tuple[int, float]] = field(default_factory=list)
    earlier_runs: int = 0


@dataclass
class Panel:
    """Where a panel landed in the PNG: its axes' box in pixels (x from the left, y from the top) and the data
    range that box spans."""

    left: float
    top: float
    right: float
    bottom: float
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    log_y: bool = False


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_curves(path: Union[str, Path]) -> Curves:
    """The last run's curves from an events file."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise PlotError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected JSON lines") from None
    runs: list[Curves] = [Curves()]
    last_step = 0
    previous_time = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as e:
            raise PlotError(f"{path}:{number}: not a JSON object ({e}): {show(line)}") from None
        if not isinstance(event, dict):
            raise PlotError(f"{path}:{number}: expected a JSON object per line, got {show(event)}")
        step = event.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool)):
            continue
        kind = event.get("kind")
        if kind == "train_step":
            if step <= last_step:  # a new run appended to the same file
                runs.append(Curves())
                previous_time = None
            last_step = step
            run = runs[-1]
            if _finite(event.get("loss")):
                run.train.append((step, float(event["loss"])))
            if _finite(event.get("lr_a")):
                run.lr.append((step, float(event["lr_a"])))
            rate = event.get("tokens_per_s")
            if not _finite(rate) and _finite(event.get("time")) and previous_time is not None:
                dt = event["time"] - previous_time  # files written before tokens_per_s was an event field
                rate = event.get("tokens", 0) / dt if dt > 0 and _finite(event.get("tokens")) else None
            if _finite(rate):
                run.tokens_per_s.append((step, float(rate)))
            previous_time = event.get("time") if _finite(event.get("time")) else None
        elif kind == "validation" and _finite(event.get("loss")):
            runs[-1].validation.append((step, float(event["loss"])))
    drawn = runs[-1]
    drawn.earlier_runs = sum(1 for r in runs[:-1] if r.train)
    if not drawn.train:
        raise PlotError(f"{path}: no train_step events with a loss; write them with --events-out during training")
    return drawn


def plot_curves(
    curves: Curves, output: Union[str, Path], width: float = 10.0, height: float = 8.0, dpi: int = 100
) -> dict[str, Panel]:
    """Draw `curves` into the PNG `output` (written atomically, `width` x `height` inches at `dpi`); returns
    each panel's place in the image ("loss", "lr", "tokens_per_s")."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("juno-py plot needs matplotlib: pip install 'juno-py[plot]'") from None
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    loss_ax, lr_ax, rate_ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1, 1]})
    steps, losses = zip(*curves.train)
    loss_ax.plot(steps, losses, color=COLORS["train"], linewidth=2, label="training loss")
    if curves.validation:
        vs, vl = zip(*curves.validation)
        loss_ax.plot(vs, vl, color=COLORS["validation"], linewidth=2, marker="o", label="validation loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend(loc="upper right")
    title = "training curves" + (
        f" (last of {curves.earlier_runs + 1} runs in the file)" if curves.earlier_runs else ""
    )
    loss_ax.set_title(title)
    if curves.lr:
        s, v = zip(*curves.lr)
        lr_ax.plot(s, v, color=COLORS["lr"], linewidth=2)
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if curves.tokens_per_s:
        s, v = zip(*curves.tokens_per_s)
        rate_ax.plot(s, v, color=COLORS["tokens_per_s"], linewidth=2)
    rate_ax.set_ylabel("tokens/s")
    rate_ax.set_xlabel("optimizer step")
    for ax in (loss_ax, lr_ax, rate_ax):
        ax.grid(True, color="#dddddd", linewidth=0.8)
    fig.align_ylabels()
    fig.tight_layout()

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    atomic_write_bytes(Path(output), buffer.getvalue())
    height_px = fig.get_figheight() * dpi
    panels = {}
    for name, ax in (("loss", loss_ax), ("lr", lr_ax), ("tokens_per_s", rate_ax)):
        box = ax.get_window_extent()  # display pixels, y from the bottom
        panels[name] = Panel(
            box.x0, height_px - box.y1, box.x1, height_px - box.y0, tuple(ax.get_xlim()), tuple(ax.get_ylim())
        )
    return panels


def plot_metrics(
    events: Union[str, Path], output: Union[str, Path], width: float = 10.0, height: float = 8.0, dpi: int = 100
) -> tuple[Curves, dict[str, Panel]]:
    curves = read_curves(events)
    return curves, plot_curves(curves, output, width, height, dpi)
