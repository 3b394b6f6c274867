"""Training on one GPU: whole-model tokens/s and peak GPU memory of juno-py against the strongest peers a user can
pick, in one run; and, with `--scale-70b`, one DoRA step of a Llama-70B-shaped model.

Models, all built on the GPU from random valid blocks (no file, no download: the device has no network and a real
model does not fit the 64 MiB that travels to it), in the exact shapes and per-tensor quant types of:
  llama8b        Llama-3-8B, all 32 layers (hidden 4096, MLP 14336, 32/8 heads, vocab 128256) as a Q4_K_M file holds
                 them: Q4_K, with Q6_K attn_v and ffn_down on the layers llama.cpp gives more bits, a Q6_K output
  qwen3-8b       Qwen3-8B, 36 layers (hidden 4096, MLP 12288, 32/8 heads of 128, per-head q/k norms, vocab 151936),
                 Q4_K_M as above
  gemma3-270m    the store's Gemma-3-270M Q4_K_M file (Q5_0/Q8_0/Q4_K/Q6_K mix, 262144-token tied embedding)
  smollm2-135m   the store's SmolLM2-135M-Instruct Q4_1 file (Q4_1 blocks, Q8_0 tied embedding)
The last two tables are read from `benchmarks/shapes/*.json` (metadata and tensor table of the real files, made
with `juno-py inspect --tensors`); the blocks come from `juno_py.testing.synthetic.random_blocks`, generated on the GPU.
juno-py trains through its real loop (`juno_py.train.loop.train`) with the base quantized on the GPU (weights
cache none) or with a resident bf16 copy (cache bf16). The peers are transformers holding the same decoded values
(Gemma's norms minus one) with PEFT adapters in their default fp32, fused AdamW and a plain step (forward with
labels, backward, clip, step): with bf16 weights; with Liger's kernels (RMSNorm, RoPE, SwiGLU, fused linear
cross-entropy) patched in; QLoRA (every decoder linear a bitsandbytes NF4 `Linear4bit`, bf16 compute); and QLoRA
with Liger. Configurations: LoRA on q,v at rank 8 (alpha 16), LoRA on all linears at rank 16 (alpha 32), DoRA on
all linears at rank 64 (alpha 128); 8 x 512 tokens a step. A step time is the median of `--steps` steps after
`--warmup`; peak memory is torch's max_memory_allocated from the built model to the last measured step (weights
included; the construction of a peer's model and the profiled steps after the measured ones not). Roofline: the step's counted matrix FLOPs (`step_flops`) per second over the
bf16 GEMM rate cuBLAS reaches on the same model's product shapes, measured in the same run (`gemm_rate`).
"Busy" is the share of one profiled step's wall time that the GPU spent in kernels: well under 100 % means the
step is bound by kernel launches and Python, not by the GPU (small models).

    python -m benchmarks.train_gpu               # every model and configuration: benchmarks/results/gpu-training.json
    python -m benchmarks.train_gpu --scale-70b   # benchmarks/results/gpu-scale-70b.json
    python -m benchmarks.train_gpu --device cpu --layers 1 --models smollm2-135m --configs lora-qv-r8 \
        --impls peft juno-none --steps 1 --warmup 1 --out /tmp/smoke.json     # smoke test of the script on the CPU
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
    n_layer=32,
    n_embd=4096,
    n_ff=14336,
    n_head=32,
    n_head_kv=8,
    n_vocab=128256,
    rope_base=500000.0,
    matrix_type=GGMLType.Q4_K,
    embd_type=GGMLType.Q4_K,
    output_type=GGMLType.Q6_K,
    q4_k_m=True,
)
SHAPE_QWEN3_8B = dict(
    arch="qwen3",
    n_layer=36,
    n_embd=4096,
    n_ff=12288,
    n_head=32,
    n_head_kv=8,
    head_dim=128,
    n_vocab=151936,
    rope_base=1000000.0,
    rms_eps=1e-6,
    matrix_type=GGMLType.Q4_K,
    embd_type=GGMLType.Q4_K,
    output_type=GGMLType.Q6_K,
    q4_k_m=True,
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
    "lora-qv-r8": dict(mode="lora", targets="qv", rank=8, alpha=16.0),
    "lora-all-r16": dict(mode="lora", targets="all", rank=16, alpha=32.0),
    "dora-all-r64": dict(mode="dora", targets="all", rank=64, alpha=128.0),
}
SHAPES_BY_NAME = {"llama8b": SHAPE_8B, "qwen3-8b": SHAPE_QWEN3_8B, "llama70b": None}
# the peers: (implementation label, NF4 base through bitsandbytes, Liger kernels patched into transformers)
PEERS = {
    "peft": ("transformers + PEFT", False, False),
    "qlora": ("QLoRA (bitsandbytes NF4) + PEFT", True, False),
    "peft-liger": ("transformers + PEFT + Liger", False, True),
    "qlora-liger": ("QLoRA + PEFT + Liger", True, True),
}
LIGER_PATCH = {
    "llama": "apply_liger_kernel_to_llama",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "gemma3": "apply_liger_kernel_to_gemma3_text",
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
    if name in SHAPES_BY_NAME:
        shape = SHAPES_BY_NAME[name] or SHAPE_70B
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
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        names = LAYER_NAMES
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


def to_nf4(model) -> None:
    """QLoRA's base: every linear of the decoder layers replaced by a bitsandbytes NF4 `Linear4bit` (double-quantized
    statistics, bf16 compute), quantized from the bf16 weights on the GPU; embeddings, norms and the head stay bf16."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    quant_type="nf4",
                    compress_statistics=True,
                    device="meta",
                )
                w = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True
                )
                q.weight = w.to(child.weight.device)
                setattr(parent, child_name, q)
                child.weight = None  # the bf16 copy is freed as each layer is converted


def patch_liger(arch: str) -> None:
    """Liger's kernels (RMSNorm, RoPE, SwiGLU/GeGLU, fused linear cross-entropy) patched into transformers' classes
    of `arch`. The patch is process-wide, so the Liger peers run after every other implementation."""
    import liger_kernel.transformers as liger

    getattr(liger, LIGER_PATCH[arch])()


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
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # peak from here: the built model, not its construction
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
    memory = getattr(args, "memory", False) and dev.startswith("cuda")
    if memory:
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
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
    if memory:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        peak, groups = harness.peak_breakdown(trace)
        print(
            f"  juno-py memory at the peak: {base / GIB:.2f} GiB before the steps (weights, adapters) + "
            f"{peak / GIB:.2f} GiB allocated during them; largest groups live at the peak:",
            file=sys.stderr,
        )
        for where, nbytes, blocks in groups:
            print(f"    {nbytes / 2**20:9.1f} MiB in {blocks:4d} blocks  {where}", file=sys.stderr)
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
    # the peak of the measured steps: a profiled step below runs through train() again and captures its own graph
    row.update(_peak_so_far(dev))
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


def run_peft(meta, tensors_spec, cfg: dict, args, nf4: bool = False, liger: bool = False) -> dict:
    from peft import LoraConfig, get_peft_model

    t_build = time.perf_counter()
    dev = args.device
    if liger:
        patch_liger(meta["general.architecture"])
    tensors = build_tensors(tensors_spec, dev)
    base = hf_model(meta, tensors, dev)
    del tensors  # the peer keeps only its bf16 weights (the bytes would be a file on disk)
    gc.collect()
    if nf4:
        to_nf4(base)
        gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # peak from here: the built model, not its construction
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
    row.update(_peak_so_far(dev))
    if args.profile and dev.startswith("cuda"):
        row["busy"] = busy_fraction(step)
    if args.kernels and dev.startswith("cuda"):
        kernel_table(step, f"PEFT {cfg['mode']} {cfg['targets']} r{cfg['rank']}")
    model = base = opt = params = None  # freed
    return row


def _peak_so_far(dev: str) -> dict:
    """The allocator's peak of the measured steps, for `measured`, read before any profiled step adds its own."""
    return {"peak_abs_bytes": torch.cuda.max_memory_allocated()} if dev.startswith("cuda") else {}


def measured(fn, *a, **kw) -> dict:
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if cuda else 0
    try:
        row = fn(*a, **kw)
        peak = row.pop("peak_abs_bytes", None) if cuda else None
        peak = torch.cuda.max_memory_allocated() if cuda and peak is None else peak
        row["peak_gib"] = (peak - start) / GIB if cuda else float("nan")
    except Exception as e:  # keep going: one failing configuration should not cost the others
        traceback.print_exc()
        row = dict(error=f"{type(e).__name__}: {e}"[:300])
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------------------ roofline
def linear_shapes(meta: dict, tensors_spec: list) -> list[tuple[str, int, int]]:
    """(tensor name, n_out, n_in) of every matrix a step multiplies by: each layer's linears and the output head
    (the tied embedding when the file has no output.weight)."""
    out = [(n, dims[0], dims[1]) for n, _, dims, _ in tensors_spec if n.startswith("blk.") and len(dims) == 2]
    by_name = {t[0]: t for t in tensors_spec}
    head = by_name.get("output.weight") or by_name["token_embd.weight"]
    return out + [("output.weight", head[2][0], head[2][1])]


TARGET_SUFFIXES = {
    "qv": ("attn_q.weight", "attn_v.weight"),
    "all": tuple(
        f"{k}.weight" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    ),
}


def step_flops(meta: dict, tensors_spec: list, cfg: dict, batch: int, seq: int) -> float:
    """The matrix FLOPs a step needs, counted from the shapes: every frozen product forward and its input gradient
    (2·2·T·n_out·n_in; no weight gradient), the adapters' products (forward, and both gradients: 6·T·r·(n_in+n_out)),
    and causal attention (QKᵀ and PV forward, 2.5 times that backward; Gemma's local layers over their window).
    Recomputation under activation checkpointing is not counted: it is overhead, not the step's work."""
    arch = meta["general.architecture"]
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    tokens = batch * seq
    flops = 0.0
    for name, n_out, n_in in linear_shapes(meta, tensors_spec):
        flops += 4.0 * tokens * n_out * n_in
        if name.endswith(TARGET_SUFFIXES[cfg["targets"]]):
            flops += 6.0 * tokens * cfg["rank"] * (n_in + n_out)
    n_head, n_layer = a("attention.head_count"), a("block_count")
    head_dim = a("attention.key_length") or a("embedding_length") // n_head
    window = a("attention.sliding_window")
    for layer in range(n_layer):
        local = arch == "gemma3" and window and (layer + 1) % 6 != 0
        span = min(seq, window) if local else seq
        pairs = seq * span - span * span / 2  # query-key pairs a causal (windowed) row sees, summed over rows
        flops += 3.5 * 4.0 * batch * pairs * n_head * head_dim
    return flops


def gemm_rate(meta: dict, tensors_spec: list, tokens: int, device: str, repeats: int = 10) -> float:
    """cuBLAS's bf16 FLOP/s on the step's own products, measured here: for every distinct (n_out, n_in) of the
    model, the forward product [T, n_in]·[n_in, n_out] and the input gradient [T, n_out]·[n_out, n_in], timed
    after a warm-up and weighted by how often the model holds that shape. Bytes are random: the rate does not
    depend on the values."""
    shapes: dict[tuple[int, int], int] = {}
    for _, n_out, n_in in linear_shapes(meta, tensors_spec):
        shapes[(n_out, n_in)] = shapes.get((n_out, n_in), 0) + 1
    total_flops = total_s = 0.0
    for (n_out, n_in), count in shapes.items():
        w = torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16)
        x = torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16)
        g = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
        for _ in range(2):
            torch.mm(x, w.t()), torch.mm(g, w)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.mm(x, w.t())
            torch.mm(g, w)
        sync(device)
        total_s += count * (time.perf_counter() - t0) / repeats
        total_flops += count * 4.0 * tokens * n_out * n_in
        w = x = g = None  # freed
    return total_flops / total_s


# ------------------------------------------------------------------------------------------------ tables
COLUMNS = [
    "model",
    "adapters",
    "implementation",
    "frozen weights",
    "ms/step",
    "tokens/s",
    "peak GiB",
    "roofline",
    "tokens/s vs best peer",
    "memory vs lowest peer",
    "busy",
]


def compare_rows(rows: list[dict], args) -> list[list]:
    """One table row per measured row; juno-py's rows carry their ratios to the fastest peer and to the peer with
    the lowest peak memory of the same model and configuration (each named)."""
    out = []
    for r in rows:
        peers = [
            p
            for p in rows
            if p["model"] == r["model"] and p["config"] == r["config"] and p["impl"] != "juno-py" and "error" not in p
        ]
        if "error" in r:
            out.append([r["model"], r["config"], r["impl"], r["cache"], f"failed: {r['error']}", *[""] * 6])
            continue
        tok = args.batch * args.seq / r["step_s"]
        vs_t = vs_m = "-"
        if peers and r["impl"] == "juno-py":
            fast = min(peers, key=lambda p: p["step_s"])
            lean = min(peers, key=lambda p: p["peak_gib"])
            vs_t = f"{fast['step_s'] / r['step_s']:.2f}x ({fast['impl']})"
            vs_m = f"{r['peak_gib'] / lean['peak_gib']:.2f}x ({lean['impl']})"
        roof = f"{100 * r['roofline']:.0f} %" if "roofline" in r else "-"
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
                roof,
                vs_t,
                vs_m,
                busy,
            ]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["llama8b", "qwen3-8b", "gemma3-270m", "smollm2-135m"])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument(
        "--impls",
        nargs="*",
        default=["peft", "qlora", "peft-liger", "qlora-liger", "juno-none"],
        help="peers: peft, qlora (bitsandbytes NF4 base), peft-liger, qlora-liger (Liger kernels); juno-none "
        "(quantized base on the GPU), juno-bf16 (resident bf16 copy); a suffix -eager turns CUDA graphs off "
        "(juno-none-eager)",
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
    ap.add_argument(
        "--memory",
        action="store_true",
        help="record the CUDA allocator during juno-py's steps and print what is live at the peak (slows the steps)",
    )
    ap.add_argument("--scale-70b", action="store_true", help="one DoRA step of the 70B-shaped model instead")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only smoke-tests the script")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N blocks (smoke tests)")
    ap.add_argument("--rows-json", type=Path, help="also write every measured row, as JSON, here")
    ap.add_argument(
        "--include-rows",
        type=Path,
        nargs="*",
        default=[],
        help="rows JSON of earlier runs of this script on the same machine (--rows-json), tabled with this run's: "
        "one table from runs split to fit a time limit",
    )
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
        rows = [r for path in args.include_rows for r in json.loads(path.read_text())["rows"]]
        models = list(dict.fromkeys([r["model"] for r in rows] + args.models))
        # the Liger peers patch transformers process-wide, so they run after every other implementation
        impls = sorted(args.impls, key=lambda i: i.endswith("-liger"))
        plan = [(impl, name, cname) for impl in impls for name in args.models for cname in args.configs]
        plan.sort(key=lambda x: (x[0].endswith("-liger"), args.models.index(x[1]), args.configs.index(x[2])))
        rates: dict[str, float] = {}
        for impl, name, cname in plan:
            meta, spec = model_spec(name, args.layers)
            cfg = CONFIGS[cname]
            if name not in rates and args.device.startswith("cuda"):
                rates[name] = gemm_rate(meta, spec, args.batch * args.seq, args.device)
                print(f"{name}: bf16 GEMM rate {rates[name] / 1e12:.0f} TFLOP/s on its shapes", file=sys.stderr)
            sub = argparse.Namespace(
                **{**vars(args), "profile": args.profile and not name.startswith(("llama8b", "qwen3-8b"))}
            )
            if impl in PEERS:
                label, nf4, liger = PEERS[impl]
                row = measured(run_peft, meta, spec, cfg, sub, nf4=nf4, liger=liger)
                row.update(impl=label, cache="NF4 (bitsandbytes)" if nf4 else "bf16 (dense)")
            else:
                _, cache, *eager = impl.split("-")
                row = measured(run_juno, meta, spec, cfg, cache, sub, graphs="off" if eager else "auto")
                row.update(
                    impl="juno-py",
                    cache={"none": "quantized on GPU", "bf16": "bf16 cache"}[cache]
                    + (", eager steps" if eager else ""),
                )
            row.update(model=name, config=cname)
            if "step_s" in row and name in rates:
                flops = step_flops(meta, spec, cfg, args.batch, args.seq)
                row.update(step_tflop=flops / 1e12, gemm_tflops=rates[name] / 1e12)
                row["roofline"] = flops / row["step_s"] / rates[name]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        order = {k: i for i, k in enumerate(models)}
        rows.sort(key=lambda r: (order[r["model"]], list(CONFIGS).index(r["config"])))
        record = harness.results(
            "gpu-training",
            "Whole-model training on one GPU",
            command,
            COLUMNS,
            compare_rows(rows, args),
            [
                f"{args.batch} x {args.seq} tokens a step, median of {args.steps} steps after {args.warmup}. Peak: "
                "torch's max_memory_allocated from the built model through the measured steps, weights included. Busy: "
                "GPU kernel time over the wall time of one profiled step, run after the measured ones."
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
