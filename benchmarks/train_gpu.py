"""Training on one GPU: whole-model tokens/s and peak GPU memory of juno-py against transformers (the same weights
dequantized to bf16) with PEFT, in one run; and, with `--scale-70b`, one DoRA step of a Llama-70B-shaped model.

Models, all built on the GPU from random valid blocks (no file, no download: the device has no network and a real
model does not fit the 64 MiB that travels to it), in the exact shapes and per-tensor quant types of:
  smollm2-135m   the store's SmolLM2-135M-Instruct Q4_1 file (Q4_1 blocks, Q8_0 tied embedding)
  gemma3-270m    the store's Gemma-3-270M Q4_K_M file (Q5_0/Q8_0/Q4_K/Q6_K mix, 262144-token tied embedding)
  llama8b-4l     four Llama-3-8B-shaped layers (hidden 4096, MLP 14336, 32/8 heads, vocab 128256), Q4_K with a
                 Q6_K output, as a Q4_K_M file would hold them
The first two tables are read from `benchmarks/shapes/*.json` (metadata and tensor table of the real files, made
with `juno-py inspect --tensors`); the blocks come from `juno_py.testing.synthetic.random_blocks`, generated on the GPU.
juno-py trains through its real loop (`juno_py.train.loop.train`) with the base quantized on the GPU (weights
cache none) or with a resident bf16 copy (cache bf16); the peer is transformers (bf16 weights, the same decoded
values; Q/K rows un-permuted, Gemma's norms minus one) with PEFT adapters in their default fp32, fused AdamW, a plain
step (forward with labels, backward, clip, step). Configurations: DoRA on all linears at rank 64 (alpha 128) and
LoRA on q,v at rank 8 (alpha 16); 8 x 512 tokens a step. A step time is the median of `--steps` steps after
`--warmup`; peak memory is torch's max_memory_allocated over the configuration's whole life (weights included).
"Busy" is the share of one profiled step's wall time that the GPU spent in kernels: well under 100 % means the
step is bound by kernel launches and Python, not by the GPU (small models).

    python -m benchmarks.train_gpu               # every model and configuration: benchmarks/results/gpu-training.json
    python -m benchmarks.train_gpu --scale-70b   # benchmarks/results/gpu-scale-70b.json
    python -m benchmarks.train_gpu --device cpu --layers 1 --models smollm2-135m --configs lora-qv-r8 \
        --impls juno-none --steps 1 --warmup 1 --out /tmp/smoke.json          # smoke test of the script on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import harness
from juno_py.gguf import GGMLType
from juno_py.testing.synthetic import llama_metadata, llama_tensors, random_blocks

SHAPES = Path(__file__).resolve().parent / "shapes"
SHAPE_8B = dict(
    n_layer=4,
    n_embd=4096,
    n_ff=14336,
    n_head=32,
    n_head_kv=8,
    n_vocab=128256,
    rope_base=500000.0,
    matrix_type=GGMLType.Q4_K,
    embd_type=GGMLType.Q4_K,
    output_type=GGMLType.Q6_K,
)
SHAPE_70B = dict(
    n_layer=80,
    n_embd=8192,
    n_ff=28672,
    n_head=64,
    n_head_kv=8,
    n_vocab=128256,
    rope_base=500000.0,
    matrix_type=GGMLType.Q4_K,
    embd_type=GGMLType.Q4_K,
    output_type=GGMLType.Q6_K,
)
CONFIGS = {
    "dora-all-r64": dict(mode="dora", targets="all", rank=64, alpha=128.0),
    "lora-qv-r8": dict(mode="lora", targets="qv", rank=8, alpha=16.0),
}
PEFT_TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
}
GIB = 2**30


# ------------------------------------------------------------------------------------------------ models
def model_spec(name: str, layers: int = 0) -> tuple[dict, list]:
    """(metadata {key: value}, [(tensor name, GGML type, shape, is the embedding)]); `layers` > 0 keeps only the
    first blocks (smoke tests)."""
    if name in ("llama8b-4l", "llama70b"):
        shape = SHAPE_8B if name == "llama8b-4l" else SHAPE_70B
        meta, tensors = {k: v for k, v, _ in llama_metadata(shape)}, llama_tensors(shape)
    else:
        doc = json.loads((SHAPES / f"{name}.json").read_text())
        meta = {k: v for k, (v, _) in doc["metadata"].items()}
        tensors = [(n, GGMLType[t], tuple(s), n == "token_embd.weight") for n, t, s in doc["tensors"]]
    if layers:
        arch = meta["general.architecture"]
        meta[f"{arch}.block_count"] = layers
        tensors = [t for t in tensors if not t[0].startswith("blk.") or int(t[0].split(".")[1]) < layers]
    return meta, tensors


def build_tensors(tensors: list, device: str, seed: int = 0) -> dict:
    """Every tensor's bytes, made where it will be used: random valid blocks on the GPU, norms (F32) as ones."""
    out = {}
    for i, (name, t, dims, embedding) in enumerate(tensors):
        if t == GGMLType.F32:
            out[name] = (t, dims, torch.ones(dims, dtype=torch.float32).view(torch.uint8))
        else:
            gen = torch.Generator(device).manual_seed(seed * 1_000_003 + i)
            out[name] = (t, dims, random_blocks(t, dims[0], dims[1], gen, embedding, device=device).view(dims[0], -1))
    return out


def juno_model(meta: dict, tensors: dict, cache: str, device: str = "cuda", compute=torch.bfloat16):
    from juno_py.models.model import Transformer

    model = Transformer.from_tensors(meta, tensors, compute_dtype=compute, label="<synthetic>")
    return model.place(device, cache if device.startswith("cuda") else "none")


def hf_model(meta: dict, tensors: dict, device: str = "cuda", dtype=torch.bfloat16):
    """transformers' model of the same architecture holding the same weights, decoded to `dtype` on `device`."""
    import transformers

    from juno_py.exchange.peft import hf_rows
    from juno_py.kernels.dequant import dequantize_reference, dequantize_tile
    from juno_py.testing.tiny_models import GEMMA_LAYER_NAMES, LAYER_NAMES

    arch = meta["general.architecture"]
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    d, n_head, n_kv = a("embedding_length"), a("attention.head_count"), a("attention.head_count_kv")
    head_dim = a("attention.key_length") or d // n_head
    common = dict(
        vocab_size=tensors["token_embd.weight"][1][0],
        hidden_size=d,
        intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=a("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=a("context_length"),
        rope_theta=a("rope.freq_base"),
        tie_word_embeddings="output.weight" not in tensors,
    )
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(
            sliding_window=a("attention.sliding_window"), query_pre_attn_scalar=head_dim, **common
        )
        names = GEMMA_LAYER_NAMES
    else:
        config = transformers.LlamaConfig(**common)
        names = LAYER_NAMES
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for hf_name, p in model.state_dict().items():
            if hf_name == "lm_head.weight":
                name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
            elif hf_name == "model.embed_tokens.weight":
                name = "token_embd.weight"
            elif hf_name == "model.norm.weight":
                name = "output_norm.weight"
            else:
                _, _, layer, rest = hf_name.split(".", 3)
                module, kind = rest.rsplit(".", 1)
                name = f"blk.{layer}.{names[module]}.{kind}"
            t, dims, raw = tensors[name]
            if t == GGMLType.F32:
                w = raw.view(torch.float32).to(device)
                w = w - 1 if arch == "gemma3" and "norm" in name else w  # HF Gemma applies (1 + w)
            elif raw.is_cuda:
                w = dequantize_tile(raw, t, dims[1], dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            else:
                w = dequantize_reference(raw, t, dims[1], dtype).to(device)
                if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                    w = hf_rows(w, n_head if ".attn_q." in name else n_kv)
            p.copy_(w.reshape(p.shape))
            w = None  # freed
    return model


# ------------------------------------------------------------------------------------------------ one run
def token_rows(n_vocab: int, batch: int, seq: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, min(n_vocab, 32000), (n * batch, seq), generator=g)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def busy_fraction(step) -> float:
    """GPU kernel time over wall time of one profiled call of `step` (a lower bound: profiling adds overhead)."""
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync("cuda")
    wall = time.perf_counter() - t0
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    return kernels / wall


def kernel_table(step, label: str) -> None:
    """torch.profiler's table of one call of `step` (CPU and CUDA), by device time: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync("cuda")
    print(f"\n### kernels of one step: {label}\n", file=sys.stderr)
    print(
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70),
        file=sys.stderr,
    )


def run_juno(
    meta, tensors_spec, cfg: dict, cache: str, args, grad_checkpoint=False, batch=None, seq=None, graphs: str = "auto"
) -> dict:
    from juno_py.lora import Mode, attach
    from juno_py.metrics import MetricsRecorder
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    batch, seq, dev = batch or args.batch, seq or args.seq, args.device
    t_build = time.perf_counter()
    model = juno_model(meta, build_tensors(tensors_spec, dev), cache, dev)
    adapters = attach(model, cfg["targets"], rank=cfg["rank"], alpha=cfg["alpha"], mode=Mode[cfg["mode"].upper()])
    build_s = time.perf_counter() - t_build
    n_steps = args.warmup + args.steps
    rows = token_rows(model.embed.n_vocab, batch, seq, n_steps)
    examples = [Example(r.tolist(), [True] * seq) for r in rows]
    tc = TrainConfig(
        lr=1e-4,
        batch_size=batch,
        max_steps=n_steps,
        epochs=None,
        schedule="constant",
        max_seq_len=seq,
        seed=0,
        grad_checkpoint=grad_checkpoint,
        cuda_graphs=graphs,
    )
    rec = MetricsRecorder()
    sync(dev)
    t0 = time.time()
    train(
        model,
        adapters,
        examples,
        tc,
        recorder=rec,
        progress=False,
        log=lambda s: print(f"  juno-py: {s}", file=sys.stderr) if "CUDA graph" in s else None,
    )
    sync(dev)
    steps = [e for e in rec.events if e.kind == "train_step"]
    stamps = [t0] + [e.time for e in steps]
    times = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup :]
    row = dict(
        step_s=statistics.median(times),
        losses=[round(e.values["loss"], 4) for e in steps],
        build_s=build_s,
        trainable=adapters.n_parameters(),
        last_step_ms={k: round(v, 1) for k, v in steps[-1].values.items() if k.endswith("_ms")},
    )
    if args.profile and dev.startswith("cuda"):
        one = [Example(r.tolist(), [True] * seq) for r in rows[:batch]]
        tc1 = TrainConfig(
            lr=1e-4,
            batch_size=batch,
            max_steps=1,
            epochs=None,
            schedule="constant",
            max_seq_len=seq,
            grad_checkpoint=grad_checkpoint,
        )
        row["busy"] = busy_fraction(lambda: train(model, adapters, one, tc1, progress=False, log=lambda s: None))
    if args.kernels and dev.startswith("cuda"):
        one = [Example(r.tolist(), [True] * seq) for r in rows[:batch]]
        tc1 = TrainConfig(
            lr=1e-4,
            batch_size=batch,
            max_steps=1,
            epochs=None,
            schedule="constant",
            max_seq_len=seq,
            grad_checkpoint=grad_checkpoint,
        )
        kernel_table(
            lambda: train(model, adapters, one, tc1, progress=False, log=lambda s: None),
            f"juno-py {cfg['mode']} {cfg['targets']} r{cfg['rank']}, cache {cache}",
        )
    model = adapters = None  # freed
    return row


def run_peft(meta, tensors_spec, cfg: dict, args) -> dict:
    from peft import LoraConfig, get_peft_model

    t_build = time.perf_counter()
    dev = args.device
    tensors = build_tensors(tensors_spec, dev)
    base = hf_model(meta, tensors, dev)
    del tensors  # the peer keeps only its bf16 weights (the bytes would be a file on disk)
    gc.collect()
    model = get_peft_model(
        base,
        LoraConfig(
            r=cfg["rank"],
            lora_alpha=cfg["alpha"],
            target_modules=PEFT_TARGETS[cfg["targets"]],
            lora_dropout=0.0,
            use_dora=cfg["mode"] == "dora",
        ),
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    build_s = time.perf_counter() - t_build
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rows = token_rows(base.config.vocab_size, args.batch, args.seq, 1).to(dev)
    losses = []

    def step():
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    for _ in range(args.warmup + args.steps):
        sync(dev)
        t0 = time.perf_counter()
        losses.append(round(float(step()), 4))
        sync(dev)
        times.append(time.perf_counter() - t0)
    row = dict(
        step_s=statistics.median(times[args.warmup :]),
        losses=losses,
        build_s=build_s,
        trainable=sum(p.numel() for p in params),
    )
    if args.profile and dev.startswith("cuda"):
        row["busy"] = busy_fraction(step)
    if args.kernels and dev.startswith("cuda"):
        kernel_table(step, f"PEFT {cfg['mode']} {cfg['targets']} r{cfg['rank']}")
    model = base = opt = params = None  # freed
    return row


def measured(fn, *a, **kw) -> dict:
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if cuda else 0
    try:
        row = fn(*a, **kw)
        row["peak_gib"] = (torch.cuda.max_memory_allocated() - start) / GIB if cuda else float("nan")
    except Exception as e:  # keep going: one failing configuration should not cost the others
        traceback.print_exc()
        row = dict(error=f"{type(e).__name__}: {e}"[:300])
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------------------ tables
COLUMNS = [
    "model",
    "adapters",
    "implementation",
    "frozen weights",
    "ms/step",
    "tokens/s",
    "peak GiB",
    "tokens/s vs PEFT",
    "memory vs PEFT",
    "busy",
]


def compare_rows(rows: list[dict], args) -> list[list]:
    out = []
    for r in rows:
        peer = next(
            (
                p
                for p in rows
                if p["model"] == r["model"] and p["config"] == r["config"] and p["impl"] == "transformers + PEFT"
            ),
            None,
        )
        if "error" in r:
            out.append([r["model"], r["config"], r["impl"], r["cache"], f"failed: {r['error']}", "", "", "", "", ""])
            continue
        tok = args.batch * args.seq / r["step_s"]
        vs_t = vs_m = "-"
        if peer and "error" not in peer and r is not peer:
            vs_t = f"{tok / (args.batch * args.seq / peer['step_s']):.2f}x"
            vs_m = f"{r['peak_gib'] / peer['peak_gib']:.2f}x"
        busy = f"{100 * r['busy']:.0f} %" if "busy" in r else "-"
        out.append(
            [
                r["model"],
                r["config"],
                r["impl"],
                r["cache"],
                round(1e3 * r["step_s"], 1),
                f"{tok:,.0f}",
                round(r["peak_gib"], 2),
                vs_t,
                vs_m,
                busy,
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["smollm2-135m", "gemma3-270m", "llama8b-4l"])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument(
        "--impls",
        nargs="*",
        default=["peft", "juno-none"],
        help="peft, juno-none (quantized base on the GPU), juno-bf16 (resident bf16 copy); a suffix "
        "-eager turns CUDA graphs off (juno-none-eager)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile one extra step for the GPU-busy share (small models only)",
    )
    ap.add_argument("--kernels", action="store_true", help="print torch.profiler's kernel table of one step per run")
    ap.add_argument("--scale-70b", action="store_true", help="one DoRA step of the 70B-shaped model instead")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only smoke-tests the script")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N blocks (smoke tests)")
    ap.add_argument("--rows-json", type=Path, help="also write every measured row, as JSON, here")
    harness.add_output_args(ap)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    env = harness.environment(args.device)
    print(env["hardware"], env["software"], file=sys.stderr)
    command = harness.command_line("benchmarks.train_gpu")

    if args.scale_70b:
        rows = [scale_70b(args)]
        r = rows[0]
        columns = [
            "model",
            "adapters",
            "tokens a step",
            "s/step",
            "tokens/s",
            "peak GiB",
            "quantized weights GiB",
            "forward s",
            "backward s",
            "optimizer s",
        ]
        table = (
            [
                [
                    r["model"],
                    r["config"],
                    r["tokens"],
                    round(r["step_s"], 2),
                    f"{r['tokens_per_s']:,.0f}",
                    round(r["peak_total_gib"], 1),
                    round(r["quant_bytes"] / GIB, 1),
                    *(
                        round(r["last_step_ms"][k] / 1e3, 2) if k in r["last_step_ms"] else ""
                        for k in ("forward_ms", "backward_ms", "optimizer_ms")
                    ),
                ]
            ]
            if "step_s" in r
            else [[r["model"], r["config"], r["tokens"], f"failed: {r.get('error')}"]]
        )
        record = harness.results(
            "gpu-scale-70b",
            "A Llama-70B-shaped DoRA step on one GPU",
            command,
            columns,
            table,
            [
                "DoRA on every linear, r 64, 1 x 4096 tokens, --grad-checkpoint; peak: torch's "
                "max_memory_allocated, the quantized weights included."
            ],
            env=env,
        )
    else:
        rows = []
        for name in args.models:
            meta, spec = model_spec(name, args.layers)
            for cname in args.configs:
                cfg = CONFIGS[cname]
                for impl in args.impls:
                    sub = argparse.Namespace(**{**vars(args), "profile": args.profile and name != "llama8b-4l"})
                    if impl == "peft":
                        row = measured(run_peft, meta, spec, cfg, sub)
                    else:
                        _, cache, *eager = impl.split("-")
                        row = measured(run_juno, meta, spec, cfg, cache, sub, graphs="off" if eager else "auto")
                    row.update(
                        model=name,
                        config=cname,
                        impl="transformers + PEFT" if impl == "peft" else "juno-py",
                        cache={"peft": "bf16 (dense)", "juno-none": "quantized on GPU", "juno-bf16": "bf16 cache"}[
                            impl.removesuffix("-eager")
                        ]
                        + (", eager steps" if impl.endswith("-eager") else ""),
                    )
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
        record = harness.results(
            "gpu-training",
            "Whole-model training on one GPU",
            command,
            COLUMNS,
            compare_rows(rows, args),
            [
                f"{args.batch} x {args.seq} tokens a step, median of {args.steps} steps after {args.warmup}. Peak: "
                "torch's max_memory_allocated over the configuration's life, weights included. Busy: GPU kernel time "
                "over the wall time of one profiled step."
            ],
            env=env,
        )
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)
    if args.rows_json:
        harness.write_json(args.rows_json, dict(rows=rows, software=env["software"], argv=sys.argv[1:]))


def scale_70b(args) -> dict:
    """DoRA on all linears, rank 64, 1 x 4096 tokens, activation checkpointing, Llama-70B-shaped Q4_K model built
    on the GPU (80 layers, hidden 8192, MLP 28672, 64/8 heads, vocab 128256; Q6_K output)."""
    meta, spec = model_spec("llama70b", args.layers)
    sub = argparse.Namespace(**{**vars(args), "profile": False})
    torch.cuda.reset_peak_memory_stats()
    row = measured(
        run_juno,
        meta,
        spec,
        dict(mode="dora", targets="all", rank=64, alpha=128.0),
        "none",
        sub,
        grad_checkpoint=True,
        batch=1,
        seq=4096,
    )
    from juno_py.gguf.constants import GGML_BLOCK_SIZES

    quant_bytes = 0
    for _, t, dims, _ in spec:
        n = 1
        for x in dims:
            n *= x
        quant_bytes += n // GGML_BLOCK_SIZES[t][0] * GGML_BLOCK_SIZES[t][1]
    row.update(
        model="llama70b-shaped Q4_K",
        config="dora-all-r64, --grad-checkpoint",
        tokens=4096,
        peak_total_gib=torch.cuda.max_memory_allocated() / GIB,
        quant_bytes=quant_bytes,
    )
    if "step_s" in row:
        row["tokens_per_s"] = 4096 / row["step_s"]
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
