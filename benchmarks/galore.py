"""GaLore on SmolLM2-135M: seconds per step and peak memory of full training with GaLore-AdamW (randomized and
exact SVD, per-layer updates on and off) against full AdamW and LoRA, in one run, each configuration in its own
subprocess.

Every configuration trains all seven targets of every layer with juno-py's real loop (`juno_py.train.loop.train`)
on batches of random tokens (all supervised): full training replaces them by fp32 master weights
(`juno_py.train.dense.densify`); LoRA attaches rank-16 adapters (the `juno-py lora` default). GaLore: rank 128,
update gap 200 with staggered refreshes (about one matrix refreshed per step; the first step computes every
matrix's first projector and is reported apart), α 0.25, per-matrix clipping at 1.0; the others clip the global
norm at 1.0. A step time is the median over `--steps` steps after the first `--warmup`; with `--rounds` > 1 the
best round counts. Peak memory: on the CPU the subprocess's ru_maxrss (model pages read through the memory map
included), on CUDA `torch.cuda.max_memory_allocated` over the training.

    python -m benchmarks.galore                                    # CPU, the model store's SmolLM2-135M
    python -m benchmarks.galore --synthetic                        # random valid blocks in SmolLM2's shapes
    python -m benchmarks.galore --device cuda --synthetic --batch 8 --seq 512
    python -m benchmarks.galore --grad-checkpoint                  # small activations: gradients set the peak

The table goes to benchmarks/results/galore-cpu.json (galore-gpu.json on CUDA; `--out FILE` elsewhere).

Per-layer updates free each gradient as soon as its matrix has stepped. That lowers the peak only where the
gradients (106.2M fp32 values, 405 MiB, for all targets) would outweigh the activations saved for backward: the
activations peak at the end of forward, the gradients at the end of backward. With activation checkpointing
(`--grad-checkpoint`) or short batches the gradients set the peak.

`--synthetic` writes SmolLM2-135M's exact shapes and types with random valid blocks
(`juno_py.testing.synthetic.write_synthetic_llama`), for machines without the model store: time and memory do not
depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from juno_py.testing.synthetic import SHAPE_SMOLLM2, write_synthetic_llama

# name -> (trainer, GaLore SVD, per-layer updates)
CONFIGS = {
    "lora-r16": ("lora", None, False),
    "adamw": ("adamw", None, False),
    "galore-randomized": ("galore", "randomized", True),
    "galore-randomized-after-backward": ("galore", "randomized", False),
    "galore-exact": ("galore", "exact", True),
}
MODEL = "smollm2-135m"


def _tokens(args):
    """Random tokens (ids below 20000 exist in SmolLM2's vocabulary), the same for every configuration."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(10, 20000, (args.batch, args.seq), generator=g)


def _reset_peak(cuda: bool) -> None:
    """Start a new peak: on CUDA the allocator's, on Linux the kernel's VmHWM (writing 5 to clear_refs)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")


def _steady_peak_gib(cuda: bool) -> float:
    """The peak since `_reset_peak` (VmHWM: ru_maxrss cannot be reset)."""
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def worker(args) -> dict:
    import torch

    from juno_py.lora import attach
    from juno_py.metrics import MetricsRecorder
    from juno_py.models import load_model
    from juno_py.precision import resolve_compute_dtype, resolve_weights_cache
    from juno_py.train.data import Example
    from juno_py.train.dense import build_dense_optimizer, densify
    from juno_py.train.galore import GaLoreConfig
    from juno_py.train.loop import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    kind, svd, per_layer = CONFIGS[args.config]
    cuda = args.device.startswith("cuda")
    compute = resolve_compute_dtype(args.compute_dtype, args.device)
    cache = resolve_weights_cache("auto", args.model_file, compute, args.device)
    model = load_model(args.model_file, device=args.device, compute_dtype=compute, weights_cache=cache)

    class Recorder(MetricsRecorder):
        """Starts a new memory peak once the warm-up steps are done: the first step computes every GaLore
        projector (210 SVDs), whose workspace is not what a step costs."""

        def emit(self, kind, **values):
            event = super().emit(kind, **values)
            if kind == "train_step" and values.get("step") == args.warmup:
                self.first_peak = _steady_peak_gib(cuda)
                _reset_peak(cuda)
            return event

    optimizer, state, rec = None, {}, Recorder()
    rec.first_peak = 0.0
    if kind == "lora":
        trainable = attach(model, "all", rank=16, alpha=32)
        n_adam = sum(p.numel() for p in trainable.parameters())
        state = {"moments": 2 * n_adam, "projector": 0}
    else:
        trainable = densify(model, "all")
        galore = GaLoreConfig(
            rank=args.rank, update_gap=args.gap, svd=svd or "randomized", per_layer=per_layer, max_matrix_norm=1.0
        )
        optimizer = build_dense_optimizer(kind, trainable, 1e-5, 0.0, galore, recorder=rec)
        state = (
            optimizer.state_size() if kind == "galore" else {"moments": 2 * trainable.n_parameters(), "projector": 0}
        )
    ids = _tokens(args)
    n_steps = args.warmup + args.steps
    examples = [Example(row.tolist(), [True] * args.seq) for row in ids] * n_steps  # one batch per step
    cfg = TrainConfig(
        lr=1e-5,
        batch_size=args.batch,
        max_steps=n_steps,
        epochs=None,
        schedule="constant",
        max_seq_len=args.seq,
        seed=0,
        max_grad_norm=0.0 if per_layer else 1.0,
        grad_checkpoint=args.grad_checkpoint,
    )
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    train(model, trainable, examples, cfg, recorder=rec, progress=False, log=lambda s: None, optimizer=optimizer)
    stamps = [t0] + [e.time for e in rec.events if e.kind == "train_step"]
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    refresh = [
        e.values["refresh_ms"] / e.values["refreshes"]
        for e in rec.events
        if e.kind == "galore" and e.values["refreshes"]
    ][1:]  # after the first step's 210
    steady = _steady_peak_gib(cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else harness.peak_rss_gib()
    if cuda:  # the allocator's peak was reset after the warm-up: the whole run's is the larger of the two
        peak = max(peak, rec.first_peak)
    step = statistics.median(times[args.warmup :])
    return dict(
        config=args.config,
        step_s=step,
        first_step_s=times[0],
        tok_s=args.batch * args.seq / step,
        peak_gib=peak,
        steady_peak_gib=steady,
        state_values=state["moments"] + state["projector"],
        refresh_ms=statistics.median(refresh) if refresh else None,
        threads=torch.get_num_threads(),
        device=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        compute=str(compute).removeprefix("torch."),
        load_avg=os.getloadavg()[0],
    )


def run_all(args) -> list[dict]:
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in CONFIGS:
            if args.only and name not in args.only:
                continue
            cmd = harness.module_cmd(
                "benchmarks.galore",
                "--worker",
                "--config",
                name,
                "--model-file",
                str(args.model_file),
                "--device",
                args.device,
                "--compute-dtype",
                args.compute_dtype,
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
                "--rank",
                str(args.rank),
                "--gap",
                str(args.gap),
                *(["--grad-checkpoint"] if args.grad_checkpoint else []),
            )
            row = harness.run_json(cmd, name)
            print(
                f"{name:34s} {row['step_s']:.3f} s/step (first {row['first_step_s']:.2f} s)  peak "
                f"{row['peak_gib']:.2f} GiB (steady {row['steady_peak_gib']:.2f})  load {row['load_avg']:.1f}",
                file=sys.stderr,
            )
            if name not in best or row["step_s"] < best[name]["step_s"]:
                best[name] = dict(
                    row,
                    peak_gib=max(row["peak_gib"], best.get(name, row)["peak_gib"]),
                    steady_peak_gib=max(row["steady_peak_gib"], best.get(name, row)["steady_peak_gib"]),
                )
    return list(best.values())


def columns(args) -> list[str]:
    memory = "peak GPU memory GiB" if args.device.startswith("cuda") else "peak RSS GiB"
    return [
        "configuration",
        "optimizer state (M values)",
        "first step s",
        "s/step",
        "tokens/s",
        memory,
        "steady peak GiB",
        "time vs AdamW",
        "memory vs AdamW",
        "steady memory vs AdamW",
        "refresh ms/matrix",
        "load avg",
    ]


def table_rows(rows: list[dict]) -> list[list]:
    peer = next((r for r in rows if r["config"] == "adamw"), None)
    out = []
    for r in rows:
        vs_t = f"{r['step_s'] / peer['step_s']:.2f}x" if peer else "-"
        vs_m = f"{r['peak_gib'] / peer['peak_gib']:.2f}x" if peer else "-"
        vs_s = f"{r['steady_peak_gib'] / peer['steady_peak_gib']:.2f}x" if peer else "-"
        refresh = f"{r['refresh_ms']:.0f}" if r["refresh_ms"] is not None else "-"
        out.append(
            [
                r["config"],
                round(r["state_values"] / 1e6, 2),
                round(r["first_step_s"], 2),
                round(r["step_s"], 3),
                round(r["tok_s"]),
                round(r["peak_gib"], 2),
                round(r["steady_peak_gib"], 2),
                vs_t,
                vs_m,
                vs_s,
                refresh,
                round(r["load_avg"], 1),
            ]
        )
    return out


def notes(rows: list[dict], args) -> list[str]:
    first = rows[0] if rows else {}
    what = (
        "synthetic SmolLM2-135M shapes (random Q4_1/Q8_0 blocks)" if args.synthetic else "SmolLM2-135M (Q4_1/Q8_0 GGUF)"
    )
    return [
        f"{what}, all seven targets of all 30 layers (106.2M weights trained in full; LoRA r 16: 4.9M), "
        f"batches of {args.batch} x {args.seq} tokens{', activation checkpointing' if args.grad_checkpoint else ''}"
        f", compute {first.get('compute')}; GaLore rank {args.rank}, gap {args.gap}; median of {args.steps} steps "
        f"after {args.warmup}, best of {args.rounds} round(s); {first.get('threads')} torch threads.",
        "First step: GaLore computes every matrix's first projector there. Peak: the whole run's (first step "
        "included); steady peak: the steps after the warm-up "
        f"({'the allocator' if args.device.startswith('cuda') else 'VmHWM, reset by clear_refs'}). "
        "Load avg: the machine's 1-minute load when the configuration finished.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (the median counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first computes the projectors)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--gap", type=int, default=200)
    ap.add_argument("--only", nargs="*", choices=list(CONFIGS), help="configurations to run")
    ap.add_argument(
        "--grad-checkpoint",
        action="store_true",
        help="recompute each block in backward: activations shrink, so the gradients set the peak",
    )
    ap.add_argument("--synthetic", action="store_true", help="random blocks in SmolLM2's shapes (no model store)")
    harness.add_output_args(ap)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            args.model_file = write_synthetic_llama(Path(tmp) / "synthetic-smollm2.gguf", SHAPE_SMOLLM2)
        else:
            from juno_py.store import resolve_model

            args.model_file = resolve_model(MODEL)
        rows = run_all(args)
    where = "gpu" if args.device.startswith("cuda") else "cpu"
    record = harness.results(
        f"galore-{where}",
        f"Full training with GaLore ({where.upper()})",
        harness.command_line("benchmarks.galore"),
        columns(args),
        table_rows(rows),
        notes(rows, args),
        device=args.device,
    )
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
