"""`juno-py lora`: stdout carries only the adapter path; errors are one line; Ctrl-C saves and exits cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.lora import read_adapter
from juno_py.train.state import load_state


def invoke(*args):
    return CliRunner().invoke(cli, ["lora", *map(str, args)], catch_exceptions=False)


def test_lora_command_trains_and_prints_only_the_path(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "a.bin"
    r = invoke(
        "--model-path",
        tiny_path,
        "--data",
        mixed_data,
        "--lora-path",
        out,
        "--max-steps",
        3,
        "--lora-rank",
        4,
        "--lora-targets",
        "qv",
        "--lora-mode",
        "dora",
        "--validation-split",
        0.2,
        "--metrics-out",
        tmp_path / "metrics.json",
        "--events-out",
        tmp_path / "events.jsonl",
        "--compute-dtype",
        "fp32",
        "--no-progress",
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{out}\n"
    assert "trained 3 steps" in r.stderr
    _, entries = read_adapter(out)
    assert {e.key.split(":")[1] for e in entries} == {"wq", "wv"} and all(e.rank == 4 for e in entries)
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["identity"]["algorithm"] == "dora" and summary["series"]["train_step.loss"]["count"] == 3
    assert summary["identity"]["architecture"] == "llama" and summary["identity"]["targets"] == "wq,wv"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {"train_step", "validation", "norm_refresh", "checkpoint"} <= {e["kind"] for e in events}


def test_default_adapter_path_is_printed(tiny_path, mixed_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("--model-path", tiny_path, "--data", mixed_data, "--max-steps", 1, "--lora-rank", 2, "--no-progress")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "tiny-llama.adapter.bin\n" and "adapter: tiny-llama.adapter.bin" in r.stderr
    assert (tmp_path / "tiny-llama.adapter.bin").exists()


def test_malformed_data_is_one_line_error(tiny_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"Q": "no answer"}\n')
    r = invoke("--model-path", tiny_path, "--data", bad, "--lora-path", tmp_path / "x.bin")
    assert r.exit_code == 1 and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"juno-py: error: {bad}:2: ") and '"A"' in last
    r = invoke(
        "--model-path",
        tiny_path,
        "--data",
        bad,
        "--lora-path",
        tmp_path / "x.bin",
        "--skip-bad-records",
        "--max-steps",
        1,
        "--no-progress",
    )
    assert r.exit_code == 0 and "1 bad records skipped" in r.stderr


def test_resume_without_state_is_one_line_error(tiny_path, mixed_data, tmp_path):
    r = invoke("--model-path", tiny_path, "--data", mixed_data, "--lora-path", tmp_path / "none.bin", "--resume")
    assert r.exit_code == 1 and "no resume state" in r.stderr.strip().splitlines()[-1]


def test_ctrl_c_saves_and_exits_cleanly(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "int.bin"
    state = tmp_path / "int.bin.state"
    cmd = [
        sys.executable,
        "-m",
        "juno_py",
        "lora",
        "--model-path",
        str(tiny_path),
        "--data",
        str(mixed_data),
        "--lora-path",
        str(out),
        "--max-steps",
        "1000000",
        "--save-every",
        "1",
        "--lora-rank",
        "2",
        "--no-progress",
        "--compute-dtype",
        "fp32",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
    while not state.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert state.exists(), proc.communicate()[1] if proc.poll() is not None else "no checkpoint appeared"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert stdout == f"{out}\n" and "stopped: interrupted" in stderr and "--resume" in stderr
    _, meta = load_state(state)
    assert meta["run"]["step"] >= 1
    read_adapter(out)
