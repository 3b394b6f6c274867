"""An exception no command expected is one line on stderr, exit status 1, and a report file with the traceback."""

from pathlib import Path

from click.testing import CliRunner

from juno_py import store
from juno_py.cli.main import cli


def test_unexpected_exception_is_one_line_and_a_report(tmp_path, monkeypatch):
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path / "home"))

    def broken(*args, **kwargs):
        raise RuntimeError("the reader broke\n" + "x" * 1000)

    monkeypatch.setattr(store, "resolve_model", broken)
    r = CliRunner().invoke(cli, ["inspect", "whatever.gguf"])
    assert r.exit_code == 1 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    prefix = "juno-py: internal error: RuntimeError: the reader broke xxx"
    assert lines[0].startswith(prefix) and "x" * 300 not in lines[0]
    report = Path(lines[0].rsplit("(full report: ", 1)[1].rstrip(")"))
    assert report.parent == tmp_path / "home" / "reports"
    text = report.read_text()
    assert "Traceback" in text and "RuntimeError: the reader broke" in text and "x" * 1000 in text
    assert "in broken" in text


def test_user_errors_and_interrupts_are_not_internal_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 1 and "internal error" not in r.stderr
    r = CliRunner().invoke(cli, ["lora", "--lora-rank", "0"])
    assert r.exit_code == 2 and "internal error" not in r.stderr

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def end_of_input(*args, **kwargs):
        raise EOFError

    for raiser in (interrupted, end_of_input):  # click's own "Aborted!", not an internal error
        monkeypatch.setattr(store, "resolve_model", raiser)
        r = CliRunner().invoke(cli, ["inspect", "whatever.gguf"])
        assert r.exit_code == 1 and "Aborted!" in r.stderr and "internal error" not in r.stderr
    assert not (tmp_path / "home" / "reports").exists()


def test_a_closed_stdout_ends_quietly():
    """`juno-py models list | head -0`: the reader goes away; no internal error, no report, no traceback."""
    import subprocess
    import sys

    p = subprocess.run(
        f"{sys.executable} -m juno_py models list | head -c 0",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
