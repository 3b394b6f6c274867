"""Training a mixture-of-experts model: LoRA on attention and experts of a Qwen3-30B-A3B-shaped qwen3moe model
(48 layers, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top 8, vocab 151936; Q4_K matrices,
Q6_K output, F32 embeddings, norms and router), 8 x 512 tokens a step: seconds per step, tokens/s and peak device
memory, against transformers + PEFT on the same shape in bf16.

juno-py's model is built in memory on the device (`Transformer.from_tensors`) from random valid blocks
(`juno_py.testing.synthetic.random_blocks`): no file and no host copy; its matrices stay quantized. Decode and matmul
time do not depend on the values. `--layers`, `--experts` and the other shape flags shrink it for a smoke run.

The peer, in its own process (run first, so neither holds the other's memory): transformers' `Qwen3MoeForCausalLM`
built on the device in bf16 with random weights (`experts_implementation="grouped_mm"` where the installed
transformers has it: its experts are fused 3-D parameters multiplied by `torch._grouped_mm`), SDPA attention, PEFT
LoRA of the same rank on q/k/v/o and, through `target_parameters`, on the experts' `gate_up_proj` and `down_proj`
(per expert), gradient checkpointing when juno-py uses it, fused AdamW, the same tokens a step.

    python -m benchmarks.moe_gpu                                   # on a GPU: table, results/gpu-training-moe.json
    python -m benchmarks.moe_gpu --device cpu --layers 1 --experts 8 --n-embd 256 --n-ff-exp 256 --vocab 1024 \\
        --batch 1 --seq 32 --warmup 1 --steps 1 --heads 4 --kv-heads 2 --no-results   # a smoke run, both sides
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

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


# the peer's LoRA on the experts: PEFT's `target_parameters` names (transformers keeps each block's experts as fused
# 3-D parameters, gate and up in one)
PEER_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PEER_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def profiled_recorder(last: int, cuda: bool):
    """A MetricsRecorder that profiles the `last`-th training step (0: none) with torch.profiler, stepping the
    profiler's schedule at each train_step event (after the device finished the step); its `close()` prints that
    step's operations and kernels by device time. A steady step of the measured run itself, not the first step of
    a fresh one (which runs eagerly and allocates the optimizer's state)."""
    import torch

    from juno_py.metrics import MetricsRecorder

    class Recorder(MetricsRecorder):
        prof: Any = None

        def emit(self, kind: str, **values: Any):
            event = super().emit(kind, **values)
            if kind == "train_step" and self.prof is not None:
                if cuda:
                    torch.cuda.synchronize()
                self.prof.step()
            return event

        def close(self) -> None:
            if self.prof is None:
                return
            self.prof.__exit__(None, None, None)
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            print(f"\n### juno-py step {last}, by {'device' if cuda else 'CPU'} time\n", file=sys.stderr)
            print(self.prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70), file=sys.stderr)
            self.prof = None

    rec = Recorder()
    if last > 0:
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        warm = 1 if last > 1 else 0  # one step's warm-up of the profiler before the profiled one
        rec.prof = profile(activities=acts, schedule=schedule(wait=last - 1 - warm, warmup=warm, active=1, repeat=1))
        rec.prof.__enter__()
    return rec


def run_peer(a: argparse.Namespace) -> dict[str, Any]:
    """transformers + PEFT on the shape of `a`: {tokens_s, step_s, peak_gib, losses, experts_implementation,
    expert_lora, trainable}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    kw: dict[str, Any] = dict(
        vocab_size=a.vocab,
        hidden_size=a.n_embd,
        intermediate_size=6144,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=128,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.n_ff_exp,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        use_cache=False,
    )
    try:
        grouped: dict[str, Any] = {"experts_implementation": "grouped_mm"}
        config = Qwen3MoeConfig(**kw, **grouped)
    except (TypeError, ValueError):
        config = Qwen3MoeConfig(**kw)
    config._attn_implementation = "sdpa"
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model: Any = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(dtype)
    # what transformers dispatched to (a transformers without the setting runs its per-expert loop)
    experts_impl = str(getattr(model.config, "_experts_implementation", None) or "eager (a loop over the experts)")
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:  # routers as juno-py's: each token its own experts
            router = layer.mlp.gate.weight
            router.copy_(torch.randn(router.shape, generator=g, device=device) * a.n_embd**-0.5)
    if a.grad_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = dict(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, target_modules=PEER_ATTENTION)
    expert_lora = "per expert (PEFT target_parameters: gate_up_proj, down_proj)"
    if a.peer_attention_only:
        expert_lora = "none (the run with expert LoRA failed: " + a.peer_attention_only + "); attention only"
        model = get_peft_model(model, LoraConfig(**lora))
    else:
        try:
            model = get_peft_model(model, LoraConfig(**lora, target_parameters=PEER_EXPERT_PARAMETERS))
        except (TypeError, ValueError) as e:
            expert_lora = f"none (PEFT refused target_parameters: {type(e).__name__}); attention only"
            model = get_peft_model(model, LoraConfig(**lora))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 3))  # a sync
        times.append(time.perf_counter() - t0)
    timed = times[a.warmup :] or times
    step_s = sum(timed) / len(timed)
    return dict(
        tokens_s=a.batch * a.seq / step_s,
        step_s=step_s,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan"),
        losses=losses,
        experts_implementation=experts_impl,
        expert_lora=expert_lora,
        trainable=sum(p.numel() for p in params),
    )


def peer_in_process(argv: list[str]) -> dict[str, Any]:
    """The peer in its own process (`--peer-only`): its JSON line; where it failed with LoRA on the experts, once
    more with LoRA on attention only; {"error": ...} when that failed too."""
    cmd = [sys.executable, "-m", "benchmarks.moe_gpu", *argv, "--peer-only"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=harness.ROOT)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        why = (proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"])[0][:200]
        proc = subprocess.run([*cmd, "--peer-attention-only", why], capture_output=True, text=True, cwd=harness.ROOT)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            return {"error": f"{why}; attention only: {tail[0][:200]}"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not counted")
    ap.add_argument("--steps", type=int, default=3, help="steps measured after the warmup")
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
    ap.add_argument("--expert-path", default="auto", choices=["auto", "grouped", "loop"], help="juno-py's experts")
    ap.add_argument("--skip-peer", action="store_true", help="juno-py only: no transformers + PEFT run")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"], help="juno-py's step graphs")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="print torch.profiler's table of juno-py's last step (a steady one: graphed if the run is), by device "
        "time; that step's time then includes the profiler's overhead",
    )
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)  # the peer's own process
    ap.add_argument("--peer-attention-only", default="", help=argparse.SUPPRESS)  # why its expert LoRA failed
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.peer_only:
        print(json.dumps(run_peer(args)))
        return
    peer_argv = [a for a in sys.argv[1:] if a != "--skip-peer"]
    peer = None if args.skip_peer else peer_in_process(peer_argv)

    import torch

    from juno_py.lora import attach
    from juno_py.models import Transformer
    from juno_py.models.moe import MoEFeedForward
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    compute = torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    meta, tensors = qwen3moe_tensors(args, device)
    model = Transformer.from_tensors(meta, tensors, compute_dtype=compute, label="synthetic-qwen3moe")
    model.place(device)
    for moe in model.modules():
        if isinstance(moe, MoEFeedForward):
            moe.expert_path = args.expert_path
    weight_gib = sum(r.numel() for _, _, r in tensors.values()) / 2**30
    print(f"built {weight_gib:.2f} GiB of weights in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    adapters = attach(model, args.targets, rank=args.rank, alpha=2.0 * args.rank, experts=args.lora_experts)
    g = torch.Generator().manual_seed(0)
    n_steps = args.warmup + args.steps
    ids = torch.randint(0, args.vocab, (args.batch * n_steps, args.seq), generator=g)
    examples = [Example(row.tolist(), [True] * args.seq) for row in ids]
    cfg = TrainConfig(
        lr=1e-4,
        batch_size=args.batch,
        max_steps=n_steps,
        epochs=None,
        schedule="constant",
        grad_checkpoint=args.grad_checkpoint,
        max_seq_len=args.seq,
        cuda_graphs=args.cuda_graphs,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rec = profiled_recorder(n_steps if args.kernels else 0, cuda)
    start = time.time()
    said: list[str] = []
    train(
        model,
        adapters,
        examples,
        cfg,
        recorder=rec,
        progress=False,
        log=lambda m: said.append(m) or print(m, file=sys.stderr),
    )
    graphed = any("captured a CUDA graph" in m for m in said)
    rec.close()
    steps = [e for e in rec.events if e.kind == "train_step"]
    stamps = [start] + [e.time for e in steps]
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = times[args.warmup :] or times
    step_s = sum(timed) / len(timed)
    tok_s = args.batch * args.seq / step_s
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    loads = [e.values for e in rec.events if e.kind == "expert_load"]
    probe = torch.empty(0, device=device, dtype=model.act_dtype)
    paths = {moe.runs_grouped(probe) for moe in model.modules() if isinstance(moe, MoEFeedForward)}
    expert_path = "grouped" if paths == {True} else "loop" if paths == {False} else "mixed"
    columns = ["implementation", "tokens/s", "s/step", "peak GiB", "tokens/s vs peer"]
    rows = [["juno-py (Q4_K, experts " + expert_path + ")", round(tok_s), round(step_s, 3), round(peak, 2), "-"]]
    if peer is not None and "error" not in peer:
        rows[0][-1] = round(tok_s / peer["tokens_s"], 2)
        rows.append(
            [
                f"transformers + PEFT (bf16, experts {peer['experts_implementation']})",
                round(peer["tokens_s"]),
                round(peer["step_s"], 3),
                round(peer["peak_gib"], 2),
                "-",
            ]
        )
    last = steps[-1].values if steps else {}
    notes = [
        f"Mean over {len(timed)} steps after {args.warmup} warmup; peak: torch's max_memory_allocated after the "
        f"model was built, weights included. juno-py: {weight_gib:.2f} GiB of weights (F32 embeddings, norms and "
        "router; the rest quantized); "
        + (
            f"last step's graph replay (forward and backward) {last.get('forward_ms', 0.0):.0f} ms, optimizer "
            f"{last.get('optimizer_ms', 0.0):.0f} ms"
            if graphed
            else "last step forward/backward/optimizer "
            + "/".join(f"{last.get(k, 0.0):.0f}" for k in ("forward_ms", "backward_ms", "optimizer_ms"))
            + " ms"
        )
        + f"; losses {[round(e.values['loss'], 3) for e in steps]}.",
        f"Synthetic qwen3moe: {args.layers} layers, hidden {args.n_embd}, {args.heads}/{args.kv_heads} heads of 128, "
        f"{args.experts} experts of {args.n_ff_exp}, top {args.top_k}, vocab {args.vocab}; Q4_K (Q6_K output); LoRA "
        f"r={args.rank} on {args.targets} ({args.lora_experts}, {adapters.n_parameters():,} parameters); "
        f"{args.batch} x {args.seq} tokens a step; compute {args.compute_dtype}; grad checkpoint "
        f"{args.grad_checkpoint}; juno-py's steps {'replayed as a CUDA graph' if graphed else 'eager'}.",
        f"Router load, last step: worst imbalance {loads[-1]['imbalance_max']:.2f}, idle experts "
        f"{loads[-1]['idle_experts']}."
        if loads
        else "No router load recorded.",
    ]
    if peer is None:
        notes.append("Peer not run (--skip-peer).")
    elif "error" in peer:
        notes.append(f"Peer failed: {peer['error']}")
    else:
        fused = (
            "; gate and up are one fused parameter there, so one adapter per expert covers both"
            if peer["expert_lora"].startswith("per expert")
            else ""
        )
        notes.append(
            f"Peer: transformers Qwen3MoeForCausalLM, bf16 random weights built on the device, SDPA, experts "
            f"{peer['experts_implementation']}; PEFT LoRA r={args.rank} on q/k/v/o, on the experts "
            f"{peer['expert_lora']} ({peer['trainable']:,} parameters{fused}); gradient checkpointing "
            f"{args.grad_checkpoint}; fused AdamW; losses {peer['losses']}."
        )
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
