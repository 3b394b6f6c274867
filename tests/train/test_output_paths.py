"""Where training writes: an unwritable output is refused before the model loads, the space for the adapter and its
resume state is held before the first step, a write that fails anyway leaves the weights in a rescue folder, and
files get the umask's permissions. Errors are one line naming the target, never a temporary file."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from juno_py.atomic import OutputError, atomic_write_bytes, check_writable, release, reserve
from juno_py.cli.main import cli
from juno_py.lora import Mode, attach, read_adapter
from juno_py.models import load_model
from juno_py.train.data import load_dataset
from juno_py.train.loop import TrainConfig, train
from juno_py.train.state import load_state, state_path


def invoke(*args):
    return CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)


def unwritable_targets(tmp_path):
    """Paths no process can write a file at, root included: a missing folder, a file where a folder is expected,
    a folder of the proc file system, a directory given as the file."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    folder = tmp_path / "folder"
    folder.mkdir()
    return {
        "missing folder": (tmp_path / "no-such-folder" / "a.bin", "does not exist"),
        "file as folder": (a_file / "a.bin", "is not a folder"),
        "proc": (Path("/proc/a.bin"), "cannot create a file in /proc"),
        "directory": (folder, "is a directory"),
    }


@pytest.mark.parametrize("case", ["missing folder", "file as folder", "proc", "directory"])
def test_check_writable_names_the_target(case, tmp_path):
    target, expected = unwritable_targets(tmp_path)[case]
    with pytest.raises(OutputError, match=expected) as e:
        check_writable(target, "--lora-path")
    assert str(e.value).startswith(f"--lora-path {target}:") and ".tmp" not in str(e.value)
    with pytest.raises(OutputError) as e:  # the atomic write itself names the target too
        atomic_write_bytes(target, b"x")
    assert str(e.value).startswith(f"{target}:") and ".tmp" not in str(e.value)


@pytest.mark.parametrize("case", ["missing folder", "file as folder", "proc"])
@pytest.mark.parametrize("command", ["lora", "full", "merge", "export"])
def test_unwritable_output_is_refused_before_the_model_loads(command, case, tmp_path):
    target, expected = unwritable_targets(tmp_path)[case]
    missing = tmp_path / "no-such-model.gguf"  # reached only if the output check did not stop the command first
    flag = "--output"
    args = {
        "lora": ["lora", "--model-path", missing, "--output", target],
        "full": ["full", "--model-path", missing, "--output", target],
        "merge": ["merge", "--model-path", missing, "--adapter", missing, "--output", target],
        "export": [
            "export",
            "--format",
            "gguf-lora",
            "--model-path",
            missing,
            "--adapter",
            missing,
            "--output",
            target,
        ],
    }[command]
    r = invoke(*args)
    assert r.exit_code == 1 and r.stdout == "", r.output
    line = r.stderr.strip()
    assert "\n" not in line and len(line) <= 500
    assert line.startswith(f"juno-py: error: {flag} {target}:") and expected in line and ".tmp" not in line
    assert str(missing) not in line


def test_reservation_holds_the_space_and_the_write_fills_it(tmp_path):
    target = tmp_path / "a.bin"
    held = reserve(target, 1 << 20)
    assert held.parent == tmp_path and held.stat().st_size == 1 << 20
    assert held.stat().st_blocks * 512 >= 1 << 20  # allocated, not a sparse file
    atomic_write_bytes(target, b"payload")
    assert target.read_bytes() == b"payload" and not held.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]
    reserve(target, 4096)
    release(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_reservation_refuses_more_than_the_free_space(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OutputError, match="free some space") as e:
        reserve(tmp_path / "a.bin", free + (1 << 30))
    assert str(e.value).startswith(f"output {tmp_path / 'a.bin'}:")
    assert list(tmp_path.iterdir()) == []


def lora_command(tiny_path, data, out, *extra):
    return [
        sys.executable,
        "-m",
        "juno_py",
        "lora",
        "--model-path",
        str(tiny_path),
        "--data",
        str(data),
        "--lora-path",
        str(out),
        "--lora-rank",
        "2",
        "--no-progress",
        "--compute-dtype",
        "fp32",
        *map(str, extra),
    ]


def test_a_file_size_limit_is_found_before_the_first_step(tiny_path, mixed_data, tmp_path):
    """RLIMIT_FSIZE makes every write past 256 KiB fail with EFBIG, as a full disk fails with ENOSPC: the resume
    state (about 1 MiB held) cannot be reserved, so the run stops before training."""
    out = tmp_path / "out" / "a.bin"
    out.parent.mkdir()
    events = tmp_path / "events.jsonl"
    limit = "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18)); "
    run = "sys.argv = ['juno-py'] + sys.argv[1:]; runpy.run_module('juno_py', run_name='__main__')"
    cmd = [sys.executable, "-c", limit + run, *lora_command(tiny_path, mixed_data, out, "--max-steps", 3)[3:]]
    cmd += ["--events-out", str(events)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"juno-py: error: output {out}") and "cannot reserve" in line and ".tmp" not in line
    assert "trained" not in r.stderr
    assert "train_step" not in (events.read_text() if events.exists() else "")
    assert list(out.parent.iterdir()) == []  # no adapter, no state, no temporary file left


def test_files_get_the_umask_permissions(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "a.bin"
    cmd = lora_command(tiny_path, mixed_data, out, "--max-steps", 1)
    umask = "import os, runpy, sys; os.umask(0o027); "
    run = "sys.argv = ['juno-py'] + sys.argv[1:]; runpy.run_module('juno_py', run_name='__main__')"
    r = subprocess.run(
        [sys.executable, "-c", umask + run, *cmd[3:]],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o640 and state_path(out).stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("home", ["writable", "unwritable"])
def test_a_final_write_that_fails_saves_the_weights_in_the_rescue_folder(
    tiny_path, mixed_data, tmp_path, monkeypatch, home
):
    """The rescue folder is $JUNO_PY_HOME/rescued/, else the current folder."""
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path / "home") if home == "writable" else "/proc/juno-py")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    rescue_folder = tmp_path / "home" / "rescued" if home == "writable" else tmp_path / "cwd"
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "a.bin"
    model = load_model(tiny_path)
    train_set, _, _ = load_dataset([mixed_data], model.tokenizer, 256)
    adapters = attach(model, "qv", rank=2, alpha=4, mode=Mode.LORA, seed=0)
    calls = iter(range(1, 100))

    def remove_the_folder() -> bool:  # the output folder disappears during the run (an unmounted disk, say)
        if next(calls) == 2:
            shutil.rmtree(folder)
        return False

    cfg = TrainConfig(lr=1e-2, batch_size=2, max_steps=3, epochs=None, lora_path=target)
    with pytest.raises(OutputError) as e:
        train(model, adapters, train_set, cfg, stop_requested=remove_the_folder, progress=False, log=lambda s: None)
    message = str(e.value)
    rescued = list(rescue_folder.iterdir())
    adapter = next(p for p in rescued if p.suffix == ".bin")
    assert sorted(rescued) == sorted([adapter, state_path(adapter)])
    assert message.startswith(f"{target}: cannot write (") and f"saved in {adapter}" in message
    assert ".tmp" not in message and "\n" not in message and len(message) <= 500
    trained = {n: p.detach() for n, p in adapters.named_parameters()}
    for entry in read_adapter(adapter)[1]:
        assert torch.equal(torch.from_numpy(np.asarray(entry.A)), trained[f"{entry.key}.lora_A"]), entry.key
    _, meta = load_state(state_path(adapter))
    assert meta["run"]["step"] == 3


@pytest.mark.parametrize(
    "command, flag",
    [
        ("lora", "--metrics-out"),
        ("lora", "--events-out"),
        ("full", "--report"),
        ("full", "--metrics-out"),
        ("merge", "--report"),
        ("merge", "--events-out"),
    ],
)
def test_unwritable_side_outputs_are_refused_before_the_model_loads(command, flag, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    target = tmp_path / "no-such-folder" / "out.json"
    args = {
        "lora": ["lora", "--output", tmp_path / "a.bin"],
        "full": ["full", "--output", tmp_path / "a.gguf"],
        "merge": ["merge", "--adapter", missing, "--output", tmp_path / "a.gguf"],
    }[command]
    r = invoke(*args, "--model-path", missing, flag, target)
    assert (
        r.exit_code == 1
        and r.stderr.strip() == f"juno-py: error: {flag} {target}: folder {target.parent} does not exist"
    )
