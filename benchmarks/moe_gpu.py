"""Training a mixture-of-experts model: LoRA on attention and experts of a Qwen3-30B-A3B-shaped qwen3moe model
(48 layers, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top 8, vocab 151936; Q4_K matrices,
Q6_K output, F32 embeddings, norms and router), 8 x 512 tokens a step: seconds per step, tokens/s and peak device
memory.

The model is built in memory on the device (`Transformer.from_tensors`) from random valid blocks
(`juno_py.testing.synthetic.random_blocks`): no file and no host copy; its matrices stay quantized. Decode and matmul
time do not depend on the values. `--layers`, `--experts` and the other shape flags shrink it for a smoke run.

    python -m benchmarks.moe_gpu                                   # on a GPU: table, results/gpu-training-moe.json
    python -m benchmarks.moe_gpu --device cpu --layers 1 --experts 8 --n-embd 256 --n-ff-exp 256 --vocab 1024 \\
        --batch 1 --seq 32 --steps 2 --no-results                 # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks import harness


def qwen3moe_tensors(a, device, seed: int = 0) -> tuple[dict, dict]:
    """(metadata, tensors) of a qwen3moe model of shape `a` (the parsed flags), bytes built on `device`."""
    import torch

    from juno_py.gguf import GGMLType
    from juno_py.testing.synthetic import random_blocks

    rng = torch.Generator(device=device).manual_seed(seed)
    d, hd, ff, n = a.n_embd, 128, a.n_ff_exp, a.experts
    meta = {
        "general.architecture": "qwen3moe",
        "qwen3moe.context_length": 40960,
        "qwen3moe.embedding_length": d,
        "qwen3moe.block_count": a.layers,
        "qwen3moe.feed_forward_length": 6144,
        "qwen3moe.expert_feed_forward_length": ff,
        "qwen3moe.expert_count": n,
        "qwen3moe.expert_used_count": a.top_k,
        "qwen3moe.attention.head_count": a.heads,
        "qwen3moe.attention.head_count_kv": a.kv_heads,
        "qwen3moe.attention.key_length": hd,
        "qwen3moe.attention.value_length": hd,
        "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3moe.rope.freq_base": 1000000.0,
    }
    t = {}
    q4, q6 = GGMLType.Q4_K, GGMLType.Q6_K

    def mat(name, qtype, shape, embedding=False):
        rows = 1
        for s in shape[:-1]:
            rows *= s
        t[name] = (qtype, shape, random_blocks(qtype, rows, shape[-1], rng, embedding, device=device))

    def ones(name, size):
        t[name] = (GGMLType.F32, (size,), torch.ones(size, device=device).view(torch.uint8))

    # F32 N(0, 1) embeddings: the random blocks' rows are small and alike, so every hidden state would be nearly the
    # same and route every token alike; these give each token its own routing, as a real model's do
    embd = torch.randn(a.vocab, d, generator=rng, device=device)
    t["token_embd.weight"] = (GGMLType.F32, (a.vocab, d), embd.view(torch.uint8))
    for il in range(a.layers):
        p = f"blk.{il}."
        ones(p + "attn_norm.weight", d)
        ones(p + "ffn_norm.weight", d)
        ones(p + "attn_q_norm.weight", hd)
        ones(p + "attn_k_norm.weight", hd)
        mat(p + "attn_q.weight", q4, (a.heads * hd, d))
        mat(p + "attn_k.weight", q4, (a.kv_heads * hd, d))
        mat(p + "attn_v.weight", q4, (a.kv_heads * hd, d))
        mat(p + "attn_output.weight", q4, (d, a.heads * hd))
        router = torch.randn(n, d, generator=rng, device=device) * d**-0.5
        t[p + "ffn_gate_inp.weight"] = (GGMLType.F32, (n, d), router.view(torch.uint8))
        mat(p + "ffn_gate_exps.weight", q4, (n, ff, d))
        mat(p + "ffn_up_exps.weight", q4, (n, ff, d))
        mat(p + "ffn_down_exps.weight", q4, (n, d, ff))
    ones("output_norm.weight", d)
    mat("output.weight", q6, (a.vocab, d))
    return meta, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4, help="training steps (the first is warmup, not counted)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff-exp", type=int, default=768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="attn,experts")
    ap.add_argument("--lora-experts", default="per-expert", choices=["per-expert", "shared"])
    ap.add_argument("--compute-dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=True)
    harness.add_output_args(ap)
    args = ap.parse_args()

    import torch

    from juno_py.lora import attach
    from juno_py.metrics import MetricsRecorder
    from juno_py.models import Transformer
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    compute = torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    meta, tensors = qwen3moe_tensors(args, device)
    model = Transformer.from_tensors(meta, tensors, compute_dtype=compute, label="synthetic-qwen3moe")
    model.place(device)
    weight_gib = sum(r.numel() for _, _, r in tensors.values()) / 2**30
    print(f"built {weight_gib:.2f} GiB of weights in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    adapters = attach(model, args.targets, rank=args.rank, alpha=2.0 * args.rank, experts=args.lora_experts)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq), generator=g)
    examples = [Example(row.tolist(), [True] * args.seq) for row in ids]
    cfg = TrainConfig(
        lr=1e-4,
        batch_size=args.batch,
        max_steps=args.steps,
        epochs=None,
        schedule="constant",
        grad_checkpoint=args.grad_checkpoint,
        max_seq_len=args.seq,
        cuda_graphs="off",
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rec = MetricsRecorder()
    start = time.time()
    train(model, adapters, examples, cfg, recorder=rec, progress=False, log=lambda m: print(m, file=sys.stderr))
    steps = [e for e in rec.events if e.kind == "train_step"]
    stamps = [start] + [e.time for e in steps]
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = times[1:] or times
    tok_s = args.batch * args.seq / (sum(timed) / len(timed))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    loads = [e.values for e in rec.events if e.kind == "expert_load"]
    columns = ["step", "seconds", "loss", "forward ms", "backward ms", "optimizer ms"]
    rows = [
        [i, round(t, 2), round(e.values["loss"], 3)]
        + [round(e.values.get(k, 0.0)) for k in ("forward_ms", "backward_ms", "optimizer_ms")]
        for i, (e, t) in enumerate(zip(steps, times), 1)
    ]
    notes = [
        f"{tok_s:.0f} tokens/s over steps 2..{len(steps)}; peak device memory {peak:.2f} GiB (max_memory_allocated); "
        f"{weight_gib:.2f} GiB of weights (F32 embeddings, norms and router; the rest quantized).",
        f"Synthetic qwen3moe: {args.layers} layers, hidden {args.n_embd}, {args.heads}/{args.kv_heads} heads of 128, "
        f"{args.experts} experts of {args.n_ff_exp}, top {args.top_k}, vocab {args.vocab}; Q4_K (Q6_K output); LoRA "
        f"r={args.rank} on {args.targets} ({args.lora_experts}, {adapters.n_parameters():,} parameters); "
        f"{args.batch} x {args.seq} tokens a step; compute {args.compute_dtype}; grad checkpoint "
        f"{args.grad_checkpoint}.",
        f"Router load, last step: worst imbalance {loads[-1]['imbalance_max']:.2f}, idle experts "
        f"{loads[-1]['idle_experts']}."
        if loads
        else "No router load recorded.",
    ]
    print(harness.markdown_table(columns, rows))
    print("\n".join(notes))
    record = harness.results(
        "gpu-training-moe",
        "Training a mixture-of-experts model (synthetic Qwen3-30B-A3B shape)",
        harness.command_line("benchmarks.moe_gpu"),
        columns,
        rows,
        notes,
    )
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
