"""Forward pass on CPU: prefill and decode tokens/s and peak RSS, juno-py (weights streamed from the quantized
bytes, or cached dequantized) against transformers loading the same GGUF (fp32), all in one run.

Each configuration runs in its own subprocess so that its peak RSS (ru_maxrss, which counts the memory-mapped
file pages it touched) is its own. Prefill: one forward over `--prefill` tokens (best of `--repeats`). Decode:
`--decode` greedy tokens with a KV cache after a 16-token prompt.

    python -m benchmarks.forward                       # both store models: table, benchmarks/results/cpu-forward.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import harness

CONFIGS = [("juno", "none"), ("juno", "bf16"), ("juno", "fp32"), ("transformers", "fp32")]
MODELS = ["smollm2-135m", "gemma3-270m"]


def _juno(path: str, cache: str):
    import torch

    from juno_py import load_model
    from juno_py.models.generate import decode_one_token, prefill

    model = load_model(path, weights_cache=cache)

    def forward(ids):
        with torch.no_grad():
            return model.project(model(torch.tensor([ids]))[0, -1])

    def decode(ids, n):
        cache_ = model.new_cache(1, len(ids) + n)
        token = int(prefill(model, torch.tensor([ids]), cache_).argmax())
        for _ in range(n - 1):
            token = int(decode_one_token(model, token, cache_).argmax())

    return forward, decode


def _transformers(path: str, cache: str):
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()

    def forward(ids):
        with torch.no_grad():
            return model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]

    def decode(ids, n):
        cache_, step = None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(n):
                out = model(step, cache=cache_, use_cache=True, logits_to_keep=1)
                cache_ = out.cache
                step = out.logits[:, -1:].argmax(-1)

    return forward, decode


def worker(args) -> dict:
    import torch

    from juno_py.store import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)

    path = str(resolve_model(args.model))
    t0 = time.perf_counter()
    forward, decode = (_juno if args.impl == "juno" else _transformers)(path, args.cache)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 5000, (args.prefill,), generator=g).tolist()
    forward(ids[:8])  # warm-up
    best = min(harness.cpu_times(lambda: forward(ids), args.repeats))
    t0 = time.perf_counter()
    decode(ids[:16], args.decode)
    decode_s = time.perf_counter() - t0
    return dict(
        model=args.model,
        impl=args.impl,
        cache=args.cache,
        load_s=load_s,
        prefill_tok_s=args.prefill / best,
        decode_tok_s=args.decode / decode_s,
        peak_rss_gib=harness.peak_rss_gib(),
        threads=torch.get_num_threads(),
        load_avg=os.getloadavg()[0],
    )


def run_all(args) -> list[dict]:
    """Every configuration once per round; per configuration, the best speeds over the rounds (a busy machine only
    ever slows a run down) and the largest peak RSS."""
    best: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        for model in args.models:
            for impl, cache in CONFIGS:
                cmd = harness.module_cmd(
                    "benchmarks.forward",
                    "--worker",
                    "--model",
                    model,
                    "--impl",
                    impl,
                    "--cache",
                    cache,
                    "--prefill",
                    str(args.prefill),
                    "--decode",
                    str(args.decode),
                    "--repeats",
                    str(args.repeats),
                    "--threads",
                    str(args.threads),
                )
                row = harness.run_json(cmd, f"{model} {impl} {cache}")
                print(
                    f"{model:14s} {impl:12s} cache={cache:5s} prefill {row['prefill_tok_s']:8.1f} tok/s  decode "
                    f"{row['decode_tok_s']:6.2f} tok/s  peak RSS {row['peak_rss_gib']:.2f} GiB  load "
                    f"{row['load_avg']:.1f}",
                    file=sys.stderr,
                )
                key = (model, impl, cache)
                if key in best:
                    old = best[key]
                    row = dict(
                        row,
                        prefill_tok_s=max(row["prefill_tok_s"], old["prefill_tok_s"]),
                        decode_tok_s=max(row["decode_tok_s"], old["decode_tok_s"]),
                        load_s=min(row["load_s"], old["load_s"]),
                        load_avg=min(row["load_avg"], old["load_avg"]),
                        peak_rss_gib=max(row["peak_rss_gib"], old["peak_rss_gib"]),
                    )
                best[key] = row
    return list(best.values())


COLUMNS = ["model", "implementation", "weights", "prefill tok/s", "decode tok/s", "peak RSS GiB", "load s", "load avg"]


def table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        impl = "juno-py" if r["impl"] == "juno" else "transformers (GGUF → fp32)"
        weights = {"none": "streamed from quantized bytes", "bf16": "cached bf16", "fp32": "cached fp32"}[r["cache"]]
        if r["impl"] != "juno":
            weights = "dense fp32"
        out.append(
            [
                r["model"],
                impl,
                weights,
                round(r["prefill_tok_s"], 1),
                round(r["decode_tok_s"], 2),
                round(r["peak_rss_gib"], 2),
                round(r["load_s"], 1),
                round(r["load_avg"], 1),
            ]
        )
    return out


def notes(rows: list[dict], args) -> list[str]:
    threads = rows[0]["threads"] if rows else "?"
    return [
        f"Prefill: one forward of {args.prefill} tokens (best of {args.repeats}); decode: {args.decode} greedy "
        f"tokens with a KV cache after a 16-token prompt; best of {args.rounds} round(s) of every configuration. "
        f"fp32 compute, {threads} torch threads.",
        "Peak RSS is the subprocess's ru_maxrss, memory-mapped GGUF pages included. Load avg: the machine's "
        "1-minute load average when the configuration finished (lowest over the rounds); above the CPU count, "
        "other processes shared the cores and every number is pessimistic.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="prefill timings per run (the best is kept)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration (the best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    harness.add_output_args(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = run_all(args)
    record = harness.results(
        "cpu-forward",
        "Forward pass and decoding on CPU",
        harness.command_line("benchmarks.forward"),
        COLUMNS,
        table_rows(rows),
        notes(rows, args),
    )
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
