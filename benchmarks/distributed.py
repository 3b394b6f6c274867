"""Data-parallel scaling: tokens/s of the real training loop on one plain process against N torchrun processes
(DistributedDataParallel; Gloo on CPU, NCCL on CUDA), on the same global batches, in one run.

Strong scaling: the global batch (`--batch` rows of `--seq` tokens, all supervised) is the same for every
process count, each rank takes its share (juno_py.train.distributed). tokens/s counts the global batch's real
tokens over the steps after `--warmup`, from the recorder's event clock on rank 0. The final loss shows that every
configuration trained on the same batches (equal to float tolerance).

Model: `--model NAME|PATH` (a GGUF, e.g. the store's smollm2-135m), or `--shape smollm2|7b` to write a synthetic
model of that shape once (random valid blocks, juno_py.testing.synthetic), for machines without the store.

    python -m benchmarks.distributed --device cpu --procs single,2 --model smollm2-135m   # distributed-cpu.json
    python -m benchmarks.distributed --device cuda --procs single,1,2 --shape smollm2 --batch 32 --seq 256
    python -m benchmarks.distributed ... --json rows.json --out /tmp/distributed.json

`--procs`: `single` is one plain process (no torchrun, no DDP); an integer N runs `torchrun --nproc-per-node N`
(`1` checks the NCCL/Gloo path on one device).
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


def worker(args) -> None:
    """One rank (or the single process): train `--steps` steps; rank 0 writes the result JSON."""
    import torch

    from juno_py.lora import attach
    from juno_py.metrics import MetricsRecorder, peak_rss_bytes
    from juno_py.models import load_model
    from juno_py.precision import resolve_compute_dtype, resolve_weights_cache
    from juno_py.store import resolve_model
    from juno_py.train import distributed
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    world = distributed.init_from_env(args.device)
    device = str(world.device) if world.active else args.device
    path = resolve_model(args.model)
    compute = resolve_compute_dtype(args.compute_dtype, device)
    cache = resolve_weights_cache("auto", path, compute, device)
    model = load_model(path, device=device, weights_cache=cache, compute_dtype=compute)
    adapters = attach(model, args.targets, rank=args.rank, alpha=2.0 * args.rank, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, min(20000, model.output.out_features), (args.batch * args.steps, args.seq), generator=g)
    examples = [Example(row.tolist(), [True] * args.seq) for row in ids]
    micro = args.micro_batch or args.batch
    cfg = TrainConfig(
        lr=1e-4,
        batch_size=micro,
        accumulation=args.batch // micro,
        max_steps=args.steps,
        epochs=None,
        schedule="constant",
        max_seq_len=args.seq,
        grad_checkpoint=args.grad_checkpoint,
    )
    rec = MetricsRecorder()
    if "cuda" in device:
        torch.cuda.reset_peak_memory_stats()
    train(model, adapters, examples, cfg, recorder=rec, progress=False, log=lambda m: None)
    steps = [e for e in rec.events if e.kind == "train_step"]
    timed = steps[args.warmup :]  # each step's time: from the previous step's event to its own
    seconds = timed[-1].time - steps[args.warmup - 1].time
    tokens = sum(e.values["tokens"] for e in timed)  # of the global batch
    peak_gpu = torch.cuda.max_memory_allocated() if "cuda" in device else 0
    peak = world.sum([peak_rss_bytes(), peak_gpu])  # summed over the ranks: what the job holds
    if world.is_main:
        Path(args.result).write_text(
            json.dumps(
                {
                    "processes": world.size if world.active else 0,
                    "backend": world.backend or "-",
                    "device": device,
                    "compute": str(compute).removeprefix("torch."),
                    "weights_cache": cache,
                    "steps": len(steps),
                    "timed_steps": len(timed),
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "final_loss": steps[-1].values["loss"],
                    "peak_rss_gib_sum": peak[0] / 2**30,
                    "peak_gpu_gib_sum": peak[1] / 2**30,
                    "threads_per_process": torch.get_num_threads(),
                }
            )
        )
    distributed.shutdown()


def launch(args, procs: str, result: Path, model: str) -> dict:
    cmd_args = [
        "--worker",
        "--result",
        str(result),
        "--model",
        model,
        "--device",
        args.device,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--rank",
        str(args.rank),
        "--targets",
        args.targets,
        "--compute-dtype",
        args.compute_dtype,
        "--micro-batch",
        str(args.micro_batch),
    ]
    if args.grad_checkpoint:
        cmd_args.append("--grad-checkpoint")
    env = {**os.environ, "PYTHONPATH": str(harness.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if procs == "single":
        if args.threads:
            cmd_args += ["--threads", str(args.threads)]
        cmd = harness.module_cmd("benchmarks.distributed", *cmd_args)
    else:
        n = int(procs)
        if args.device == "cpu":  # the same cores in total: threads per process = total / N
            env["OMP_NUM_THREADS"] = str(max(1, (args.threads or os.cpu_count() or 1) // n))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(n),
            "--module",
            "benchmarks.distributed",
            *cmd_args,
        ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=harness.ROOT)
    if proc.returncode != 0:
        sys.exit(f"{procs}: failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(result.read_text())
    out["label"] = "1 process" if procs == "single" else f"torchrun {procs}"
    out["wall_s"] = time.perf_counter() - t0
    return out


COLUMNS = [
    "run",
    "backend",
    "threads/process",
    "tokens/s",
    "vs first row",
    "final loss",
    "peak RSS (sum) GiB",
    "peak GPU (sum) GiB",
    "wall s",
]


def table_rows(rows: list[dict]) -> list[list]:
    base = rows[0]["tokens_per_s"]
    return [
        [
            r["label"],
            r["backend"],
            r["threads_per_process"],
            round(r["tokens_per_s"]),
            f"{r['tokens_per_s'] / base:.2f}x",
            round(r["final_loss"], 6),
            round(r["peak_rss_gib_sum"], 2),
            round(r["peak_gpu_gib_sum"], 2),
            round(r["wall_s"]),
        ]
        for r in rows
    ]


def note(rows: list[dict], args, model: str) -> str:
    return (
        f"{model} on {args.device} (compute {rows[0]['compute']}, weights cache {rows[0]['weights_cache']}); "
        f"LoRA r={args.rank} on {args.targets}; global batch {args.batch} x {args.seq} tokens per step "
        f"(micro-batches of {args.micro_batch or args.batch} rows); {args.steps} steps, tokens/s over the "
        f"{args.steps - args.warmup} after {args.warmup} warm-up."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--procs", default="single,2", help="comma list: single (plain process) or torchrun N")
    ap.add_argument("--model", default=None, help="GGUF path or store name (default: smollm2-135m)")
    ap.add_argument("--shape", choices=["smollm2", "7b"], help="write a synthetic model of this shape instead")
    ap.add_argument("--batch", type=int, default=8, help="rows of the global batch")
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (0: the whole batch)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="qv")
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="CPU threads in total (0: every core)")
    ap.add_argument("--grad-checkpoint", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the measured rows as JSON")
    harness.add_output_args(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warmup < 1 or args.steps <= args.warmup:
        ap.error("need --warmup >= 1 and --steps > --warmup")
    if args.micro_batch and args.batch % args.micro_batch:
        ap.error("--batch must be a multiple of --micro-batch")
    if args.worker:
        return worker(args)

    folder = Path(tempfile.mkdtemp(prefix="juno-dist-"))
    model = args.model or "smollm2-135m"
    if args.shape:
        from juno_py.testing.synthetic import SHAPE_7B, SHAPE_SMOLLM2, write_synthetic_llama

        shape = {"smollm2": SHAPE_SMOLLM2, "7b": SHAPE_7B}[args.shape]
        model = str(write_synthetic_llama(folder / f"synthetic-{args.shape}.gguf", shape))
    rows = [launch(args, p.strip(), folder / f"result-{p.strip()}.json", model) for p in args.procs.split(",")]
    label = f"synthetic {args.shape}-shaped model" if args.shape else model
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    record = harness.results(
        f"distributed-{kind}",
        f"Data-parallel training ({kind.upper()})",
        harness.command_line("benchmarks.distributed"),
        COLUMNS,
        table_rows(rows),
        [note(rows, args, label)],
        device=args.device,
    )
    print(harness.markdown_table(record["columns"], record["rows"]))
    print(record["notes"][0])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    harness.write_results(args, record)
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()


if __name__ == "__main__":
    main()
