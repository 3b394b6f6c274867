"""GPU-resident frozen linear: the Triton dequantization kernel's bandwidth against a device copy, and the forward
`x·Wᵀ` at 1 to 4096 tokens through the fused dequantize-matvec, decode-then-cuBLAS tiles, and a resident bf16
copy (cuBLAS alone), in one run: where the matvec stops paying (MATVEC_MAX_TOKENS) and what decoding costs at
training token counts.

    python benchmarks/dequant_gpu.py            # tables on stdout (needs a CUDA GPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_7b_synthetic import random_blocks  # noqa: E402

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels.dequant import dequant_matvec, dequantize_tile  # noqa: E402
from juno_py.weights import FrozenQuantLinear  # noqa: E402


def bench(fn) -> float:
    """Median milliseconds (triton.testing.do_bench: CUDA events, L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_ms = bench(lambda: big.clone())
    copy_gbs = 2 * big.numel() / copy_ms / 1e6
    del big
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    print("| type | W | decode to bf16 ms | GB/s (bytes read + written) | of copy |")
    print("|---|---|---|---|---|")
    shapes = [(8192, 8192), (28672, 8192)]
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K,
              GGMLType.Q6_K):
        for n_out, n_in in shapes:
            raw = random_blocks(t, n_out, n_in, gen, device=dev).view(n_out, -1)
            out = torch.empty(n_out, n_in, dtype=torch.bfloat16, device=dev)
            ms = bench(lambda: dequantize_tile(raw, t, n_in, out=out))
            moved = raw.numel() + out.numel() * 2
            print(f"| {t.name} | {n_out}x{n_in} | {ms:.3f} | {moved / ms / 1e6:.0f} | "
                  f"{moved / ms / 1e6 / copy_gbs:.0%} |")
            del raw, out
    print("\n| type | W | tokens | fused matvec ms | decode + cuBLAS ms | bf16 cache (cuBLAS) ms |")
    print("|---|---|---|---|---|---|")
    for t in (GGMLType.Q4_K, GGMLType.Q8_0):
        for n_out, n_in in [(4096, 4096), (14336, 4096)]:
            raw = random_blocks(t, n_out, n_in, gen, device=dev).view(n_out, -1)
            lin = FrozenQuantLinear(raw, t, n_in, compute_dtype=torch.bfloat16)
            cached = FrozenQuantLinear(raw, t, n_in, compute_dtype=torch.bfloat16).set_weights_cache("bf16")
            for tokens in (1, 2, 4, 8, 16, 64, 4096):
                x = torch.randn(tokens, n_in, device=dev, dtype=torch.bfloat16)
                mv = bench(lambda: dequant_matvec(raw, t, n_in, x)) if tokens <= 64 else float("nan")
                step = lin._device_step(n_in, 2)

                def tiles():
                    for a in range(0, n_out, step):
                        w = lin.dequantize_rows(a, min(a + step, n_out), torch.bfloat16)
                        torch.mm(x, w.t())

                tl = bench(tiles)
                cb = bench(lambda: cached(x))
                print(f"| {t.name} | {n_out}x{n_in} | {tokens} | {mv:.3f} | {tl:.3f} | {cb:.3f} |")
            del raw, lin, cached


if __name__ == "__main__":
    main()
