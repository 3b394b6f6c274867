"""Training on a busy CPU: juno-py's own thread choice (`juno_py.threads.choose` at the start, `StallGuard` during
the run, what `juno-py lora` does without `--threads`) against `--threads 1`, while another CPU-bound process runs.

The default `juno-py lora` step (SmolLM2-135M, LoRA q,v r 8, bf16 compute, bf16 weights cache, batches of 8 x 64
tokens) runs in its own process per configuration. The other process is a Python busy loop, started either before
the training process (so the thread choice sees it) or after its first `--quiet-steps` steps (so the guard has to
notice it), and stopped when the configuration ends. Throughput: the tokens of the steps run while the busy loop ran
over their wall time, the guard's reaction included; the quiet rows time the same steps with nothing else running.

    python -m benchmarks.threads_cpu                 # table on stdout, benchmarks/results/cpu-threads.json
    python -m benchmarks.threads_cpu --synthetic     # SmolLM2's shapes and types, random blocks (no model store)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

# (threads: "auto" or a count, when the busy process starts: "none", "before", "during")
CONFIGS = [
    ("auto", "none"),
    ("1", "none"),
    ("auto", "before"),
    ("1", "before"),
    ("auto", "during"),
    ("1", "during"),
]
BUSY = [sys.executable, "-c", "while True: pass"]
COLUMNS = ["other process", "threads", "tokens/s", "× --threads 1", "threads at the end", "guard's changes", "load avg"]


def worker(args) -> dict:
    """One configuration: the real training loop with the CLI's thread setup; the busy loop started after
    `quiet_steps` steps when `busy` is "during"."""
    import torch

    from juno_py import threads
    from juno_py.cli.common import thread_guard
    from juno_py.lora import Mode, attach
    from juno_py.metrics import MetricsRecorder
    from juno_py.models import load_model
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    requested = None if args.threads == "auto" else int(args.threads)
    n = threads.setup(requested)
    guard = thread_guard({"device": "cpu", "threads": requested}, n, distributed_run=False)
    model = load_model(args.model_file, compute_dtype="bf16", weights_cache="bf16")
    adapters = attach(model, "qv", rank=8, alpha=16, mode=Mode.LORA)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 20000, (args.batch, args.seq), generator=g)
    total = args.quiet_steps + args.steps
    examples = [Example(row.tolist(), [True] * args.seq) for row in ids] * total
    busy: list[subprocess.Popen] = []
    marks: list[float] = []

    class Recorder(MetricsRecorder):
        def emit(self, kind, **values):
            event = super().emit(kind, **values)
            if kind == "train_step" and values["step"] == args.quiet_steps:
                marks.append(time.perf_counter())
                if args.busy == "during":
                    busy.append(subprocess.Popen(BUSY))
            return event

    cfg = TrainConfig(
        lr=1e-4, batch_size=args.batch, max_steps=total, epochs=None, schedule="constant", max_seq_len=args.seq
    )
    try:
        train(
            model, adapters, examples, cfg, recorder=Recorder(), progress=False, log=lambda s: None, thread_guard=guard
        )
        end = time.perf_counter()
    finally:
        for p in busy:
            p.kill()
    seconds = end - marks[0]
    return dict(
        threads=args.threads,
        busy=args.busy,
        tok_s=args.steps * args.batch * args.seq / seconds,
        start_threads=n,
        end_threads=guard.threads,
        changes=guard.changes,
        load_avg=os.getloadavg()[0],
    )


def run_all(args, model_file: Path) -> list[dict]:
    rows = []
    for n, busy in CONFIGS:
        cmd = harness.module_cmd(
            "benchmarks.threads_cpu",
            "--worker",
            "--model-file",
            str(model_file),
            "--threads-mode",
            n,
            "--busy",
            busy,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--steps",
            str(args.steps),
            "--quiet-steps",
            str(args.quiet_steps),
        )
        other = subprocess.Popen(BUSY) if busy == "before" else None
        try:
            if other is not None:
                time.sleep(1.0)  # the busy loop shows in /proc/stat before the thread choice samples it
            row = harness.run_json(cmd, f"threads {n}, busy {busy}")
        finally:
            if other is not None:
                other.kill()
                other.wait()
        print(
            f"threads {n:4s} busy {busy:6s} {row['tok_s']:7.1f} tok/s  threads {row['start_threads']} -> "
            f"{row['end_threads']}  load {row['load_avg']:.1f}",
            file=sys.stderr,
        )
        rows.append(row)
    return rows


def table_rows(rows: list[dict]) -> list[list]:
    one = {r["busy"]: r["tok_s"] for r in rows if r["threads"] == "1"}
    what = {"none": "none", "before": "running from the start", "during": "started after the first steps"}
    out = []
    for r in rows:
        label = "--threads 1" if r["threads"] == "1" else f"juno-py's choice ({r['start_threads']} at the start)"
        ratio = r["tok_s"] / one[r["busy"]] if r["busy"] in one else float("nan")
        changes = ", ".join(f"{a}→{b}" for a, b in r["changes"]) or "-"
        out.append(
            [
                what[r["busy"]],
                label,
                f"{r['tok_s']:.1f}",
                f"**{ratio:.2f}×**" if r["threads"] != "1" else "1.00×",
                r["end_threads"],
                changes,
                f"{r['load_avg']:.1f}",
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a .gguf file or a model-store name")
    ap.add_argument("--synthetic", action="store_true", help="random blocks in SmolLM2's shapes (no model store)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="steps timed (with the busy process, where there is one)")
    ap.add_argument("--quiet-steps", type=int, default=3, help="steps before the timed ones")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    ap.add_argument("--threads-mode", dest="threads", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--busy", default="none", help=argparse.SUPPRESS)
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    from juno_py.store import resolve_model

    tmp = None
    if args.synthetic:
        from juno_py.testing.synthetic import SHAPE_SMOLLM2, write_synthetic_llama

        tmp = tempfile.TemporaryDirectory()
        model_file = write_synthetic_llama(Path(tmp.name) / "smollm2-shaped.gguf", SHAPE_SMOLLM2)
        label = "SmolLM2-135M-shaped (random blocks)"
    else:
        model_file = Path(resolve_model(args.model))
        label = model_file.stem
    rows = run_all(args, model_file)
    record = harness.results(
        "cpu-threads",
        "Training on a busy CPU: the thread choice against --threads 1",
        harness.command_line("benchmarks.threads_cpu"),
        COLUMNS,
        table_rows(rows),
        [
            f"Model: {label}; the default `juno-py lora` step (LoRA q,v r 8, bf16 compute and weights cache), "
            f"batches of {args.batch} x {args.seq} tokens, {args.steps} steps timed after {args.quiet_steps}.",
            "Other process: a Python busy loop (one CPU-bound thread). tokens/s: the timed steps' tokens over their "
            "wall time, the thread guard's reaction included. × --threads 1: against the --threads 1 row of the "
            "same other-process setting, in the same run.",
            "Load avg: the 1-minute load when the configuration finished (the busy loop counts 1).",
        ],
    )
    print(harness.markdown_table(record["columns"], record["rows"]))
    harness.write_results(args, record)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
