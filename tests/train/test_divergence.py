"""A run that diverges keeps the last good weights (loss finite and not exploded, every value bounded) or writes
nothing, and its one-line message says which, naming only checkpoints that exist."""

import re

import numpy as np
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.lora import load_adapters, read_adapter
from juno_py.models import load_model
from juno_py.train.loop import MAX_WEIGHT
from juno_py.train.state import state_path


def train_cli(tiny_path, data, out, *extra):
    args = ["lora", "--model-path", tiny_path, "--data", data, "--lora-path", out, "--lora-rank", "2"]
    args += ["--compute-dtype", "fp32", "--no-progress", *extra]
    return CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)


def error_line(r) -> str:
    assert r.exit_code == 1 and r.stdout == "", r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("juno-py: error: ") and len(line) <= 500
    return line


def plays_back_finite(tiny_path, adapter) -> bool:
    model = load_model(tiny_path)
    load_adapters(model, [str(adapter)])
    ids = torch.tensor([model.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        return bool(torch.isfinite(model(ids)).all())


def largest_value(adapter) -> float:
    return max(max(float(np.abs(e.A).max()), float(np.abs(e.B).max())) for e in read_adapter(adapter)[1])


def test_a_huge_learning_rate_saves_no_exploded_weights(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "a.bin"
    line = error_line(train_cli(tiny_path, mixed_data, out, "--lora-lr", "1e6", "--max-steps", 30, "--overwrite"))
    assert "stopped" in line or "weights above" in line
    saved = re.search(r"saved in (\S+)$", line)
    if saved:  # the weights kept must be good ones: bounded, and playing back as numbers
        assert saved.group(1) == str(out) and largest_value(out) <= MAX_WEIGHT
        assert plays_back_finite(tiny_path, out)
    else:
        assert line.endswith("nothing was saved") and not out.exists() and not state_path(out).exists()


def test_the_last_good_weights_are_saved_and_play_back(tiny_path, mixed_data, tmp_path):
    """At a rate of 3000 the first steps leave bounded weights with a finite loss; later ones blow up."""
    out = tmp_path / "a.bin"
    line = error_line(
        train_cli(tiny_path, mixed_data, out, "--lora-lr", 3000, "--lora-schedule", "constant", "--max-steps", 30)
    )
    found = re.search(r"the last good weights \(after step (\d+), loss ([0-9.]+)\) are saved in (\S+)$", line)
    assert found and found.group(3) == str(out), line
    assert 0 < int(found.group(1)) and largest_value(out) <= MAX_WEIGHT
    assert plays_back_finite(tiny_path, out)


def test_a_diverged_run_names_only_a_checkpoint_that_exists(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "a.bin"
    r = train_cli(tiny_path, mixed_data, out, "--max-steps", 2, "--lora-lr", "1e-2")
    assert r.exit_code == 0, r.stderr
    before = out.read_bytes()
    line = error_line(train_cli(tiny_path, mixed_data, out, "--lora-lr", "1e6", "--max-steps", 30, "--overwrite"))
    if "saved in" not in line:
        assert line.endswith(f"the last checkpoint {out} is kept as it was") and out.read_bytes() == before
    assert plays_back_finite(tiny_path, out)


def test_an_explosion_at_the_end_of_a_run_saves_no_exploded_weights(tiny_path, mixed_data, tmp_path):
    """One step at 1e5 leaves every loss finite and the weights far beyond any adapter's: nothing is written
    (an adapter file would refuse them)."""
    out = tmp_path / "a.bin"
    line = error_line(
        train_cli(tiny_path, mixed_data, out, "--lora-lr", "1e5", "--lora-schedule", "constant", "--max-steps", 1)
    )
    assert f"weights above {MAX_WEIGHT:g} in magnitude" in line and line.endswith("nothing was saved")
    assert not out.exists() and not state_path(out).exists()


def test_full_training_names_the_resume_state_it_keeps(tiny_path, mixed_data, tmp_path):
    """`juno-py full` keeps its weights in <output>.state: a diverged run names that file, only if it exists."""
    out = tmp_path / "f.gguf"
    args = ["full", "--model-path", tiny_path, "--data", mixed_data, "--output", out, "--optimizer", "adamw"]
    args += ["--targets", "qv", "--no-galore-per-layer", "--schedule", "constant", "--no-progress"]
    r = CliRunner().invoke(cli, list(map(str, [*args, "--lr", "1e-4", "--max-steps", 1])), catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    before = state_path(out).read_bytes()
    rerun = [*args, "--lr", "1e6", "--max-steps", 5, "--overwrite"]
    line = error_line(CliRunner().invoke(cli, list(map(str, rerun))))
    if "saved in" in line:
        assert line.endswith(f"saved in {state_path(out)}")
    else:
        assert line.endswith(f"the last checkpoint {state_path(out)} is kept as it was")
        assert state_path(out).read_bytes() == before
