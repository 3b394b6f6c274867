"""RoPE on the CPU: adjacent pairs ("norm", Llama's GGUF layout) rotated as one complex multiply (what
`juno_py.models.model.apply_rope` does for fp32/fp64) against the real formulas it replaced (`complex_pairs=False`:
six strided element-wise ops and a stack), forward and forward+backward, at SmolLM2-135M's shapes for a batch of
8 × 64 tokens (q: 9 heads, k: 3 heads, head_dim 64). Median ms over `--reps` calls; and whether the two give the
same bits. `--model-ab N`: also N pairs of SmolLM2-135M forward+backward passes (fp32, LoRA r 8 on q and v, the
blocks without the loss head), one with each form in turn (the order alternating), through the model's own
`apply_rope`: the median of the paired differences.

    python benchmarks/rope.py [--threads 2] [--reps 50] [--model-ab 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from juno_py.models.model import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--model-ab", type=int, default=0, metavar="N", help="also N paired SmolLM2 fwd+bwd passes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| tensor | dtype | real formulas fwd / fwd+bwd ms | complex fwd / fwd+bwd ms | speed-up fwd+bwd | same bits |")
    print("|---|---|---:|---:|---:|---|")
    B, T, D = 8, 64, 64
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T), rope_inv_freq(D, 100000.0))
    g = torch.Generator().manual_seed(0)
    for name, heads in (("q [8, 64, 9, 64]", 9), ("k [8, 64, 3, 64]", 3)):
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(B, T, heads, D, generator=g, dtype=dtype).requires_grad_(True)
            dy = torch.randn(B, T, heads, D, generator=g, dtype=dtype)
            c, s = cos.to(dtype), sin.to(dtype)
            row, results = [], []
            for complex_pairs in (False, True):
                fwd = median_ms(lambda: apply_rope(x, c, s, "norm", complex_pairs), args.reps)
                both = median_ms(lambda: apply_rope(x, c, s, "norm", complex_pairs).backward(dy), args.reps)
                x.grad = None
                y = apply_rope(x, c, s, "norm", complex_pairs)
                y.backward(dy)
                results.append((y.detach(), x.grad.clone()))
                x.grad = None
                row.append((fwd, both))
            same = torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {row[0][0]:.3f} / {row[0][1]:.3f} | "
                  f"{row[1][0]:.3f} / {row[1][1]:.3f} | {row[0][1] / row[1][1]:.2f}x | {'yes' if same else 'no'} |")
    if args.model_ab:
        model_ab(args.model_ab)


def model_ab(pairs: int) -> None:
    import juno_py.models.model as model_module
    from juno_py.lora import Mode, attach
    from juno_py.models import load_model
    from juno_py.store import resolve_model

    model = load_model(resolve_model("smollm2-135m"), compute_dtype="fp32", weights_cache="none")
    attach(model, "qv", rank=8, alpha=16, mode=Mode.LORA)
    ids = torch.randint(10, 20000, (8, 64), generator=torch.Generator().manual_seed(0))
    real, use_complex = model_module.apply_rope, [True]
    model_module.apply_rope = lambda x, c, s, style, complex_pairs=True: real(x, c, s, style, use_complex[0])

    def step() -> float:
        t0 = time.perf_counter()
        model.hidden_states(model.embed_tokens(ids)).square().mean().backward()
        return time.perf_counter() - t0

    try:
        step()
        times = {True: [], False: []}
        diffs = []
        for i in range(pairs):
            got = {}
            for form in ((True, False) if i % 2 == 0 else (False, True)):
                use_complex[0] = form
                got[form] = step()
                times[form].append(got[form])
            diffs.append(got[False] - got[True])
    finally:
        model_module.apply_rope = real
    print(f"\nSmolLM2-135M blocks, fp32, LoRA r 8 on q,v, 8 × 64 tokens, forward+backward, {pairs} pairs: complex "
          f"{statistics.median(times[True]):.3f} s, real formulas {statistics.median(times[False]):.3f} s (medians); "
          f"paired difference (real − complex) median {1e3 * statistics.median(diffs):.1f} ms")


if __name__ == "__main__":
    main()
