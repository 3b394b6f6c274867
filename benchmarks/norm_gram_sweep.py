"""DoRA's factored row norm on the GPU, the part after U: V = B·G and the row sums, at the layer shapes of
benchmarks/dora_layer.py. Compared in the same run, each against fp64:

- the fused row kernel `norm_rows_gram` (V in 3×TF32 dots, a grid of row tiles × rank tiles) at its default tile,
  and with `--sweep` at other tiles;
- a one-dimensional kernel (one program per row tile, looping over every rank tile pair), kept here for comparison;
- the GEMM path: V on bf16 tensor cores at fp32 accuracy in one GEMM of the split operands (`mm_bf16x3`), then the
  row kernel `norm_rows`.

GPU µs: 20 calls captured as one CUDA graph, replayed `--reps` times, median per call (no launch costs). CPU µs:
the time to issue one call (the H200's host spends 10 to 30 µs a launch).

    python benchmarks/norm_gram_sweep.py [--reps 15] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dora_layer as dl  # noqa: E402

from juno_py.kernels import dora_triton as dt  # noqa: E402
from juno_py.kernels import dora as ad  # noqa: E402
from juno_py.kernels import split_bf16  # noqa: E402
from juno_py.kernels.dora import norm_rows  # noqa: E402

SHAPES = [(8192, 384, 8192), (8192, 768, 8192), (4096, 16, 4096), (4096, 64, 4096),
          (4096, 384, 4096)]  # (rows n = d_out, rank r, d_in)
BATCH = 20


def gpu_us(fn, reps):
    """Median GPU µs per call of fn, from a CUDA graph of BATCH calls (dora_layer.graphed_ms)."""
    return dl.graphed_ms(lambda: [fn() for _ in range(BATCH)], reps, warmup=2) * 1e3 / BATCH


def cpu_us(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = (time.perf_counter() - t0) * 1e6 / reps
    torch.cuda.synchronize()
    return t


def data(n, r, d_in, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    W = torch.randn(n, d_in, generator=g) * 0.02
    A = (torch.rand(r, d_in, generator=g) * 2 - 1) / d_in ** 0.5
    B = torch.randn(n, r, generator=g) * (0.3 * 0.02 * (d_in * 3 / r) ** 0.5)
    s = 2.0
    ref = (W.double() + s * (B.double() @ A.double())).norm(dim=1)
    A = A.to(dev)
    split = r * r * d_in >= ad.SPLIT_GRAM_MIN_FMAS
    X = split_bf16(A)
    # the product's kernel takes the half Gram matrix [A_hi; A_lo]·A_hiᵀ, the one-dimensional one the full one of
    # [A_hi; A_lo]
    G = torch.mm(X, X[:r].T, out_dtype=torch.float32) if split else A @ A.T
    G_full = torch.mm(X, X.T, out_dtype=torch.float32) if split else G
    U = (W.to(dev) @ A.T).contiguous()
    base_sq = W.double().pow(2).sum(1).float().to(dev)
    return dict(base_sq=base_sq, B=B.to(dev), U=U, G=G, G_full=G_full, s=s, split=split, ref=ref.to(dev), r=r, n=n)


def rel_err(out, d):
    return ((out.double() - d["ref"]).abs() / d["ref"]).max().item()


@triton.jit
def _one_dim_kernel(base_sq_ptr, b_ptr, u_ptr, g_ptr, out_ptr, n, r, sb0, sb1, su0, su1, sg0, sg1, two_s, s_sq,
                     eps, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, R_TILES: tl.constexpr):
    """A one-dimensional `norm_rows_gram` kernel, for the comparison column: one program per row tile, every (j, k)
    tile pair."""
    rows = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < n
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_D, BLOCK_R], dtype=tl.float32)
    for j in range(R_TILES):
        cj = j * BLOCK_R + tl.arange(0, BLOCK_R)
        cj_ok = cj < r
        cj64 = cj.to(tl.int64)
        v = tl.zeros([BLOCK_D, BLOCK_R], dtype=tl.float32)
        for k in range(R_TILES):
            ck = k * BLOCK_R + tl.arange(0, BLOCK_R)
            ck_ok = ck < r
            ck64 = ck.to(tl.int64)
            b_k = tl.load(b_ptr + rows64[:, None] * sb0 + ck64[None, :] * sb1,
                          mask=row_ok[:, None] & ck_ok[None, :], other=0.0).to(tl.float32)
            g_mask = ck_ok[:, None] & cj_ok[None, :]
            g_offs = ck64[:, None] * sg0 + cj64[None, :] * sg1
            g = tl.load(g_ptr + g_offs, mask=g_mask, other=0.0)
            if SPLIT:
                g += tl.load(g_ptr + g_offs + r * sg0, mask=g_mask, other=0.0)
                g += tl.load(g_ptr + g_offs + r * sg1, mask=g_mask, other=0.0)
                g += tl.load(g_ptr + g_offs + r * (sg0 + sg1), mask=g_mask, other=0.0)
            v = tl.dot(b_k, g, acc=v, input_precision="tf32x3")
        mask = row_ok[:, None] & cj_ok[None, :]
        b = tl.load(b_ptr + rows64[:, None] * sb0 + cj64[None, :] * sb1, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows64[:, None] * su0 + cj64[None, :] * su1, mask=mask, other=0.0).to(tl.float32)
        acc += b * (two_s * u + s_sq * v)
    dt._store_norm(base_sq_ptr, out_ptr, rows, row_ok, acc, eps)


def one_dim(d, out):
    B, U, G = d["B"], d["U"], d["G_full"]
    n, r = B.shape
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    block_d = max(16, min(64, triton.next_power_of_2(n)))
    dt._launch(_one_dim_kernel, (triton.cdiv(n, block_d),), (
        d["base_sq"], B, U, G, out, n, r, *B.stride(), *U.stride(), *G.stride(), 2.0 * d["s"], d["s"] ** 2, 0.0),
        4, SPLIT=d["split"], BLOCK_D=block_d, BLOCK_R=block_r, R_TILES=triton.cdiv(r, block_r))


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
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("\n| n, r | kernel GPU µs | CPU µs | 1-D kernel GPU µs | GEMM path GPU µs | CPU µs "
          "| errors vs fp64 (kernel / 1-D kernel / GEMM) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for n, r, d_in in SHAPES:
        d = data(n, r, d_in, dev)
        out = torch.empty(n, dtype=torch.float32, device=dev)
        kern = lambda cfg=dt.NORM_GRAM_CONFIG: dt.norm_rows_gram(  # noqa: E731
            d["base_sq"], d["B"], d["U"], d["G"], d["s"], split=d["split"], cfg=cfg)
        e_old = (one_dim(d, out), rel_err(out, d))[1]
        print(f"| {n}, {r} | {gpu_us(kern, args.reps):.1f} | {cpu_us(kern):.1f} | "
              f"{gpu_us(lambda: one_dim(d, out), args.reps):.1f} | {gpu_us(lambda: gemm_path(d), args.reps):.1f} | "
              f"{cpu_us(lambda: gemm_path(d)):.1f} | "
              f"{rel_err(kern(), d):.2e} / {e_old:.2e} / {rel_err(gemm_path(d), d):.2e} |", flush=True)
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
        del d, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
