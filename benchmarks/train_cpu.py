"""Training on CPU: seconds per step, tokens/s and peak RSS of juno-py (LoRA and DoRA, fp32 and bf16 compute)
against transformers (GGUF dequantized to fp32) with PEFT, in fp32 and under `torch.autocast("cpu", bfloat16)`,
and the bf16 GEMM floor of the step's shapes, in one run.

SmolLM2-135M, batches of 8 x 64 tokens (all supervised), AdamW; adapters of rank 8 on q and v (alpha 16) or of
rank 16 on every linear of the blocks (alpha 32). juno-py runs its real training loop (`juno_py.train.loop.train`:
data collation, clipping, optimizer, metrics); the peer runs the plain PEFT step (forward with labels, backward,
clipping, AdamW). Each configuration runs in its own subprocess so its peak RSS (ru_maxrss, memory-mapped GGUF
pages included) is its own. A step time is the median of `--steps` timed steps after `--warmup` untimed ones;
with `--rounds` > 1 the best round counts (a busy machine only slows a run down). Every ratio is against the
faster peer (PEFT fp32 or PEFT bf16 autocast) of the same adapters.

The GEMM floor is the time of only the matrix products one step of the same shapes must make, in bf16: every
linear's forward and input-gradient products (frozen weights: no weight gradient), attention's score and value
products with their gradients, and the output projection with its input gradient; each shape is timed by its
fastest call and counted as often as a step makes it. Adapter products, norms, activations, softmax, the loss and
the optimizer are not in it.

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

# (implementation, mode, targets, compute dtype, weights cache, activation checkpointing)
CONFIGS = [
    ("gemm", "-", "-", "bf16", "-", False),
    ("gemm", "-", "-", "fp32", "-", False),
    ("peft", "lora", "qv", "fp32", "-", False),
    ("peft", "lora", "qv", "bf16", "-", False),
    ("juno", "lora", "qv", "bf16", "bf16", False),
    ("juno", "lora", "qv", "bf16", "none", False),
    ("peft", "lora", "all", "fp32", "-", False),
    ("peft", "lora", "all", "bf16", "-", False),
    ("juno", "lora", "all", "bf16", "bf16", False),
    ("juno", "lora", "all", "bf16", "none", False),
    ("peft", "dora", "qv", "fp32", "-", False),
    ("peft", "dora", "qv", "bf16", "-", False),
    ("juno", "dora", "qv", "bf16", "bf16", False),
    ("juno", "dora", "qv", "bf16", "none", False),
    ("juno", "lora", "qv", "fp32", "none", False),
    ("juno", "lora", "qv", "fp32", "fp32", False),
    ("juno", "dora", "qv", "fp32", "none", False),
    ("juno", "lora", "qv", "fp32", "none", True),
    ("juno", "lora", "qv", "bf16", "bf16", True),
]
MODEL = "smollm2-135m"
RANK = {"qv": 8, "all": 16}  # alpha is twice the rank
PEFT_TARGETS = {
    "qv": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def config_name(impl: str, mode: str, targets: str, dtype: str, cache: str, ckpt: bool) -> str:
    if impl == "gemm":
        return f"gemm-floor-{dtype}"
    return f"{impl}-{mode}-{targets}-{dtype}-{cache}" + ("-ckpt" if ckpt else "")


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
    rank = RANK[args.targets]
    adapters = attach(model, args.targets, rank=rank, alpha=2 * rank, mode=Mode[args.mode.upper()])
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
    rank = RANK[args.targets]
    model = get_peft_model(
        base,
        LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=PEFT_TARGETS[args.targets],
            lora_dropout=0.0,
            use_dora=args.mode == "dora",
        ),
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = _tokens(args)
    # bf16: the mixed precision a PEFT user turns on, fp32 weights and master adapters, bf16 products
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with amp:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[args.warmup :]


def gemm_products(args) -> list[tuple[int, tuple[int, ...], tuple[int, ...], bool]]:
    """(count per step, shape of a, shape of b, whether b is a transposed [out, in] weight) of every product `a @ b`
    one step makes: forward and input gradient of every frozen linear, attention's products with their gradients,
    the output projection."""
    from juno_py.models import load_model

    a = load_model(args.model_file).args
    m, d, layers = args.batch * args.seq, a.n_embd, a.n_layer
    q, kv, bh, t = a.n_head * a.head_dim, a.n_head_kv * a.head_dim, args.batch * a.n_head, args.seq
    linears = [(d, q), (d, kv), (d, kv), (q, d), (d, a.n_ff), (d, a.n_ff), (a.n_ff, d)]  # (in, out)
    out: list[tuple[int, tuple[int, ...], tuple[int, ...], bool]] = []
    for k, n in linears:
        out.append((layers, (m, k), (k, n), True))  # y = x Wᵀ
        out.append((layers, (m, n), (n, k), False))  # dx = dy W
    hd = a.head_dim
    out.append((2 * layers, (bh, t, hd), (bh, hd, t), False))  # scores S = Q Kᵀ; dP = dO Vᵀ (keys and values per head)
    out.append((4 * layers, (bh, t, t), (bh, t, hd), False))  # O = P V; dV = Pᵀ dO; dQ = dS K; dK = dSᵀ Q
    vocab = _vocab(args.model_file)
    out.append((1, (m, d), (d, vocab), True))  # logits
    out.append((1, (m, vocab), (vocab, d), False))  # their input gradient
    return out


def _vocab(path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        if tensor.name in ("output.weight", "token_embd.weight"):
            return int(max(tensor.shape))
    raise SystemExit(f"{path}: no output.weight or token_embd.weight tensor")


def gemm_floor(args) -> list[float]:
    """Seconds of one step's products (`gemm_products`) in the run's dtype, each shape timed by its fastest call
    (bf16 on a CPU without bf16 GEMM support: one call per shape after a small warm-up, its products being ~30x
    slower than fp32's there)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    slow = dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for count, sa, sb, transposed in gemm_products(args):
        a = torch.randn(sa, generator=g).to(dtype)
        # a linear's forward reads W [out, in] transposed, as F.linear does
        b = torch.randn(sb[::-1], generator=g).to(dtype).t() if transposed else torch.randn(sb, generator=g).to(dtype)
        if slow:
            torch.matmul(a[..., :8, :], b)  # warm-up on a few rows
            start = time.perf_counter()
            torch.matmul(a, b)
            total += count * (time.perf_counter() - start)
        else:
            total += count * harness.fastest_call(lambda: torch.matmul(a, b), min_seconds=0.05, min_calls=5)
    return [total]


def worker(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    times = {"juno": juno_steps, "peft": peft_steps, "gemm": gemm_floor}[args.impl](args)
    step = statistics.median(times)
    return dict(
        impl=args.impl,
        mode=args.mode,
        targets=args.targets,
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
        for impl, mode, targets, dtype, cache, ckpt in CONFIGS:
            name = config_name(impl, mode, targets, dtype, cache, ckpt)
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
                "--targets",
                targets,
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
                f"{name:32s} {row['step_s']:.3f} s/step "
                f"{row['tok_s']:7.1f} tok/s  peak RSS {row['peak_rss_gib']:.2f} GiB  load {row['load_avg']:.1f}",
                file=sys.stderr,
            )
            key = name
            if key not in best or row["step_s"] < best[key]["step_s"]:
                best[key] = dict(row, peak_rss_gib=max(row["peak_rss_gib"], best.get(key, row)["peak_rss_gib"]))
    return list(best.values())


COLUMNS = [
    "implementation",
    "adapters",
    "compute",
    "frozen weights",
    "s/step",
    "tokens/s",
    "peak RSS GiB",
    "tokens/s vs best peer",
    "RSS vs best peer",
    "step vs GEMM floor",
    "load avg",
]


def _adapters(r: dict) -> str:
    rank = RANK[r["targets"]]
    return f"{r['mode'].upper() if r['mode'] == 'dora' else 'LoRA'} {'q,v' if r['targets'] == 'qv' else 'all'} r {rank}"


def table_rows(rows: list[dict]) -> list[list]:
    """One row per configuration; ratios against the faster peer of the same adapters, and the step's time over
    the GEMM floor's of the same compute dtype."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["mode"], r["targets"])
        if r["impl"] == "peft" and (key not in best or r["tok_s"] > best[key]["tok_s"]):
            best[key] = r
    floors = {r["dtype"]: r for r in rows if r["impl"] == "gemm"}
    out = []
    for r in rows:
        floor = floors.get(r["dtype"])  # the products in the configuration's own compute dtype
        vs_floor = f"{r['step_s'] / floor['step_s']:.2f}x" if floor else "-"
        if r["impl"] == "gemm":
            out.append(
                [f"{r['dtype']} GEMM floor (products only)", "-", r["dtype"], "-", round(r["step_s"], 3), round(r["tok_s"], 1),
                 round(r["peak_rss_gib"], 2), "-", "-", "1.00x", round(r["load_avg"], 1)]
            )  # fmt: skip
            out[-1][9] = vs_floor
            continue
        p = best.get((r["mode"], r["targets"]))
        if r["impl"] == "peft":
            name = "transformers + PEFT" + (", bf16 autocast" if r["dtype"] == "bf16" else "")
            weights = "dense fp32"
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
                _adapters(r),
                r["dtype"],
                weights,
                round(r["step_s"], 3),
                round(r["tok_s"], 1),
                round(r["peak_rss_gib"], 2),
                vs_t,
                vs_m,
                vs_floor,
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
        f"{what}, LoRA/DoRA rank 8 on q,v (alpha 16) or LoRA rank 16 on every linear (alpha 32), batches of "
        f"{args.batch} x {args.seq} tokens, median of {args.steps} steps after {args.warmup} warm-up, best of "
        f"{args.rounds} round(s); {threads} torch threads.",
        "Best peer: the faster of PEFT fp32 and PEFT under torch.autocast('cpu', bfloat16) for the same adapters. "
        "GEMM floor: only the matrix products of one step of these shapes, in bf16 or fp32 (linears' forward and "
        "input gradients, attention products and their gradients, output projection and its input gradient), "
        "each shape by its fastest call; the floor's tokens/s is the batch's tokens over that time; step vs GEMM "
        "floor: the step's time over the floor's of its own compute dtype.",
        "Peak RSS: the subprocess's ru_maxrss. Load avg: the machine's 1-minute load when the configuration "
        "finished; above the CPU count other processes shared the cores.",
        *bf16_note(),
    ]


def bf16_note() -> list[str]:
    """A note where torch has no fast bf16 GEMM on this CPU (oneDNN without AVX512-BF16 or AMX): there every bf16
    product, PEFT's under autocast and juno-py's bf16 compute alike, runs far slower than fp32."""
    import torch

    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return []
    return [
        "This CPU has no bf16 GEMM support in torch (oneDNN reports none: no AVX512-BF16 or AMX), so bf16 "
        "products take a slow path, many times slower than fp32's: the bf16 rows and the bf16 floor measure that "
        "path, and fp32 is the faster compute here."
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (the median counts)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration (the best is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    ap.add_argument(
        "--only",
        nargs="*",
        help="configurations to run, e.g. gemm-floor-bf16 peft-lora-qv-bf16-- juno-lora-all-bf16-bf16 "
        "juno-lora-qv-bf16-bf16-ckpt",
    )
    ap.add_argument("--synthetic", action="store_true", help="random blocks in SmolLM2's shapes (no model store)")
    harness.add_output_args(ap)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--targets", default="qv", help=argparse.SUPPRESS)
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
