"""The loss chunk's softmax-minus-onehot on the GPU: the fused Triton kernel (`kernels.cross_entropy_grad_`) against
its eager torch reference and a copy of the logits, in the same run.

    python -m benchmarks.cross_entropy_gpu [--rows 1046] [--vocab 128256] [--reps 20]

One chunk of the training loss as juno-py runs it on a Llama-3-sized vocabulary (1046 positions is what
`loop.LOGITS_BYTES_GPU` gives there): bf16 logits, every fourth row ignored, gradient written in place. CUDA events
around each call; the logits are restored before every call (not timed). Bandwidth counts what the kernel must
move: the logits read twice and the gradient written once.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import harness
from juno_py.kernels import cross_entropy_grad_
from juno_py.kernels.reference import cross_entropy_grad_eager


def timed(fn, z, work, reps: int) -> float:
    return harness.event_ms(fn, reps, warmup=3, setup=lambda: work.copy_(z))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1046)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=20)
    harness.add_output_args(ap)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(args.rows, args.vocab, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.rows,), generator=gen, device="cuda")
    t[::4] = -100
    work = z.clone()
    ms = {
        "copy": timed(lambda: work.clone(), z, work, args.reps),
        "eager": timed(lambda: cross_entropy_grad_eager(work, t, -100, in_place=True), z, work, args.reps),
        "fused": timed(lambda: cross_entropy_grad_(work, t, -100, in_place=True), z, work, args.reps),
    }
    nbytes = z.numel() * z.element_size()
    columns = ["loss chunk", "copy ms", "copy GB/s", "eager ms", "fused ms", "fused vs eager", "fused GB/s"]
    row = [
        f"{args.rows} x {args.vocab} bf16",
        round(ms["copy"], 3),
        round(2 * nbytes / ms["copy"] / 1e6),
        round(ms["eager"], 3),
        round(ms["fused"], 3),
        f"{ms['eager'] / ms['fused']:.1f}x",
        round(3 * nbytes / ms["fused"] / 1e6),
    ]
    record = harness.results(
        "cross-entropy",
        "The loss chunk's gradient kernel on one GPU",
        harness.command_line("benchmarks.cross_entropy_gpu"),
        columns,
        [row],
        ["CUDA events, median of the calls; bandwidth counts the logits read twice and the gradient written once."],
        device="cuda",
    )
    print(harness.markdown_table(columns, [row]))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
