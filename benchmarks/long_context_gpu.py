"""Long sequences on one GPU: tokens/s and peak GPU memory of a LoRA training step at 4k, 8k, 16k, 32k (and 64k)
tokens for juno-py and transformers + PEFT, packed against unpacked training at 8 x 4096 tokens, and the attention
backends against the dense mask at real sizes in bf16 (`check`).

Models, built on the device from random valid blocks as `benchmarks/train_gpu.py` builds them (no file, no download):
  llama8b       Llama-3-8B-shaped: 32 layers, hidden 4096, MLP 14336, 32/8 heads, vocab 128256; Q4_K, Q6_K output
  gemma3-270m   the shapes and quant types of the store's Gemma-3-270M Q4_K_M file (its sliding window of 512 on
                the local layers comes from the file's metadata)
Adapters: LoRA on all linears, rank 16, alpha 32. One sequence a step (`lengths`); 8 rows of 4096 tokens a step
(`packed`: documents of 128..2048 tokens packed with `--pack`'s packer, against rows of one 4096-token document).

juno-py trains through its real loop (`juno_py.train.loop.train`), the base quantized on the GPU, bf16 compute,
activation checkpointing as the loop decides it (auto: on where a micro-batch's activations would take more than
half the free memory), attention through `juno_py.models.attention` (SDPA's causal kernel for plain rows,
flex_attention for sliding windows and packed documents). The peers are transformers (bf16 weights, the same decoded
values) with PEFT adapters (fp32), fused AdamW, a plain step: `sdpa` (SDPA attention), `sdpa+ckpt` (and
transformers' gradient checkpointing), `liger+ckpt` (Liger kernels, fused linear cross-entropy, where
`liger_kernel` is importable). A configuration that does not fit is reported as out of memory. Step time: median of
`--steps` steps after `--warmup`; peak: torch's max_memory_allocated during the configuration's steps, weights
included.

`check` compares, on the GPU, flex_attention in bf16 against SDPA with the dense mask in fp32 (outputs and
gradients of q, k, v; packed documents, with and without a sliding window, grouped-query heads) next to the bf16
dense SDPA's own error, and a Gemma-3-shaped packed step's loss and adapter gradients through flex against the dense
mask.

    python -m benchmarks.long_context_gpu --parts check lengths --models gemma3-270m            # about 3 min
    python -m benchmarks.long_context_gpu --parts lengths --models llama8b --impls juno --append
    python -m benchmarks.long_context_gpu --parts lengths --models llama8b --impls sdpa sdpa+ckpt liger+ckpt --append
    python -m benchmarks.long_context_gpu --parts packed --append
    python -m benchmarks.long_context_gpu --smoke --out /tmp/long.json     # tiny shapes on the CPU: the script runs

Each run writes (with `--append`: updates) `benchmarks/results/gpu-long-context.json`; `python -m benchmarks.report`
then rewrites docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.train_gpu import PEFT_TARGETS, SHAPE_8B, build_tensors, hf_model, juno_model, model_spec
from juno_py.gguf import GGMLType
from juno_py.testing.synthetic import llama_metadata, llama_tensors

GIB = 2**30
LENGTHS = [4096, 8192, 16384, 32768, 65536]
PEERS = ["sdpa", "sdpa+ckpt", "liger+ckpt"]
IMPLS = ["juno", *PEERS]
PARTS = ["check", "lengths", "packed"]
MODELS = ["llama8b", "gemma3-270m"]
LORA = dict(rank=16, alpha=32.0)
SMOKE_LLAMA = dict(
    n_layer=2,
    n_embd=256,
    n_ff=512,
    n_head=4,
    n_head_kv=2,
    n_vocab=1024,
    rope_base=500000.0,
    matrix_type=GGMLType.Q4_K,
    embd_type=GGMLType.Q4_K,
    output_type=GGMLType.Q6_K,
)
COLUMNS = [
    "model",
    "part",
    "implementation",
    "tokens a step",
    "checkpointing",
    "attention",
    "ms/step",
    "tokens/s",
    "peak GiB",
    "tokens/s vs best peer",
    "peak vs leanest peer",
]


# ------------------------------------------------------------------------------------------------ models
def spec_of(name: str, smoke: bool) -> tuple[dict, list]:
    """(metadata, tensor table) of a benchmark model; `smoke`: a tiny model of the same architecture."""
    if name == "llama8b":
        shape = SMOKE_LLAMA if smoke else SHAPE_8B
        meta = {k: v for k, v, _ in llama_metadata(shape)}
        meta["llama.context_length"] = 131072  # Llama-3.1's; the base 8B's 8192 would only limit the peer's config
        return meta, llama_tensors(shape)
    if name == "gemma3-270m":
        meta, tensors = model_spec("gemma3-270m", 2 if smoke else 0)
        if smoke:  # a small vocabulary and window, so that a CPU step is quick and the window binds
            meta["gemma3.attention.sliding_window"] = 64
            tensors = [(n, t, (1024, s[1]) if n == "token_embd.weight" else s, e) for n, t, s, e in tensors]
        return meta, tensors
    raise SystemExit(f"unknown model {name!r}: expected one of {', '.join(MODELS)}")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else float("nan")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def failure(e: BaseException) -> str:
    if is_oom(e):
        return "out of memory"
    traceback.print_exc()
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def random_ids(n_vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, min(n_vocab, 32000), (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------------ juno-py
def juno_steps(model, adapters, examples, batch: int, seq: int, args, pack: bool = False) -> dict:
    """Train `args.warmup + args.steps` steps through the loop; step seconds, the loop's decisions, peak memory."""
    from juno_py.metrics import MetricsRecorder
    from juno_py.models.attention import AttentionMask, choose_backend
    from juno_py.train.loop import TrainConfig, train

    n_steps = args.warmup + args.steps
    cfg = TrainConfig(
        lr=1e-4,
        batch_size=batch,
        max_steps=n_steps,
        epochs=None,
        schedule="constant",
        max_seq_len=seq,
        pack=pack,
        seed=0,
        grad_checkpoint=args.grad_checkpoint,
        cuda_graphs=args.graphs,
    )
    said: list[str] = []
    rec = MetricsRecorder()
    reset_peak(args.device)
    sync(args.device)
    t0 = time.time()
    train(model, adapters, examples, cfg, recorder=rec, progress=False, log=said.append)
    sync(args.device)
    steps = [e for e in rec.events if e.kind == "train_step"]
    stamps = [t0] + [e.time for e in steps]
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    pos = torch.arange(seq, device=model.embed.device)[None]
    docs = torch.zeros_like(pos) if pack else None
    kinds = set()
    for w in {blk.window for blk in model.blocks}:  # the kernel each layer's attention takes
        mask = AttentionMask(pos, pos, w, docs, docs, by_index=not pack) if w or pack else None
        kinds.add(choose_backend(model.embed.device, mask))
    return dict(
        times=times,
        peak_gib=peak_gib(args.device),
        checkpointing="on" if model.checkpoint_blocks else "off",
        attention="+".join(sorted(kinds)),
        graphs=any("captured a CUDA graph" in s for s in said),
        log=[s for s in said if "graph" in s or "checkpointing" in s][:4],
        losses=[round(e.values["loss"], 4) for e in steps],
    )


def build_juno(meta, spec, args):
    from juno_py.lora import Mode, attach

    compute = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = juno_model(meta, build_tensors(spec, args.device), "none", args.device, compute)
    adapters = attach(model, "all", rank=LORA["rank"], alpha=LORA["alpha"], mode=Mode.LORA)
    return model, adapters


def juno_lengths(name: str, meta, spec, args) -> list[dict]:
    from juno_py.train.data import Example

    model, adapters = build_juno(meta, spec, args)
    rows, failed = [], False
    for seq in args.lengths:
        row = dict(model=name, part="lengths", impl="juno-py", batch=1, seq=seq)
        if failed:
            rows.append({**row, "error": "out of memory (at a shorter length)"})
            continue
        ids = random_ids(model.embed.n_vocab, [seq] * (args.warmup + args.steps), seed=seq)
        try:
            got = juno_steps(model, adapters, [Example(r, [True] * seq) for r in ids], 1, seq, args)
            times = got.pop("times")
            row.update(got, step_s=statistics.median(times[args.warmup :]), tokens=seq)
        except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
            row["error"] = failure(e)
            failed = is_oom(e)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        gc.collect()
    return rows


def juno_packed(name: str, meta, spec, args) -> list[dict]:
    """8 x 4096 tokens a step: rows of one document each, and documents of 128..2048 tokens packed."""
    from juno_py.train.data import Example, plan_epoch

    batch, seq = args.packed_rows, args.packed_len
    n_steps = args.warmup + args.steps
    model, adapters = build_juno(meta, spec, args)
    rng = random.Random(0)
    lo, hi = max(2, seq // 32), max(3, seq // 2)
    lengths, total = [], 0
    while total < (n_steps + 2) * batch * seq:
        lengths.append(rng.randint(lo, hi))
        total += lengths[-1]
    runs = {
        "juno-py unpacked": ([seq] * (n_steps * batch), False),
        "juno-py packed": (lengths, True),
    }
    rows = []
    for impl, (lens, pack) in runs.items():
        ids = random_ids(model.embed.n_vocab, lens, seed=len(lens))
        examples = [Example(r, [True] * len(r)) for r in ids]
        plan = plan_epoch(examples, batch, 0, 0, pack, seq)[:n_steps]
        real = [sum(len(e.ids) for row in b for e in row) for b in plan]
        row = dict(model=name, part="packed", impl=impl, batch=batch, seq=seq)
        try:
            got = juno_steps(model, adapters, examples, batch, seq, args, pack=pack)
            times = got.pop("times")
            rates = [n / t for n, t in zip(real[args.warmup :], times[args.warmup :])]
            row.update(got, step_s=statistics.median(times[args.warmup :]), tokens_per_s=statistics.median(rates))
            row["tokens"] = round(statistics.mean(real[args.warmup :]))
        except Exception as e:  # noqa: BLE001
            row["error"] = failure(e)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ peers
def peer_lengths(name: str, meta, spec, variant: str, args) -> list[dict]:
    from peft import LoraConfig, get_peft_model

    base_row = dict(model=name, part="lengths", impl=f"transformers + PEFT ({variant})", batch=1)
    liger = variant.startswith("liger")
    if liger:
        try:
            import liger_kernel.transformers as lk
        except ImportError:
            return [{**base_row, "seq": s, "error": "liger_kernel is not importable"} for s in args.lengths]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    tensors = build_tensors(spec, args.device)
    base = hf_model(meta, tensors, args.device, dtype)
    del tensors
    gc.collect()
    if liger:
        arch = meta["general.architecture"]
        patch = lk.apply_liger_kernel_to_gemma3_text if arch == "gemma3" else lk.apply_liger_kernel_to_llama
        patch(model=base)
    if variant.endswith("+ckpt"):
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(
        base, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=PEFT_TARGETS["all"], lora_dropout=0.0)
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=args.device.startswith("cuda"))
    attn = getattr(base.config, "_attn_implementation", "?")
    rows, failed = [], False
    for seq in args.lengths:
        row = {**base_row, "seq": seq, "attention": attn, "checkpointing": "on" if "ckpt" in variant else "off"}
        if failed:
            rows.append({**row, "error": "out of memory (at a shorter length)"})
            continue
        ids = torch.tensor(random_ids(base.config.vocab_size, [seq], seed=seq), device=args.device)
        times = []
        try:
            reset_peak(args.device)
            for _ in range(args.warmup + args.steps):
                sync(args.device)
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(args.device)
                times.append(time.perf_counter() - t0)
                loss = None
            row.update(step_s=statistics.median(times[args.warmup :]), tokens=seq, peak_gib=peak_gib(args.device))
        except Exception as e:  # noqa: BLE001
            loss = None
            opt.zero_grad(set_to_none=True)
            row["error"] = failure(e)
            failed = is_oom(e)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        gc.collect()
    model = base = opt = params = None
    gc.collect()
    return rows


# ------------------------------------------------------------------------------------------------ check
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check_attention(args) -> list[dict]:
    """The backend under test (flex on CUDA, query blocks on the CPU) against SDPA with the dense mask: relative
    errors of the output and of dq, dk, dv next to those of the dense mask in the same dtype."""
    from juno_py.models.attention import AttentionMask, attend, attention_settings

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = "flex" if cuda else "chunked"
    t = 8192 if cuda else 512
    heads, kv, dim = (32, 8, 128) if cuda else (4, 2, 32)
    g = torch.Generator(args.device).manual_seed(0)
    out = []
    for window in (0, t // 4):
        sizes = [t // 2, t // 8, t // 4, t // 8]
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)]).to(args.device)[None]
        pos = torch.cat([torch.arange(n) for n in sizes]).to(args.device)[None]
        mask = AttentionMask(pos, pos, window, doc, doc)
        q = torch.randn(1, heads, t, dim, generator=g, device=args.device)
        k, v = (torch.randn(1, kv, t, dim, generator=g, device=args.device) for _ in range(2))

        def run(force, dt):
            xs = [x.detach().clone().to(dt).requires_grad_(True) for x in (q, k, v)]
            limit = 64 * t if force == "chunked" else None
            with attention_settings(force=force, dense_limit=limit):
                y = attend(*xs, mask, scale=dim**-0.5, enable_gqa=True)
                y.float().square().sum().backward()
            return [y.detach(), *(x.grad for x in xs)]

        ref = run("dense", torch.float32 if cuda else torch.float64)
        dense = run("dense", dtype)
        got = run(backend, dtype)
        names = ["out", "dq", "dk", "dv"]
        row = dict(
            part="check",
            what=f"attention {backend} vs dense, {t} tokens, packed, window {window or 'none'}",
            errors={n: round(_rel(x, r), 6) for n, x, r in zip(names, got, ref)},
            dense_errors={n: round(_rel(x, r), 6) for n, x, r in zip(names, dense, ref)},
        )
        row["ok"] = all(row["errors"][n] <= 2 * row["dense_errors"][n] + 1e-3 for n in names)
        print(json.dumps(row), file=sys.stderr, flush=True)
        out.append(row)
    return out


def check_model(name: str, meta, spec, args) -> dict:
    """A packed step of `name` (bf16 on the GPU): loss and adapter gradients through the chosen backend against
    the dense mask."""
    from juno_py.models.attention import attention_settings
    from juno_py.train.data import Example, packed_batch
    from juno_py.train.steps import forward_backward

    model, adapters = build_juno(meta, spec, args)
    with torch.no_grad():
        for ad in adapters.adapters.values():
            ad.lora_B.normal_(0, 0.02)
    seq = 4096 if args.device.startswith("cuda") else 512
    ids = random_ids(model.embed.n_vocab, [seq // 2, seq // 8, seq // 4, seq // 8], seed=1)
    batch = packed_batch([[Example(r, [True] * len(r)) for r in ids]])
    params = list(adapters.parameters())

    def step(force):
        for p in params:
            p.grad = None
        limit = 64 * seq if force == "chunked" else None
        with attention_settings(force=force, dense_limit=limit):
            loss = forward_backward(model, batch, denominator=float(batch.n_supervised))
        return loss, torch.cat([p.grad.flatten().float() for p in params])

    backend = "flex" if args.device.startswith("cuda") else "chunked"
    loss_d, grad_d = step("dense")
    loss_f, grad_f = step(backend)
    cos = float(torch.nn.functional.cosine_similarity(grad_d, grad_f, dim=0))
    row = dict(
        part="check",
        what=f"{name} packed step, {seq} tokens: {backend} vs dense",
        loss_rel=abs(loss_f - loss_d) / abs(loss_d),
        grad_rel=_rel(grad_f, grad_d),
        grad_cosine=cos,
    )
    row["ok"] = row["loss_rel"] <= 1e-2 and cos >= 0.99
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


# ------------------------------------------------------------------------------------------------ tables
def table(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        if r["part"] == "check":
            continue
        tokens = r["batch"] * r["seq"]
        if "error" in r:
            out.append([r["model"], r["part"], r["impl"], tokens, "", "", f"failed: {r['error']}", "", "", "", ""])
            continue
        tok_s = r.get("tokens_per_s", tokens / r["step_s"])
        peers = [
            p
            for p in rows
            if p["part"] == r["part"] and p["model"] == r["model"] and p.get("seq") == r["seq"]
            if p["impl"].startswith("transformers") and "error" not in p
        ]
        vs_t = vs_m = "-"
        if peers and not r["impl"].startswith("transformers"):
            best = max(p["seq"] / p["step_s"] for p in peers)
            vs_t = f"{tok_s / best:.2f}x"
            lean = min(p["peak_gib"] for p in peers)
            vs_m = f"{r['peak_gib'] / lean:.2f}x" if math.isfinite(lean) and lean > 0 else "-"
        if r["part"] == "packed" and r["impl"] == "juno-py packed":
            plain = next((p for p in rows if p.get("impl") == "juno-py unpacked" and p["model"] == r["model"]), None)
            if plain and "error" not in plain:
                vs_t = f"{tok_s / plain['tokens_per_s']:.2f}x unpacked"
        peak = round(r["peak_gib"], 2) if math.isfinite(r["peak_gib"]) else "-"
        out.append(
            [
                r["model"],
                r["part"],
                r["impl"],
                r.get("tokens", tokens),
                r.get("checkpointing", "-"),
                r.get("attention", "-"),
                round(1e3 * r["step_s"], 1),
                f"{tok_s:,.0f}",
                peak,
                vs_t,
                vs_m,
            ]
        )
    return out


def check_notes(rows: list[dict]) -> list[str]:
    notes = []
    for r in rows:
        if r["part"] != "check":
            continue
        if "errors" in r:
            errs = ", ".join(f"{k} {v:.2e} (dense {r['dense_errors'][k]:.2e})" for k, v in r["errors"].items())
            notes.append(f"{r['what']}: relative error against fp32 dense: {errs}; {'ok' if r['ok'] else 'FAILED'}")
        else:
            notes.append(
                f"{r['what']}: loss {r['loss_rel']:.1e} relative, adapter gradients {r['grad_rel']:.1e} relative "
                f"(cosine {r['grad_cosine']:.5f}); {'ok' if r['ok'] else 'FAILED'}"
            )
    return notes


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    def key(r):
        return (r["part"], r.get("model"), r.get("impl"), r.get("seq"), r.get("what"))

    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="*", default=PARTS, choices=PARTS)
    ap.add_argument("--models", nargs="*", default=MODELS, choices=MODELS)
    ap.add_argument("--impls", nargs="*", default=IMPLS, choices=IMPLS)
    ap.add_argument("--lengths", nargs="*", type=int, default=LENGTHS)
    ap.add_argument("--packed-rows", type=int, default=8)
    ap.add_argument("--packed-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="steps before the measured ones (flex compiles in the first)")
    ap.add_argument("--graphs", default="auto", choices=["auto", "off"], help="juno-py's --cuda-graphs")
    ap.add_argument(
        "--grad-checkpoint",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="juno-py's activation checkpointing (default: the loop's auto rule)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, short lengths: the script runs")
    ap.add_argument("--append", action="store_true", help="update the results file's rows instead of replacing it")
    ap.add_argument("--rows-json", type=Path, help="also write every measured row, as JSON, here")
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.device = "cpu"
        if args.lengths == LENGTHS:
            args.lengths = [128, 256]
        args.packed_rows, args.packed_len = min(args.packed_rows, 2), min(args.packed_len, 256)
    torch.backends.cuda.matmul.allow_tf32 = False
    env = harness.environment(args.device)
    print(env["hardware"], env["software"], file=sys.stderr)
    command = harness.command_line("benchmarks.long_context_gpu")
    # on the CPU (smoke) above 64 queries per block the attention runs in query blocks, as a long sequence would
    from juno_py.models.attention import attention_settings

    settings = attention_settings(dense_limit=64 * 128) if args.device == "cpu" else nullcontext()
    rows: list[dict] = []
    with settings:
        if "check" in args.parts:
            rows += check_attention(args)
        for name in args.models:
            meta, spec = spec_of(name, args.smoke)
            if "check" in args.parts and name == "gemma3-270m":
                rows.append(check_model(name, meta, spec, args))
            if "lengths" in args.parts:
                if "juno" in args.impls:
                    rows += juno_lengths(name, meta, spec, args)
                for variant in [i for i in args.impls if i in PEERS]:
                    rows += peer_lengths(name, meta, spec, variant, args)
            if "packed" in args.parts:
                rows += juno_packed(name, meta, spec, args)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    target = args.out or Path(args.results_dir) / "gpu-long-context.json"
    if args.append and target.exists():
        rows = merge_rows(json.loads(target.read_text()).get("rows_raw", []), rows)
    record = harness.results(
        "gpu-long-context",
        "Long sequences on one GPU: cost growth with sequence length, packing",
        command,
        COLUMNS,
        table(rows),
        [
            "LoRA on all linears, r 16. lengths: one sequence a step; packed: 8 rows x 4096 tokens a step, "
            "documents of 128..2048 tokens packed, against rows of one document (tokens/s: real tokens, padding "
            f"excluded). Median of {args.steps} steps after {args.warmup}; peak: max_memory_allocated during the "
            "steps, weights included. Best peer: the fastest transformers + PEFT variant that fits at that length; "
            "leanest: the one with the lowest peak.",
            *check_notes(rows),
        ],
        env=env,
    )
    record["rows_raw"] = rows
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)
    if args.rows_json:
        harness.write_json(args.rows_json, dict(rows=rows, software=env["software"], argv=sys.argv[1:]))


if __name__ == "__main__":
    main()
