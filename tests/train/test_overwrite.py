"""A rerun never silently replaces a trained output: `lora`, `full` and `import` refuse an existing adapter, model
or resume state unless --overwrite (or --resume, which continues from that state); and every run names the large
files it wrote with their sizes."""

import re

from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.metrics import format_bytes
from juno_py.train.state import state_path
from tests.merge.helpers import make_adapter


def run(*args):
    return CliRunner().invoke(cli, list(map(str, args)))


def lora_args(tiny_path, data, out, *extra):
    args = ["lora", "--model-path", tiny_path, "--data", data, "--lora-path", out, "--lora-rank", 2]
    return args + ["--compute-dtype", "fp32", "--no-progress", "--max-steps", 1, *extra]


def refusal(r, existing):
    """The one-line usage error naming the existing file and the flag that allows replacing it."""
    assert r.exit_code == 2 and r.stdout == "", r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: {existing} exists: pass --overwrite to replace it") and len(line) <= 500
    return line


def said_size(stderr: str, label: str, path) -> None:
    """stderr has `<label>: <path> (<size>)` with the file's actual size."""
    sizes = re.findall(rf"^{re.escape(label)}: {re.escape(str(path))} \(([^)]+)\)", stderr, re.M)
    assert sizes == [format_bytes(path.stat().st_size)], stderr


def test_lora_refuses_an_existing_adapter_unless_overwrite_or_resume(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "a.bin"
    r = run(*lora_args(tiny_path, mixed_data, out))
    assert r.exit_code == 0, r.stderr
    said_size(r.stderr, "adapter", out)
    said_size(r.stderr, "resume state", state_path(out))
    adapter, state = out.read_bytes(), state_path(out).read_bytes()

    line = refusal(run(*lora_args(tiny_path, mixed_data, out)), out)
    assert "--resume" in line and "choose another --output" in line
    assert out.read_bytes() == adapter and state_path(out).read_bytes() == state

    out.unlink()  # the resume state alone is a trained run too
    refusal(run(*lora_args(tiny_path, mixed_data, out)), state_path(out))
    assert state_path(out).read_bytes() == state

    r = run(*lora_args(tiny_path, mixed_data, out, "--max-steps", 2, "--resume"))
    assert r.exit_code == 0 and "resumed from" in r.stderr, r.stderr
    r = run(*lora_args(tiny_path, mixed_data, out, "--overwrite"))
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes() != adapter or state_path(out).read_bytes() != state


def test_full_refuses_an_existing_model_and_names_its_files(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "f.gguf"
    args = ["full", "--model-path", tiny_path, "--data", mixed_data, "--output", out, "--optimizer", "adamw"]
    args += ["--targets", "qv", "--no-galore-per-layer", "--max-steps", 1, "--no-progress"]
    r = run(*args)
    assert r.exit_code == 0, r.stderr
    said_size(r.stderr, "model", out)
    said_size(r.stderr, "resume state", state_path(out))
    before = out.read_bytes()
    refusal(run(*args), out)
    assert out.read_bytes() == before
    assert run(*args, "--overwrite").exit_code == 0


def test_import_refuses_an_existing_adapter(tiny_path, tmp_path):
    adapter = make_adapter(tiny_path, tmp_path / "a.bin", targets="qv", rank=2)
    r = run("export", "--format", "peft", "--model-path", tiny_path, "--lora-path", adapter, "--output", tmp_path / "p")
    assert r.exit_code == 0, r.stderr
    target = tmp_path / "b.bin"
    target.write_bytes(b"keep")
    line = refusal(run("import", tmp_path / "p", "--model-path", tiny_path, "--lora-path", target), target)
    assert "--resume" not in line and target.read_bytes() == b"keep"
    r = run("import", tmp_path / "p", "--model-path", tiny_path, "--lora-path", target, "--overwrite")
    assert r.exit_code == 0 and target.read_bytes() != b"keep", r.stderr


def test_merge_names_its_output_and_explains_auto(tiny_path, tmp_path):
    adapter = make_adapter(tiny_path, tmp_path / "a.bin", targets="qv", rank=2)
    out = tmp_path / "m.gguf"
    r = run("merge", "--model-path", tiny_path, "--lora-path", adapter, "--output", out, "--requant", "auto")
    assert r.exit_code == 0, r.stderr
    said_size(r.stderr, "merged model", out)
    assert len([x for x in r.stderr.splitlines() if x.startswith("auto: ")]) == 1, r.stderr
