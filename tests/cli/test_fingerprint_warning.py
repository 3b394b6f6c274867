"""A LoRA played on a base of the same shapes but other weights: `juno-py local` (the real command, in its own
process, so Python's own warning printer is what would show raw warnings) says so in one line, once."""

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.gguf import GGMLType
from tests.merge.helpers import make_adapter

ROOT = Path(__file__).resolve().parents[2]


def test_local_warns_once_about_a_differing_fingerprint(tiny_gguf, tmp_path):
    trained_on = tiny_gguf("llama", GGMLType.Q8_0)
    other = tiny_gguf("llama", GGMLType.Q8_0, seed=1)  # same shapes, other weights
    adapter = make_adapter(trained_on, tmp_path / "a.bin", targets="all")  # 7 targets x 2 layers: 14 entries
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    run = subprocess.run(
        [sys.executable, "-m", "juno_py", "local", "--model-path", str(other), "--lora-play", str(adapter)]
        + ["--prompt", "hi", "--max-tokens", "2", "--temperature", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    warned = [line for line in lines if "fingerprint differs" in line]
    assert len(warned) == 1, run.stderr
    assert warned[0].startswith("juno-py: warning: ") and "and 13 more entries" in warned[0]
    assert str(adapter) in warned[0] and str(other) in warned[0] and len(warned[0]) <= 500
    assert "Warning" not in run.stderr and "warnings.warn" not in run.stderr  # no raw Python warning
    assert "tokens/s" in lines[-1]

    # the adapter's own base: no warning at all
    res = CliRunner().invoke(
        cli,
        ["local", "--model-path", str(trained_on), "--lora-play", str(adapter), "--prompt", "hi"]
        + ["--max-tokens", "2", "--temperature", "0"],
    )
    assert res.exit_code == 0 and "warning" not in res.stderr, res.output
