"""DoRA's factored row norm on the GPU, the part after U: V = B·G and the row sums, at the layer shapes of
benchmarks.dora_layer. Compared in the same run, each against fp64:

- the fused row kernel `norm_rows_gram` (V in 3×TF32 dots, a grid of row tiles × rank tiles) at its default tile,
  and with `--sweep` at other tiles;
- the GEMM path: V on bf16 tensor cores at fp32 accuracy in one GEMM of the split operands (`mm_bf16x3`), then the
  row kernel `norm_rows`.

GPU µs: 20 calls captured as one CUDA graph, replayed `--reps` times, median per call (no launch costs). CPU µs:
the time to issue one call (the H200's host spends 10 to 30 µs a launch).

    python -m benchmarks.norm_gram_sweep [--reps 15] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks import harness
from juno_py.kernels import dora as ad
from juno_py.kernels import dora_triton as dt
from juno_py.kernels import split_bf16
from juno_py.kernels.dora import norm_rows

SHAPES = [
    (8192, 384, 8192),
    (8192, 768, 8192),
    (4096, 16, 4096),
    (4096, 64, 4096),
    (4096, 384, 4096),
]  # (rows n = d_out, rank r, d_in)
BATCH = 20


def gpu_us(fn, reps):
    """Median GPU µs per call of fn, from a CUDA graph of BATCH calls."""
    return harness.graphed_ms(lambda: [fn() for _ in range(BATCH)], reps, warmup=2) * 1e3 / BATCH


def data(n, r, d_in, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    W = torch.randn(n, d_in, generator=g) * 0.02
    A = (torch.rand(r, d_in, generator=g) * 2 - 1) / d_in**0.5
    B = torch.randn(n, r, generator=g) * (0.3 * 0.02 * (d_in * 3 / r) ** 0.5)
    s = 2.0
    ref = (W.double() + s * (B.double() @ A.double())).norm(dim=1)
    A = A.to(dev)
    split = r * r * d_in >= ad.SPLIT_GRAM_MIN_FMAS
    X = split_bf16(A)
    # the kernel takes the half Gram matrix [A_hi; A_lo]·A_hiᵀ
    G = torch.mm(X, X[:r].T, out_dtype=torch.float32) if split else A @ A.T
    U = (W.to(dev) @ A.T).contiguous()
    base_sq = W.double().pow(2).sum(1).float().to(dev)
    return dict(base_sq=base_sq, B=B.to(dev), U=U, G=G, s=s, split=split, ref=ref.to(dev), r=r, n=n)


def rel_err(out, d):
    return ((out.double() - d["ref"]).abs() / d["ref"]).max().item()


def gemm_path(d):
    """What factored_row_norm runs above NORM_GEMM_MIN_FMAS, after the split A's half Gram matrix."""
    G = ad.gram_of_half(d["G"]) if d["split"] else d["G"]
    return norm_rows(d["base_sq"], d["B"], d["U"], ad.mm_bf16x3(d["B"], G), d["s"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sweep", action="store_true", help="also sweep the fused kernel's tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    env = harness.environment("cuda")
    print(env["hardware"], env["software"])
    print("\n| n, r | kernel GPU µs | CPU µs | GEMM path GPU µs | CPU µs | errors vs fp64 (kernel / GEMM) |")
    print("|---|---:|---:|---:|---:|---|")
    for n, r, d_in in SHAPES:
        d = data(n, r, d_in, dev)
        kern = lambda cfg=dt.NORM_GRAM_CONFIG: dt.norm_rows_gram(  # noqa: E731
            d["base_sq"], d["B"], d["U"], d["G"], d["s"], split=d["split"], cfg=cfg
        )
        print(
            f"| {n}, {r} | {gpu_us(kern, args.reps):.1f} | {harness.host_us(kern):.1f} | "
            f"{gpu_us(lambda: gemm_path(d), args.reps):.1f} | {harness.host_us(lambda: gemm_path(d)):.1f} | "
            f"{rel_err(kern(), d):.2e} / {rel_err(gemm_path(d), d):.2e} |",
            flush=True,
        )
        if args.sweep and r > 64:
            rows = []
            for bd, br, bk, w, st in itertools.product((64, 128), (32, 64), (32, 64), (4, 8), (3,)):
                cfg = dt.NormGramConfig(bd, br, bk, w, st)
                try:
                    t = gpu_us(lambda: kern(cfg), max(5, args.reps // 3))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory)
                    print(f"  {cfg}: {type(exc).__name__}")
                    continue
                rows.append((t, cfg, rel_err(kern(cfg), d)))
            for t, cfg, e in sorted(rows, key=lambda x: x[0])[:6]:
                print(f"  sweep: {t:7.1f} µs  {cfg} err {e:.2e}", flush=True)
        d = None  # freed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
