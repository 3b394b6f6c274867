"""One naming scheme for adapter files: `--adapter` wherever one is read (local, eval, merge, export), `--output`
wherever one is written (lora, import). The old names still work, each with a one-line note on stderr."""

import pytest
from click.testing import CliRunner

from juno_py.cli.main import cli
from tests.merge.helpers import make_adapter


def run(*args):
    return CliRunner().invoke(cli, list(map(str, args)))


def notes(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("juno-py: note: ")]


@pytest.fixture
def adapter(tiny_path, tmp_path):
    return make_adapter(tiny_path, tmp_path / "a.bin", targets="qv", rank=2, b_std=0.05)


@pytest.mark.parametrize(
    "command, new, old",
    [
        (("local", "--prompt", "Hi", "--max-tokens", 4, "--temperature", 0), "--adapter", "--lora-play"),
        (("eval", "--data", "DATA"), "--adapter", "--lora-play"),
    ],
)
def test_playback_reads_adapter_under_either_name(command, new, old, tiny_path, adapter, mixed_data):
    args = [mixed_data if a == "DATA" else a for a in command] + ["--model-path", tiny_path]
    r_new, r_old, r_base = run(*args, new, adapter), run(*args, old, adapter), run(*args)
    assert r_new.exit_code == 0 and r_old.exit_code == 0, r_new.stderr + r_old.stderr
    assert r_new.stdout == r_old.stdout
    if command[0] == "eval":  # the adapter changes the loss: it was played under both names
        assert r_new.stdout != r_base.stdout
    missing = adapter.with_name("missing.bin")  # and a file that is not there is named under either name
    for flag in (new, old):
        r = run(*args, flag, missing)
        assert r.exit_code == 1 and str(missing) in r.stderr.splitlines()[-1], r.stderr
    assert notes(r_new) == [] and notes(r_old) == [f"juno-py: note: cli {command[0]}: {old} is deprecated; use {new}"]
    r = run(*args, new, adapter, old, adapter)
    assert r.exit_code == 2 and f"{old} is the deprecated spelling of {new}: give {new} only" in r.stderr


def test_merge_and_export_read_adapter_under_either_name(tiny_path, adapter, tmp_path):
    for command, extra in (("merge", []), ("export", ["--format", "gguf-lora"])):
        outs = []
        for i, flag in enumerate(("--adapter", "--lora-path")):
            out = tmp_path / f"{command}{i}.gguf"
            r = run(command, *extra, "--model-path", tiny_path, flag, adapter, "--output", out)
            assert r.exit_code == 0, r.stderr
            assert len(notes(r)) == (flag == "--lora-path"), r.stderr
            outs.append(out.read_bytes())
        assert outs[0] == outs[1]
        r = run(command, *extra, "--model-path", tiny_path, "--output", tmp_path / "x.gguf")
        assert r.exit_code == 2 and "Missing option '--adapter'" in r.stderr


def test_lora_and_import_write_output_under_either_name(tiny_path, mixed_data, adapter, tmp_path):
    common = ["--model-path", tiny_path, "--data", mixed_data, "--lora-rank", 2, "--max-steps", 1, "--no-progress"]
    outs = []
    for flag in ("--output", "--lora-path"):
        out = tmp_path / f"{flag.strip('-')}.bin"
        r = run("lora", *common, flag, out)
        assert r.exit_code == 0 and r.stdout.strip() == str(out), r.stderr
        assert notes(r) == (
            [] if flag == "--output" else ["juno-py: note: cli lora: --lora-path is deprecated; use --output"]
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]  # same seed, same run: the same adapter under either name
    peft = tmp_path / "peft"
    assert (
        run("export", "--format", "peft", "--model-path", tiny_path, "--adapter", adapter, "--output", peft).exit_code
        == 0
    )
    for flag in ("--output", "--lora-path"):
        out = tmp_path / f"imported-{flag.strip('-')}.bin"
        r = run("import", peft, "--model-path", tiny_path, flag, out)
        assert r.exit_code == 0 and out.exists() and len(notes(r)) == (flag == "--lora-path"), r.stderr
    r = run("import", peft, "--model-path", tiny_path)
    assert r.exit_code == 2 and "Missing option '--output'" in r.stderr
