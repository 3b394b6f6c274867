"""DoRA's composition with the adapter's product inside the kernel (`compose_forward_xa`: y = g·(base + s·xa·Bᵀ),
and inner when m trains) against the two-step path it replaces in the bf16 training step and in inference (the
GEMM lora = xa·Bᵀ, written to memory, then `compose_forward` reading it back), at the layer shapes of
benchmarks.dora_layer (tokens T, d_out, rank r), bf16. Also the traffic bound: what a copy of the bytes the fused
kernel must move (base in; y, and inner, out) takes in the same run.

GPU µs: 20 calls captured as one CUDA graph, replayed `--reps` times, median per call (no launch costs). CPU µs:
the time to issue one call. `--sweep` adds other tiles of the fused kernel (rows with inner). Errors:
max |y − y_fp64| / max |y_fp64|.

    python -m benchmarks.compose_xa_sweep [--reps 15] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks import harness
from juno_py.kernels import dora_triton as dt

BATCH = 20
cpu_us = harness.host_us

SHAPES = [(4096, 8192, 384), (4096, 8192, 768), (8192, 4096, 16), (8192, 4096, 64), (8192, 4096, 384)]
S = 2.0


def gpu_us(fn, reps):
    """Median GPU µs per call of fn, from a CUDA graph of BATCH calls."""
    return harness.graphed_ms(lambda: [fn() for _ in range(BATCH)], reps, warmup=2) * 1e3 / BATCH


def data(T, n, r, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    base = (torch.randn(T, n, generator=g)).to(dev, torch.bfloat16)
    xa = torch.randn(T, r, generator=g).to(dev, torch.bfloat16)
    B = (torch.randn(n, r, generator=g) * 0.3 / r**0.5).to(dev, torch.bfloat16)
    gg = (1 + 1.5e-3 * torch.randn(n, generator=g)).to(dev)
    return base, xa, B, gg


def max_err(y, base, xa, B, g):
    ref = g.double() * (base.double() + S * (xa.double() @ B.double().T))
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    configs = [dt.COMPOSE_XA_CONFIG]
    if args.sweep:
        configs += [
            c
            for c in (
                dt.ComposeXaConfig(bm, bn, bk, w, st)
                for bm, bn, bk, w, st in itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4))
            )
            if c != dt.COMPOSE_XA_CONFIG and c.block_m * c.block_n <= 128 * 128
        ]
    print(
        "| T, d_out, r | inner | two-step GPU µs | CPU µs | fused GPU µs | CPU µs | fused / two-step | copy of the "
        "fused kernel's bytes µs | errors (two-step / fused) | best tile |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for (T, n, r), inner in itertools.product(SHAPES, (True, False)):
        base, xa, B, g = data(T, n, r, dev)

        def two_step():
            return dt.compose_forward(base, torch.mm(xa, B.T), g, S, write_inner=inner)[0]

        def fused(cfg=dt.COMPOSE_XA_CONFIG):
            return dt.compose_forward_xa(base, xa, B, g, S, write_inner=inner, cfg=cfg)[0]

        errs = (max_err(two_step(), base, xa, B, g), max_err(fused(), base, xa, B, g))
        t2, c2 = gpu_us(two_step, args.reps), cpu_us(two_step)
        tf, cf = gpu_us(fused, args.reps), cpu_us(fused)
        # the fused kernel reads base (T·n bf16) and writes y (and inner): a copy of (1 + outputs)/2 · T·n elements
        # moves as many bytes
        k = (1 + (2 if inner else 1)) * T * n // 2
        src, dst = torch.empty(k, dtype=torch.bfloat16, device=dev), torch.empty(k, dtype=torch.bfloat16, device=dev)
        tc = gpu_us(lambda: dst.copy_(src), args.reps)
        best = ""
        if args.sweep and inner:  # the training step's form
            times = []
            for c in configs:
                try:
                    times.append((gpu_us(lambda c=c: fused(c), args.reps), c))
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory)
                    print(f"  {c}: {type(e).__name__}", file=sys.stderr)
            t_best, c_best = min(times, key=lambda p: p[0])
            best = (
                f"{t_best:.1f} µs at {c_best.block_m}×{c_best.block_n}×{c_best.block_k}, {c_best.num_warps} "
                f"warps, {c_best.num_stages} stages"
            )
        print(
            f"| {T}, {n}, {r} | {'yes' if inner else 'no'} | {t2:.1f} | {c2:.0f} | {tf:.1f} | {cf:.0f} | "
            f"{tf / t2:.2f} | {tc:.1f} | {errs[0]:.1e} / {errs[1]:.1e} | {best} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
