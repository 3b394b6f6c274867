"""Loss curves: `--report-to tensorboard` read back with TensorBoard's own EventAccumulator, and `juno-py plot`'s PNG
decoded, sized, not blank, with each curve's pixels where its known series puts them."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from juno_py.cli.main import cli
from juno_py.plot import COLORS, plot_metrics
from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_tensorboard_holds_the_runs_metrics(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", seed=3)
    data = write_jsonl(tmp_path / "d.jsonl", MIXED_RECORDS * 2)
    events, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    r = invoke(
        "lora", "--model-path", model, "--data", data, "--lora-path", tmp_path / "a.bin", "--max-steps", 4,
        "--validation-split", 0.25, "--validation-every", 2, "--lora-rank", 2, "--compute-dtype", "fp32",
        "--lora-warmup-steps", 2, "--report-to", "tensorboard", "--report-dir", tb, "--events-out", events,
        "--no-progress",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert f"metrics: every event in {events} (draw the curves: juno-py plot {events} -o loss.png)" in r.stderr
    assert f"tensorboard: {tb} (view: tensorboard --logdir {tb})" in r.stderr
    recorded = [json.loads(line) for line in events.read_text().splitlines()]
    steps = [e for e in recorded if e["kind"] == "train_step"]
    vals = [e for e in recorded if e["kind"] == "validation"]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/tokens_per_s", "validation/loss"} <= set(acc.Tags()["scalars"])

    def read(tag):
        return [(s.step, s.value) for s in acc.Scalars(tag)]

    # float32 in the event file: equal to the recorded doubles to float32's precision
    assert read("train/loss") == [(e["step"], pytest.approx(e["loss"], rel=1e-6)) for e in steps]
    assert [s for s, _ in read("train/loss")] == [1, 2, 3, 4]
    assert read("train/lr") == [(e["step"], pytest.approx(e["lr_a"], rel=1e-6)) for e in steps]
    assert read("train/lr")[0][1] < read("train/lr")[1][1]  # the warmup is visible
    assert read("train/tokens_per_s") == [(e["step"], pytest.approx(e["tokens_per_s"], rel=1e-6)) for e in steps]
    assert all(v > 0 for _, v in read("train/tokens_per_s"))
    assert read("validation/loss") == [(e["step"], pytest.approx(e["loss"], rel=1e-6)) for e in vals]
    assert [s for s, _ in read("validation/loss")] == [2, 4]


# a known run: the loss falls linearly 4 -> 1 over 100 steps, validation every 20 steps sits 0.5 above it, the
# rate warms up over 10 steps, tokens/s climbs linearly
def train_loss(s):
    return 4 - 3 * (s - 1) / 99


def val_loss(s):
    return train_loss(s) + 0.5


def lr(s):
    return 1e-3 * min(1.0, s / 10)


def rate(s):
    return 1000 + 10 * s


def write_events(path, steps=range(1, 101), offset=0.0):
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"kind": "train_step", "time": 1.0 * s, "step": s, "loss": train_loss(s) + offset, "lr_a": lr(s), "tokens_per_s": rate(s), "tokens": 64}) + "\n")  # fmt: skip
            if s % 20 == 0:
                f.write(json.dumps({"kind": "validation", "step": s, "loss": val_loss(s) + offset}) + "\n")
            if s == 50:
                f.write(json.dumps({"kind": "checkpoint", "step": s, "path": "x"}) + "\n")  # not drawn
    return path


def rows_of(image, x, color, tolerance=60):
    """Rows of column `x` whose pixel is within `tolerance` (sum of channel differences) of `color`."""
    want = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
    column = image[:, int(round(x)), :3].astype(int)
    return np.nonzero(np.abs(column - want).sum(axis=1) <= tolerance)[0]


def where(panel, step, value):
    (x0, x1), (y0, y1) = panel.xlim, panel.ylim
    x = panel.left + (step - x0) / (x1 - x0) * (panel.right - panel.left)
    y = panel.top + (y1 - value) / (y1 - y0) * (panel.bottom - panel.top)
    return x, y


def test_plot_draws_each_curve_where_its_series_puts_it(tmp_path):
    events = write_events(tmp_path / "metrics.jsonl")
    out = tmp_path / "loss.png"
    r = invoke("plot", events, "-o", out, "--width", 8, "--height", 6, "--dpi", 100)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{out}\n" and "100 training steps, 5 validations (800 x 600 px)" in r.stderr
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape == (600, 800, 3)
    # not blank: most of it is background, but a good part is drawn
    white = (image == 255).all(axis=2).mean()
    assert 0.5 < white < 0.97, white

    # the same call lays the figure out the same way: where each panel's axes are, in pixels and in data
    again = tmp_path / "again.png"
    _, panels = plot_metrics(events, again, 8, 6, 100)
    assert np.array_equal(np.asarray(Image.open(again).convert("RGB")), image)
    checks = [
        ("loss", COLORS["train"], train_loss, [5, 25, 50, 75, 95]),
        ("loss", COLORS["validation"], val_loss, [20, 40, 60, 80]),
        ("lr", COLORS["lr"], lr, [20, 50, 90]),
        ("tokens_per_s", COLORS["tokens_per_s"], rate, [10, 50, 90]),
    ]
    for name, color, series, steps in checks:
        for s in steps:
            x, y = where(panels[name], s, series(s))
            rows = rows_of(image, x, color)
            assert len(rows) and np.abs(rows - y).min() <= 2.5, (name, s, y, rows)
            # and only there in this column (validation markers are 6 px across)
            assert np.abs(rows - y).max() <= 8, (name, s, y, rows)
    # the training curve is not drawn where the validation one is: 0.5 of loss apart
    x, y = where(panels["loss"], 50, val_loss(50))
    assert not len([r for r in rows_of(image, x, COLORS["train"]) if abs(r - y) <= 2])


def test_plot_draws_the_last_run_of_an_appended_file(tmp_path):
    events = write_events(tmp_path / "metrics.jsonl", offset=10.0)  # a first run, far above
    write_events(events)  # then a rerun from step 1
    out = tmp_path / "loss.png"
    r = invoke("plot", events, "-o", out)
    assert r.exit_code == 0 and "1 earlier run(s) in the file not drawn" in r.stderr
    curves, panels = plot_metrics(events, tmp_path / "b.png")
    assert curves.earlier_runs == 1 and curves.train[0] == (1, train_loss(1))
    assert panels["loss"].ylim[1] < 10  # the earlier run's losses (above 11) set no limit


def test_plot_bad_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "train_step", "step": 1, "loss": 2.0}\n{not json\n')
    r = invoke("plot", bad, "-o", tmp_path / "x.png")
    assert r.exit_code == 1 and f"{bad}:2: not a JSON object" in r.stderr and len(r.stderr.splitlines()) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"kind": "validation", "step": 1, "loss": 1.0}) + "\n")
    r = invoke("plot", empty, "-o", tmp_path / "x.png")
    assert r.exit_code == 1 and "no train_step events" in r.stderr and not (tmp_path / "x.png").exists()
