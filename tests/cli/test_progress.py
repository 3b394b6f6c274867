"""Progress on stderr: one line per interval when stderr is a file (training, merge, export), the bar's absence
with --no-progress, and the line logic itself on a fake clock."""

import io
import json
import os
import re
import subprocess
import sys

import pytest

from juno_py.progress import Progress, format_duration
from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf
from tests.merge.helpers import make_adapter

TRAIN_LINE = re.compile(
    r"^train: step (\d+)/(\d+) \(\d+%\) \| loss (\d+\.\d+) \| (\d+) tokens/s \| elapsed [^|]+ \| ETA [^|]+ \| "
    r"RSS \d+\.\d\d [KMG]iB$"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("progress") / "tiny.gguf", "llama", seed=3)


def run_cli(tmp_path, *args):
    """`juno-py ARGS` in a child process with stderr sent to a file (not a terminal); (stdout, stderr lines)."""
    err = tmp_path / "stderr.log"
    with open(err, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "juno_py", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
    lines = err.read_text().splitlines()
    assert proc.returncode == 0, "\n".join(lines)
    return proc.stdout, lines


def train_args(tiny, tmp_path, *extra):
    data = write_jsonl(tmp_path / "d.jsonl", MIXED_RECORDS)
    return (
        "lora",
        "--model-path",
        tiny,
        "--data",
        data,
        "--lora-path",
        tmp_path / "a.bin",
        "--max-steps",
        4,
        "--lora-rank",
        2,
        "--compute-dtype",
        "fp32",
        *extra,
    )


def test_training_logs_a_line_per_step_at_interval_zero(tiny, tmp_path):
    stdout, lines = run_cli(tmp_path, *train_args(tiny, tmp_path, "--progress-interval", 0))
    assert stdout == f"{tmp_path / 'a.bin'}\n"
    progress = [TRAIN_LINE.match(line) for line in lines if line.startswith("train:")]
    assert all(progress), [line for line in lines if line.startswith("train:")]
    assert [(int(m[1]), int(m[2])) for m in progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert all(int(m[4]) > 0 for m in progress)
    assert not any("\r" in line or "it/s" in line for line in lines)  # no bar


def test_training_logs_at_the_end_within_the_default_interval(tiny, tmp_path):
    _, lines = run_cli(tmp_path, *train_args(tiny, tmp_path))
    progress = [line for line in lines if line.startswith("train:")]
    # a run of a few seconds: the 10 s interval has not passed between steps, the end always gets its line; the
    # loss it shows is the last step's, as the summary says
    assert len(progress) == 1 and TRAIN_LINE.match(progress[0])[1] == "4"
    last = float(TRAIN_LINE.match(progress[0])[3])
    summary = next(line for line in lines if line.startswith("trained 4 steps"))
    assert f"-> {last:.4f}" in summary


def test_no_progress_shows_nothing(tiny, tmp_path):
    _, lines = run_cli(tmp_path, *train_args(tiny, tmp_path, "--no-progress", "--progress-interval", 0))
    assert not [line for line in lines if line.startswith("train:")]


def test_merge_and_export_log_progress(tiny, tmp_path):
    adapter = make_adapter(tiny, tmp_path / "m.bin", targets="qv", rank=2)
    out = tmp_path / "merged.gguf"
    stdout, lines = run_cli(
        tmp_path, "merge", "--model-path", tiny, "--lora-path", adapter, "--output", out, "--progress-interval", 0
    )
    assert stdout == f"{out}\n"
    merge = [line for line in lines if line.startswith("merge: tensor ")]
    n = 2 * 2  # wq and wv in each of the tiny model's 2 layers
    assert [line.split()[2] for line in merge] == [f"{k}/{n}" for k in range(1, n + 1)]
    assert "ETA" in merge[-1] and "RSS" in merge[-1] and ".attn_" in merge[-1]

    stdout, lines = run_cli(
        tmp_path, "export", "--format", "gguf-lora", "--model-path", tiny, "--lora-path", adapter, "--output",
        tmp_path / "x.lora.gguf",
    )  # fmt: skip
    export = [line for line in lines if line.startswith("export: tensor ")]
    assert len(export) == 1 and export[0].split()[2] == f"{n}/{n}"


def test_eval_logs_sequences_loss_and_speed(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", MIXED_RECORDS)
    stdout, lines = run_cli(
        tmp_path, "eval", "--model-path", tiny, "--data", data, "--batch-size", 4, "--progress-interval", 0, "--json"
    )
    result = json.loads(stdout)
    n = result["sequences"]
    evals = [
        re.match(r"eval: sequence (\d+)/(\d+) \(\d+%\) \| loss ([\d.]+) \| ([\d,]+) tokens/s \| ", x)
        for x in lines
        if x.startswith("eval:")
    ]
    assert evals and all(evals), lines
    done = [int(m[1]) for m in evals]
    assert done == sorted(done) and done[-1] == n and {int(m[2]) for m in evals} == {n}
    assert len(evals) == -(-n // 4)  # one line a batch at interval 0
    assert abs(float(evals[-1][3]) - result["loss"]) < 1e-4  # the last line's loss is the result
    _, lines = run_cli(tmp_path, "eval", "--model-path", tiny, "--data", data, "--no-progress")
    assert not [x for x in lines if x.startswith("eval:")]


def test_full_logs_training_and_its_merge_stage(tiny, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", MIXED_RECORDS)
    out = tmp_path / "full.gguf"
    stdout, lines = run_cli(
        tmp_path, "full", "--model-path", tiny, "--data", data, "--output", out, "--max-steps", 2, "--targets", "qv",
        "--galore-rank", 2, "--requant", "auto", "--compute-dtype", "fp32", "--progress-interval", 0,
    )  # fmt: skip
    assert stdout == f"{out}\n"
    assert [TRAIN_LINE.match(line)[1] for line in lines if line.startswith("train:")] == ["1", "2"]
    merge = [line for line in lines if line.startswith("merge: tensor ")]
    assert [line.split()[2] for line in merge] == ["1/4", "2/4", "3/4", "4/4"]
    assert lines.index(merge[-1]) > max(i for i, line in enumerate(lines) if line.startswith("trained 2 steps"))


def test_lines_follow_the_interval():
    now = [0.0]
    out = io.StringIO()
    bar = Progress(10, "work", "item", interval=5, stream=out, clock=lambda: now[0])
    assert bar.mode == "lines"
    for t in range(1, 11):
        now[0] = float(t * 2)  # an item every 2 s: a line at 6 s (3 items), 12 s (6), 18 s (9), and the end
        bar.update(1, f"at {t}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["3/10", "6/10", "9/10", "10/10"]
    assert "| at 3 |" in lines[0] and "ETA 14 s" in lines[0]  # 7 items left at 2 s each
    assert "ETA 0 s" in lines[-1] and "elapsed 20 s" in lines[-1]


def test_an_aborted_run_ends_without_a_progress_line():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress(3, "work", stream=out, interval=100) as bar:
            bar.update(1)
            raise RuntimeError("boom")
    assert out.getvalue() == ""


def test_durations():
    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3600 * 2 + 180)] == [
        "0 s",
        "59 s",
        "1m01s",
        "59m59s",
        "2h03m",
    ]
