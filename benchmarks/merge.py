"""Merge on CPU: time and peak RSS of `merge_model` on the real models, and for `--requant source`, `auto` and
`f16` the retention, file size and the perplexity / KL divergence of the merged model against playback.

    python -m benchmarks.merge                                   # trains a short adapter per model first
    python -m benchmarks.merge --adapter smollm2-135m=a.bin --adapter gemma3-270m=b.bin
    python -m benchmarks.merge --models smollm2-135m --train-steps 40 --threads 2

The table goes to benchmarks/results/merge.json (`--out FILE` elsewhere).

Each merge runs in a fresh process, so its peak RSS is the merge's own (the evaluation runs after the peak is
read). Without --adapter, an adapter is trained with `juno-py lora`'s defaults (all targets, r 16, alpha 32, lr
2e-3, the built-in facts) for --train-steps steps. Evaluation data: the built-in held-out facts (the rewordings
the adapter never saw) and a few sentences of general text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

GENERAL_TEXT = [
    "The river flows through the old town, past the market and the stone bridge, and on toward the sea.",
    "Water boils at one hundred degrees Celsius at sea level; at higher altitudes it boils at a lower temperature.",
    "She opened the letter, read the first line twice, and then sat down by the window to read the rest.",
    "A computer program is a sequence of instructions that a computer follows to perform a task.",
]


def child(model: str, adapter: str, requant: str, out: str, eval_files: list[str], threads: int) -> dict:
    """One merge in this (fresh) process: time and peak RSS of the merge alone, then the evaluation."""
    import torch

    from juno_py.merge import merge_model
    from juno_py.merge.evaluate import compare_with_playback
    from juno_py.metrics import peak_rss_bytes
    from juno_py.store import resolve_model

    if threads:
        torch.set_num_threads(threads)
    base = resolve_model(model)
    t0 = time.perf_counter()
    report = merge_model(base, out, [adapter], requant=requant, min_retention=0.9)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    s = report.summary()
    evals = {Path(f).stem: compare_with_playback(base, [(adapter, 1.0)], out, [f]) for f in eval_files}
    types = {}
    for t in report.tensors:
        key = f"{t.source_type}->{t.output_type}"
        types[key] = types.get(key, 0) + 1
    return {
        "model": model,
        "requant": requant,
        "merge_seconds": seconds,
        "peak_rss_bytes": peak,
        "tensors": s["tensors_patched"],
        "retention_mean": s["retention_mean"],
        "retention_min": s["retention_min"],
        "file_bytes_base": s["file_bytes_base"],
        "file_bytes_output": s["file_bytes_output"],
        "size_cost_vs_source_bytes": s["size_cost_vs_source_bytes"],
        "types": types,
        "eval": evals,
    }


def train(model: str, steps: int, out: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "juno_py",
        "lora",
        "--model-path",
        model,
        "--max-steps",
        str(steps),
        "--lora-path",
        str(out),
        "--no-progress",
    ]
    print("training:", " ".join(cmd[2:]), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--adapter", action="append", default=[], help="MODEL=adapter.bin (else one is trained)")
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--requants", default="source,auto,f16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each merge process (0: default)")
    ap.add_argument("--work", default=None, help="folder for adapters and merged files (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "ADAPTER", "REQUANT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--eval", action="append", default=[], help=argparse.SUPPRESS)
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.eval, args.threads)))
        return

    from juno_py.train.data import BUILTIN_FACTS_HELDOUT

    work = Path(args.work or tempfile.mkdtemp(prefix="juno-merge-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    general = work / "general.jsonl"
    general.write_text("".join(json.dumps({"text": t}) + "\n" for t in GENERAL_TEXT))
    given = dict(a.split("=", 1) for a in args.adapter)
    rows = []
    for model in args.models.split(","):
        adapter = Path(given[model]) if model in given else train(model, args.train_steps, work / f"{model}.bin")
        for requant in args.requants.split(","):
            out = work / f"{model}.{requant}.gguf"
            cmd = harness.module_cmd(
                "benchmarks.merge",
                "--child",
                model,
                str(adapter),
                requant,
                str(out),
                "--eval",
                str(BUILTIN_FACTS_HELDOUT),
                "--eval",
                str(general),
                "--threads",
                str(args.threads),
            )
            res = harness.run_json(cmd, f"{model} {requant}")
            rows.append(res)
            print(json.dumps(res), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    columns = [
        "model",
        "requant",
        "merge s",
        "peak RSS MiB",
        "retention mean / min",
        "size MiB (base)",
        "cost vs source MiB",
        "data",
        "tokens",
        "ppl merged / playback",
        "mean KL",
    ]
    table = []
    for r in rows:
        head = [
            r["model"],
            r["requant"],
            round(r["merge_seconds"], 1),
            round(r["peak_rss_bytes"] / 2**20),
            f"{r['retention_mean']:.3f} / {r['retention_min']:.3f}",
            f"{r['file_bytes_output'] / 2**20:.2f} ({r['file_bytes_base'] / 2**20:.2f})",
            f"{r['size_cost_vs_source_bytes'] / 2**20:+.2f}",
        ]
        for i, (name, e) in enumerate(r["eval"].items()):
            table.append(
                (head if i == 0 else [""] * len(head))
                + [name, e["tokens"], f"{e['ppl_merged']:.3f} / {e['ppl_playback']:.3f}", f"{e['kl_mean']:.2e}"]
            )
    print(harness.markdown_table(columns, table))
    harness.write_results(
        args,
        harness.results(
            "merge",
            "Merging an adapter into the GGUF on CPU",
            harness.command_line("benchmarks.merge"),
            columns,
            table,
            [
                "Each merge in a fresh process (merge time and peak RSS are the merge's alone); perplexity and mean "
                "KL(playback ‖ merged) against the base with the adapter played at run time."
            ],
        ),
    )


if __name__ == "__main__":
    main()
