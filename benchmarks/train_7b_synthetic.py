"""Training at 7B scale on a small machine: one LoRA step (q,v, rank 8, 4 x 128 tokens, activation
checkpointing) on a synthetic Llama-7B-shaped Q4_K model; seconds per step and peak RSS.

The model (32 layers, hidden 4096, MLP 11008, 32 heads, vocab 32000; Q4_K everywhere, Q6_K output, F32 norms:
about 3.9 GB) is written once into a temporary file with our GGUFWriter from random bytes whose float16 scale
fields are set to small finite values, so every block is valid and activations stay finite. The base stays
quantized and memory-mapped: no dequantized copy of the weights ever exists.

    python benchmarks/train_7b_synthetic.py                       # writes the model, trains, prints a table
    python benchmarks/train_7b_synthetic.py --append docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from juno_py.gguf import GGMLType, GGUFWriter, ValueType  # noqa: E402
from juno_py.gguf.constants import GGML_BLOCK_SIZES  # noqa: E402

SHAPE_7B = dict(n_layer=32, n_embd=4096, n_ff=11008, n_head=32, n_head_kv=32, n_vocab=32000, rope_base=10000.0,
                matrix_type=GGMLType.Q4_K, embd_type=GGMLType.Q4_K, output_type=GGMLType.Q6_K)
# SmolLM2-135M as the store's file has it: Q4_1 blocks, Q8_0 embedding, tied output
SHAPE_SMOLLM2 = dict(n_layer=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, n_vocab=49152, rope_base=100000.0,
                     matrix_type=GGMLType.Q4_1, embd_type=GGMLType.Q8_0, output_type=None)

# float16 scale fields of a block: (byte offset, low, high) of |value|, chosen so that decoded weights are about
# 1/sqrt(fan-in) in size and every activation stays finite; a negative `low` marks a field that holds a (negative)
# minimum, set to about -8 times the block's scale so the weights centre on zero (Q4_1: w = d·q + m, q in 0..15)
F16_FIELDS = {
    GGMLType.Q4_K: ((0, 1e-5, 3e-5), (2, 1e-5, 3e-5)),  # d·sc·q − dmin·m, 6-bit sc and m, 4-bit q
    GGMLType.Q6_K: ((208, 4e-5, 1.2e-4),),  # signed scales, centred codes
    GGMLType.Q5_K: ((0, 1e-5, 3e-5), (2, 1e-5, 3e-5)),  # as Q4_K, 5-bit q
    GGMLType.Q4_0: ((0, 2e-3, 6e-3),),  # centred codes -8..7
    GGMLType.Q4_1: ((0, 1e-3, 3e-3), (2, -8.0, None)),
    GGMLType.Q5_0: ((0, 2e-3, 6e-3),),  # centred codes -16..15
    GGMLType.Q5_1: ((0, 1e-3, 3e-3), (2, -16.0, None)),
    GGMLType.Q8_0: ((0, 5e-5, 2e-4),),  # signed codes
}


def random_blocks(ggml_type: GGMLType, n_rows: int, n_cols: int, rng, embedding: bool = False, device=None):
    """Valid random blocks: random bytes with the float16 scale fields set to small finite values.

    rng: a numpy Generator (the result is a numpy array), or, with `device`, a torch.Generator on that device
    (the result is a torch uint8 tensor built there: a GPU makes a 70B-shaped model's 40 GB in seconds, with no
    host memory and no file)."""
    block, size = GGML_BLOCK_SIZES[ggml_type]
    n_blocks = n_rows * n_cols // block
    if device is None:
        blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

        def uniform(low, high):
            return rng.uniform(low, high, n_blocks)

        def put(offset, value):
            blocks[:, offset:offset + 2] = value.astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    else:
        import torch

        blocks = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, device=device, generator=rng)

        def uniform(low, high):
            return torch.empty(n_blocks, dtype=torch.float64, device=device).uniform_(low, high, generator=rng)

        def put(offset, value):
            blocks[:, offset:offset + 2] = value.to(torch.float16).view(torch.uint8).view(n_blocks, 2)
    scale = None
    for offset, low, high in F16_FIELDS[ggml_type]:
        if high is None:  # a minimum: `low` times the block's scale
            value = low * scale * uniform(0.9, 1.1)
        else:
            value = uniform(low, high) * (5.0 if embedding else 1.0)
            scale = value
        put(offset, value)
    return blocks


def llama_metadata(shape: dict) -> list:
    """(key, value, ValueType) of a llama-architecture model of `shape` (see SHAPE_7B)."""
    s, u32, f32 = shape, ValueType.UINT32, ValueType.FLOAT32
    return [
        ("general.architecture", "llama", ValueType.STRING), ("general.name", "synthetic", ValueType.STRING),
        ("llama.context_length", 4096, u32), ("llama.embedding_length", s["n_embd"], u32),
        ("llama.block_count", s["n_layer"], u32), ("llama.feed_forward_length", s["n_ff"], u32),
        ("llama.attention.head_count", s["n_head"], u32), ("llama.attention.head_count_kv", s["n_head_kv"], u32),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, f32), ("llama.rope.freq_base", s["rope_base"], f32),
        ("llama.rope.dimension_count", s["n_embd"] // s["n_head"], u32), ("llama.vocab_size", s["n_vocab"], u32),
    ]


def llama_tensors(shape: dict) -> list:
    """(name, GGML type, shape, is the embedding) of every tensor, in file order; F32 tensors are norms (ones)."""
    s = shape
    d, ff, kv = s["n_embd"], s["n_ff"], s["n_embd"] // s["n_head"] * s["n_head_kv"]
    t = s["matrix_type"]
    out = [("token_embd.weight", s["embd_type"], (s["n_vocab"], d), True)]
    for il in range(s["n_layer"]):
        p = f"blk.{il}."
        out += [(p + "attn_norm.weight", GGMLType.F32, (d,), False), (p + "attn_q.weight", t, (d, d), False),
                (p + "attn_k.weight", t, (kv, d), False), (p + "attn_v.weight", t, (kv, d), False),
                (p + "attn_output.weight", t, (d, d), False), (p + "ffn_norm.weight", GGMLType.F32, (d,), False),
                (p + "ffn_gate.weight", t, (ff, d), False), (p + "ffn_up.weight", t, (ff, d), False),
                (p + "ffn_down.weight", t, (d, ff), False)]
    out.append(("output_norm.weight", GGMLType.F32, (d,), False))
    if s["output_type"] is not None:
        out.append(("output.weight", s["output_type"], (s["n_vocab"], d), False))
    return out


def write_synthetic_llama(path: Path, shape: dict, seed: int = 0) -> Path:
    """A llama-architecture GGUF of `shape` (see SHAPE_7B) with random valid blocks, written tensor by tensor."""
    rng = np.random.default_rng(seed)
    with GGUFWriter(path) as w:
        for key, value, vtype in llama_metadata(shape):
            w.add_field(key, value, vtype)
        for name, t, dims, embedding in llama_tensors(shape):
            if t == GGMLType.F32:
                w.add_tensor(name, np.ones(dims[0], dtype=np.float32), GGMLType.F32, dims)
            else:
                w.add_tensor(name, random_blocks(t, dims[0], dims[1], rng, embedding), t, dims)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps (each is timed)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--model", type=Path, help="reuse this synthetic model instead of writing one")
    ap.add_argument("--keep", action="store_true", help="keep the written model (its path is printed)")
    ap.add_argument("--append", type=Path, help="append the results to this markdown file")
    args = ap.parse_args()

    import torch

    from juno_py.lora import attach
    from juno_py.metrics import MetricsRecorder, peak_rss_bytes
    from juno_py.models import load_model
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train
    from juno_py.train.setup import resolve_compute_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="juno-7b-"))
    path = args.model
    if path is None:
        t0 = time.perf_counter()
        path = write_synthetic_llama(folder / "synthetic-7b-q4_k.gguf", SHAPE_7B)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    size_gib = path.stat().st_size / 2**30
    try:
        compute = resolve_compute_dtype(args.compute_dtype)
        model = load_model(path, compute_dtype=compute)
        adapters = attach(model, "qv", rank=8, alpha=16)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, SHAPE_7B["n_vocab"], (args.batch * args.steps, args.seq), generator=g)
        examples = [Example(row.tolist(), [True] * args.seq) for row in ids]
        cfg = TrainConfig(lr=1e-4, batch_size=args.batch, max_steps=args.steps, epochs=None, schedule="constant",
                          grad_checkpoint=True, max_seq_len=args.seq)
        rec = MetricsRecorder()
        t0 = time.time()
        train(model, adapters, examples, cfg, recorder=rec, progress=True, log=lambda m: print(m, file=sys.stderr))
        steps = [e for e in rec.events if e.kind == "train_step"]
        stamps = [t0] + [e.time for e in steps]
        times = [b - a for a, b in zip(stamps, stamps[1:])]
        peak = peak_rss_bytes() / 2**30
    finally:
        if args.model is None and not args.keep:
            for f in folder.iterdir():
                f.unlink()
            folder.rmdir()
        elif args.model is None:
            print(f"kept {path}", file=sys.stderr)

    lines = ["| step | seconds | loss | forward ms | backward ms | optimizer ms |", "|---|---|---|---|---|---|"]
    for i, (e, t) in enumerate(zip(steps, times), 1):
        v = e.values
        lines.append(f"| {i} | {t:.1f} | {v['loss']:.3f} | {v['forward_ms']:.0f} | {v['backward_ms']:.0f} | "
                     f"{v['optimizer_ms']:.0f} |")
    lines += ["", f"Peak RSS {peak:.2f} GiB (ru_maxrss, memory-mapped GGUF pages included; target < 12 GiB). "
                  f"Synthetic Llama-7B shape (32 layers, 4096 hidden, 11008 MLP, vocab 32000), Q4_K (Q6_K output), "
                  f"{size_gib:.1f} GiB file; LoRA r=8 on q,v; "
                  f"{args.batch} x {args.seq} tokens per step; activation checkpointing; compute "
                  f"{str(compute).removeprefix('torch.')}; {torch.get_num_threads()} torch threads, "
                  f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
                  f"{os.getloadavg()[0]:.1f} at the end."]
    text = "\n".join(lines)
    print(text)
    if args.append:
        command = "python benchmarks/train_7b_synthetic.py " + " ".join(sys.argv[1:])
        with open(args.append, "a") as f:
            f.write(f"\n## Training at 7B scale on CPU (synthetic Q4_K)\n\n`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
