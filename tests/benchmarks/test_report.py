"""docs/performance.md is generated from benchmarks/results/*.json: it must be exactly what the report makes."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parents[2]


def test_performance_doc_matches_the_results():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def _record(**kw):
    record = dict(
        capability="cpu-training",
        title="Training on CPU",
        command="python -m benchmarks.train_cpu",
        date="2026-12-01",
        hardware="2 cores",
        software={"torch": "2.13.0"},
        load_average="0.5 0.4 0.3",
        columns=["configuration", "s/step"],
        rows=[["juno lora bf16", 1.029]],
        notes=["median of 5"],
    )
    record.update(kw)
    return record


def test_check_fails_when_the_doc_drifts_and_passes_once_regenerated(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "cpu-training.json").write_text(json.dumps(_record()))
    doc = tmp_path / "performance.md"
    args = ["--results-dir", str(results), "--output", str(doc)]
    assert report.main(args + ["--check"]) == 1  # no page yet
    assert report.main(args) == 0
    text = doc.read_text()
    assert "## Training on CPU" in text and "`python -m benchmarks.train_cpu`" in text
    assert "| juno lora bf16 | 1.029 |" in text and "Load average: 0.5 0.4 0.3." in text and "- median of 5" in text
    assert report.main(args + ["--check"]) == 0
    (results / "cpu-training.json").write_text(json.dumps(_record(rows=[["juno lora bf16", 1.03]])))
    assert report.main(args + ["--check"]) == 1


def test_a_results_file_whose_rows_do_not_fit_its_columns_is_refused(tmp_path):
    (tmp_path / "cpu-training.json").write_text(json.dumps(_record(rows=[["only one cell"]])))
    assert report.main(["--results-dir", str(tmp_path), "--output", str(tmp_path / "p.md")]) == 2
    (tmp_path / "cpu-training.json").write_text(json.dumps(_record(capability="other")))
    assert report.main(["--results-dir", str(tmp_path), "--output", str(tmp_path / "p.md")]) == 2


def test_peak_breakdown_finds_what_is_live_at_the_allocators_peak():
    from benchmarks.harness import peak_breakdown

    here = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}]
    loss = [{"filename": "/repo/juno_py/models/loss.py", "line": 40, "name": "_chunk_loss"}] + here
    embed = [{"filename": "/repo/juno_py/models/model.py", "line": 9, "name": "forward"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": embed},
        {"action": "alloc", "addr": 2, "size": 300, "frames": loss},
        {"action": "alloc", "addr": 3, "size": 50, "frames": here},
        {"action": "free_requested", "addr": 2, "size": 300},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 2, "size": 200, "frames": embed},  # the address reused: a new block
        {"action": "free_completed", "addr": 2, "size": 200},  # a completion of the earlier free, not this block
    ]
    peak, groups = peak_breakdown(trace)
    assert peak == 450
    assert groups == [
        ("juno_py/models/loss.py:40 _chunk_loss", 300, 1),
        ("juno_py/models/model.py:9 forward", 100, 1),
        ("?", 50, 1),
    ]
