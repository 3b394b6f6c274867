"""The loss chunk's softmax-minus-onehot on the GPU: the fused Triton kernel (`kernels.cross_entropy_grad_`) against
its eager torch reference and a copy of the logits, in the same run.

    python benchmarks/cross_entropy_gpu.py [--rows 1046] [--vocab 128256] [--reps 20]

One chunk of the training loss as juno-py runs it on a Llama-3-sized vocabulary (1046 positions is what
`loop.LOGITS_BYTES_GPU` gives there): bf16 logits, every fourth row ignored, gradient written in place. CUDA events
around each call; the logits are restored before every call (not timed). Bandwidth counts what the kernel must
move: the logits read twice and the gradient written once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from juno_py.kernels import cross_entropy_grad_  # noqa: E402
from juno_py.kernels.reference import cross_entropy_grad_eager  # noqa: E402


def timed(fn, z, work, reps: int) -> float:
    for _ in range(3):
        work.copy_(z)
        fn()
    out = []
    for _ in range(reps):
        work.copy_(z)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1046)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(args.rows, args.vocab, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.rows,), generator=gen, device="cuda")
    t[::4] = -100
    work = z.clone()
    ms = {"copy": timed(lambda: work.clone(), z, work, args.reps),
          "eager": timed(lambda: cross_entropy_grad_eager(work, t, -100, in_place=True), z, work, args.reps),
          "fused": timed(lambda: cross_entropy_grad_(work, t, -100, in_place=True), z, work, args.reps)}
    nbytes = z.numel() * z.element_size()
    print(f"loss chunk {args.rows} x {args.vocab} bf16 on {torch.cuda.get_device_name()}: "
          f"copy {ms['copy']:.3f} ms ({2 * nbytes / ms['copy'] / 1e6:.0f} GB/s), eager {ms['eager']:.3f} ms, "
          f"fused {ms['fused']:.3f} ms ({ms['eager'] / ms['fused']:.1f}x eager; "
          f"{3 * nbytes / ms['fused'] / 1e6:.0f} GB/s)")


if __name__ == "__main__":
    main()
