"""Training at 7B scale on a small machine: one LoRA step (q,v, rank 8, 4 x 128 tokens, activation
checkpointing) on a synthetic Llama-7B-shaped Q4_K model; seconds per step and peak RSS; then greedy decoding with
the trained adapter, as `juno-py local` plays it back (the native decoder), in tokens/s.

The model (32 layers, hidden 4096, MLP 11008, 32 heads, vocab 32000; Q4_K everywhere, Q6_K output, F32 norms:
about 3.9 GB) is written once into a temporary file (`juno_py.testing.synthetic.write_synthetic_llama`) from
random bytes whose float16 scale fields are set to small finite values, so every block is valid and activations
stay finite. The base stays quantized and memory-mapped: no dequantized copy of the weights ever exists.

    python -m benchmarks.train_7b_synthetic      # writes the model, trains: table, results/cpu-training-7b.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from juno_py.testing.synthetic import SHAPE_7B, write_synthetic_llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps (each is timed)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=0, help="threads (0: the idle CPUs, as the commands choose them)")
    ap.add_argument("--model", type=Path, help="reuse this synthetic model instead of writing one")
    ap.add_argument("--keep", action="store_true", help="keep the written model (its path is printed)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens decoded with the adapter (0: none)")
    harness.add_output_args(ap)
    args = ap.parse_args()

    import torch

    from juno_py import threads
    from juno_py.lora import attach
    from juno_py.metrics import MetricsRecorder, peak_rss_bytes
    from juno_py.models import load_model
    from juno_py.precision import resolve_compute_dtype
    from juno_py.train.data import Example
    from juno_py.train.loop import TrainConfig, train

    # as the commands choose them: torch's and the native products' threads, from the idle CPUs unless given
    threads.setup(args.threads or None)
    folder = Path(tempfile.mkdtemp(prefix="juno-7b-"))
    path = args.model
    if path is None:
        t0 = time.perf_counter()
        path = write_synthetic_llama(folder / "synthetic-7b-q4_k.gguf", SHAPE_7B)
        print(
            f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr
        )
    size_gib = path.stat().st_size / 2**30
    try:
        compute = resolve_compute_dtype(args.compute_dtype)
        model = load_model(path, compute_dtype=compute)
        adapters = attach(model, "qv", rank=8, alpha=16)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, SHAPE_7B["n_vocab"], (args.batch * args.steps, args.seq), generator=g)
        examples = [Example(row.tolist(), [True] * args.seq) for row in ids]
        cfg = TrainConfig(
            lr=1e-4,
            batch_size=args.batch,
            max_steps=args.steps,
            epochs=None,
            schedule="constant",
            grad_checkpoint=True,
            max_seq_len=args.seq,
        )
        rec = MetricsRecorder()
        t0 = time.time()
        train(model, adapters, examples, cfg, recorder=rec, progress=True, log=lambda m: print(m, file=sys.stderr))
        steps = [e for e in rec.events if e.kind == "train_step"]
        stamps = [t0] + [e.time for e in steps]
        times = [b - a for a, b in zip(stamps, stamps[1:])]
        peak = peak_rss_bytes() / 2**30
        decode_tok_s = None
        if args.decode_tokens:
            from benchmarks.decode_cpu import decode_seconds

            model.eval()
            prompt = ids[0, :8].tolist()
            decode_tok_s = args.decode_tokens / decode_seconds(model, prompt, args.decode_tokens, native_path=True)
            print(f"decode with the adapter: {decode_tok_s:.2f} tokens/s", file=sys.stderr)
    finally:
        if args.model is None and not args.keep:
            for f in folder.iterdir():
                f.unlink()
            folder.rmdir()
        elif args.model is None:
            print(f"kept {path}", file=sys.stderr)

    columns = ["step", "seconds", "loss", "forward ms", "backward ms", "optimizer ms"]
    rows = [
        [
            i,
            round(t, 1),
            round(e.values["loss"], 3),
            round(e.values["forward_ms"]),
            round(e.values["backward_ms"]),
            round(e.values["optimizer_ms"]),
        ]
        for i, (e, t) in enumerate(zip(steps, times), 1)
    ]
    notes = [
        f"Peak RSS {peak:.2f} GiB (ru_maxrss, memory-mapped GGUF pages included; target < 12 GiB).",
        f"Synthetic Llama-7B shape (32 layers, 4096 hidden, 11008 MLP, vocab 32000), Q4_K (Q6_K output), "
        f"{size_gib:.1f} GiB file; LoRA r=8 on q,v; {args.batch} x {args.seq} tokens per step; activation "
        f"checkpointing; compute {str(compute).removeprefix('torch.')}; {torch.get_num_threads()} threads.",
    ]
    if decode_tok_s is not None:
        notes.insert(
            0,
            f"Decode with the trained adapter: {decode_tok_s:.2f} tokens/s ({args.decode_tokens} greedy tokens after an "
            f"8-token prompt, prefill not counted; the native decoder, products straight from the Q4_K bytes; "
            f"target >= 1).",
        )
    record = harness.results(
        "cpu-training-7b",
        "Training at 7B scale on CPU (synthetic Q4_K)",
        harness.command_line("benchmarks.train_7b_synthetic"),
        columns,
        rows,
        notes,
    )
    print(harness.markdown_table(columns, rows))
    print("\n".join(notes))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
