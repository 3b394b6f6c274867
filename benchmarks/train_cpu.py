"""Training on CPU: seconds per step, tokens/s and peak RSS of juno-py (LoRA and DoRA, fp32 and bf16 compute)
against transformers (GGUF dequantized to fp32) with PEFT, in one run.

SmolLM2-135M, rank 8 on q and v, alpha 16, batches of 8 x 64 tokens (all supervised), AdamW. juno-py runs its
real training loop (`juno_py.train.loop.train`: data collation, clipping, optimizer, metrics); the peer runs the
plain PEFT step (forward with labels, backward, AdamW). Each configuration runs in its own subprocess so its
peak RSS (ru_maxrss, memory-mapped GGUF pages included) is its own. A step time is the median of `--steps`
timed steps after `--warmup` untimed ones; with `--rounds` > 1 the best round counts (a busy machine only
slows a run down).

    python -m benchmarks.train_cpu                               # table on stdout, benchmarks/results/cpu-training.json
    python -m benchmarks.train_cpu --out /tmp/cpu.json           # the results file elsewhere
    taskset -c 0,1 python -m benchmarks.train_cpu --synthetic    # SmolLM2's shapes and types, random blocks

`--synthetic` writes random valid blocks in SmolLM2-135M's exact shapes and types (Q4_1, Q8_0 embedding, tied
output; `juno_py.testing.synthetic.write_synthetic_llama`), for machines without the model store: decoding and matmul
time do not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

# (implementation, mode, compute dtype, weights cache, activation checkpointing)
CONFIGS = [
    ("peft", "lora", "fp32", "-", False),
    ("peft", "dora", "fp32", "-", False),
    ("juno", "lora", "fp32", "none", False),
    ("juno", "lora", "fp32", "fp32", False),
    ("juno", "lora", "bf16", "bf16", False),
    ("juno", "dora", "fp32", "none", False),
    ("juno", "dora", "bf16", "bf16", False),
    ("juno", "lora", "bf16", "none", False),
    ("juno", "dora", "bf16", "none", False),
    ("juno", "lora", "fp32", "none", True),
    ("juno", "lora", "bf16", "bf16", True),
]
MODEL = "smollm2-135m"


def _tokens(args):
    """The same random tokens for every implementation (ids below 20000 exist in SmolLM2's vocabulary)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(10, 20000, (args.batch, args.seq), generator=g)


def juno_steps(args) -> list[float]:
    """Step times of the real loop: the recorder's event clock between consecutive train_step events."""

    from juno_py.lora import Mode, attach
    from juno_py.metrics import MetricsRecorder
    from juno_py.models import load_model
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    model = load_model(args.model_file, compute_dtype=args.dtype, weights_cache=args.cache)
    adapters = attach(model, "qv", rank=8, alpha=16, mode=Mode[args.mode.upper()])
    ids = _tokens(args)
    n_steps = args.warmup + args.steps
    examples = [Example(row.tolist(), [True] * args.seq) for row in ids] * n_steps  # one batch per step
    cfg = TrainConfig(
        lr=1e-4,
        batch_size=args.batch,
        max_steps=n_steps,
        epochs=None,
        schedule="constant",
        max_seq_len=args.seq,
        seed=0,
        grad_checkpoint=args.ckpt,
    )
    rec = MetricsRecorder()
    t0 = time.time()
    train(model, adapters, examples, cfg, recorder=rec, progress=False, log=lambda s: None)
    stamps = [t0] + [e.time for e in rec.events if e.kind == "train_step"]
    return [b - a for a, b in zip(stamps, stamps[1:])][args.warmup :]


def peft_steps(args) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    p = Path(args.model_file)
    base = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, use_dora=args.mode == "dora"
        ),
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = _tokens(args)
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[args.warmup :]


def worker(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    times = (juno_steps if args.impl == "juno" else peft_steps)(args)
    step = statistics.median(times)
    return dict(
        impl=args.impl,
        mode=args.mode,
        dtype=args.dtype,
        cache=args.cache,
        ckpt=args.ckpt,
        step_s=step,
        tok_s=args.batch * args.seq / step,
        peak_rss_gib=harness.peak_rss_gib(),
        threads=torch.get_num_threads(),
        load_avg=os.getloadavg()[0],
    )


def run_all(args) -> list[dict]:
    best: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        for impl, mode, dtype, cache, ckpt in CONFIGS:
            name = f"{impl}-{mode}-{dtype}-{cache}" + ("-ckpt" if ckpt else "")
            if args.only and name not in args.only:
                continue
            cmd = harness.module_cmd(
                "benchmarks.train_cpu",
                "--worker",
                "--model-file",
                str(args.model_file),
                "--impl",
                impl,
                "--mode",
                mode,
                "--dtype",
                dtype,
                "--cache",
                cache,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--threads",
                str(args.threads),
                *(["--ckpt"] if ckpt else []),
            )
            row = harness.run_json(cmd, f"{impl} {mode} {dtype}")
            print(
                f"{name:28s} {row['step_s']:.3f} s/step "
                f"{row['tok_s']:7.1f} tok/s  peak RSS {row['peak_rss_gib']:.2f} GiB  load {row['load_avg']:.1f}",
                file=sys.stderr,
            )
            key = name
            if key not in best or row["step_s"] < best[key]["step_s"]:
                best[key] = dict(row, peak_rss_gib=max(row["peak_rss_gib"], best.get(key, row)["peak_rss_gib"]))
    return list(best.values())


COLUMNS = [
    "implementation",
    "mode",
    "compute",
    "frozen weights",
    "s/step",
    "tokens/s",
    "peak RSS GiB",
    "tokens/s vs peer",
    "RSS vs peer",
    "load avg",
]


def table_rows(rows: list[dict]) -> list[list]:
    peer = {r["mode"]: r for r in rows if r["impl"] == "peft"}
    out = []
    for r in rows:
        p = peer.get(r["mode"])
        if r["impl"] == "peft":
            name, weights, vs_t, vs_m = "transformers + PEFT", "dense fp32", "1.00x", "1.00x"
        else:
            name = "juno-py"
            weights = {"none": "streamed from Q4_1/Q8_0 bytes", "bf16": "cached bf16", "fp32": "cached fp32"}[
                r["cache"]
            ]
            if r["ckpt"]:
                weights += ", --grad-checkpoint"
            vs_t = f"{r['tok_s'] / p['tok_s']:.2f}x" if p else "-"
            vs_m = f"{r['peak_rss_gib'] / p['peak_rss_gib']:.2f}x" if p else "-"
        out.append(
            [
                name,
                r["mode"],
                r["dtype"],
                weights,
                round(r["step_s"], 3),
                round(r["tok_s"], 1),
                round(r["peak_rss_gib"], 2),
                vs_t,
                vs_m,
                round(r["load_avg"], 1),
            ]
        )
    return out


def notes(rows: list[dict], args) -> list[str]:
    threads = rows[0]["threads"] if rows else "?"
    what = (
        "synthetic SmolLM2-135M shapes (random Q4_1/Q8_0 blocks)" if args.synthetic else "SmolLM2-135M (Q4_1/Q8_0 GGUF)"
    )
    return [
        f"{what}, rank 8 on q,v, batches of {args.batch} x {args.seq} tokens, median of {args.steps} steps "
        f"after {args.warmup} warm-up, best of {args.rounds} round(s); {threads} torch threads.",
        "Peak RSS: the subprocess's ru_maxrss. Load avg: the machine's 1-minute load when the configuration "
        "finished; above the CPU count other processes shared the cores.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (the median counts)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration (the best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    ap.add_argument("--only", nargs="*", help="configurations to run, e.g. peft-lora-fp32-- juno-lora-bf16-bf16-ckpt")
    ap.add_argument("--synthetic", action="store_true", help="random blocks in SmolLM2's shapes (no model store)")
    harness.add_output_args(ap)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            from juno_py.testing.synthetic import SHAPE_SMOLLM2, write_synthetic_llama

            args.model_file = write_synthetic_llama(Path(tmp) / "synthetic-smollm2.gguf", SHAPE_SMOLLM2)
        else:
            from juno_py.store import resolve_model

            args.model_file = resolve_model(MODEL)
        rows = run_all(args)
    record = harness.results(
        "cpu-training",
        "LoRA and DoRA training on CPU",
        harness.command_line("benchmarks.train_cpu"),
        COLUMNS,
        table_rows(rows),
        notes(rows, args),
    )
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
