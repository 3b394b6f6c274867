"""`juno-py full --optimizer galore` on SmolLM2-135M: a short run on the built-in facts whose merged GGUF
(`--requant auto`) has a lower loss on the held-out rewordings than the base, with the retention report.

The whole job (8 epochs on every target, then questions answered by the merged file) takes longer than a CI
test should; docs/training.md shows that run and its output."""

import json
import os
import subprocess
import sys

import pytest

from juno_py.train.data import BUILTIN_FACTS_HELDOUT

pytestmark = pytest.mark.slow


def test_short_galore_run_on_smollm2_lowers_heldout_loss_of_the_merged_gguf(smollm2_path, tmp_path):
    from juno_py.models import load_model
    from juno_py.train.data import load_examples
    from juno_py.train.steps import evaluate

    out = tmp_path / "facts-qv.gguf"
    cmd = [
        sys.executable,
        "-m",
        "juno_py",
        "full",
        "--model-path",
        str(smollm2_path),
        "--targets",
        "wv",
        "--max-steps",
        "4",
        "--lr",
        "3e-3",
        "--galore-rank",
        "16",
        "--validation-data",
        str(BUILTIN_FACTS_HELDOUT),
        "--validation-every",
        "2",
        "--validation-patience",
        "0",
        "--requant",
        "auto",
        "--report",
        str(tmp_path / "report.json"),
        "--events-out",
        str(tmp_path / "ev.jsonl"),
        "--output",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == f"{out}\n"
    print("\n" + "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("blk.")))

    base = load_model(smollm2_path)
    held, _ = load_examples([BUILTIN_FACTS_HELDOUT], base.tokenizer, 512)
    before = evaluate(base, held, 10)["loss"]
    after = evaluate(load_model(out), held, 10)["loss"]
    print(f"held-out loss: base {before:.3f} -> merged {after:.3f}")
    assert after < 0.9 * before
    events = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    val = [e["loss"] for e in events if e["kind"] == "validation"]
    assert len(val) == 2 and val[1] < val[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["requant"] == "auto" and report["summary"]["tensors_patched"] == 30
    assert report["summary"]["retention_min"] >= 0.9  # auto climbed until each tensor kept 90 % of its delta
    assert {t["source_type"] for t in report["tensors"]} == {"Q4_1"}
    assert "retention mean" in proc.stderr and "GaLore state:" in proc.stderr
