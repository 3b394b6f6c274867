"""A decoder block's elementwise ops on the GPU at Llama-3-8B training shapes: the fused Triton kernels
(`kernels.elementwise`) against the model's eager torch code, forward alone and forward + backward, in the same run.

    python -m benchmarks.elementwise_gpu [--batch 8] [--seq 512] [--reps 50]

bf16 activations as juno-py trains on a GPU (norm weights fp32, norms computed in fp32): RMSNorm over
`[tokens, 4096]`, SwiGLU over `[tokens, 14336]`, RoPE ("norm" pairs, bf16 tables) on q `[B, T, 32, 128]` and k
`[B, T, 8, 128]`. Both paths are the model's own (`RMSNorm`, `gated`, `rope_qk`), switched by JUNO_PY_KERNELS.
CUDA events, median of the calls; the input gradients are cleared before each call (not timed). The last column
scales the saving to one training step: 32 blocks, each two norms, one gated activation and one RoPE.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks import harness
from juno_py.models.model import RMSNorm, gated, rope_cos_sin, rope_inv_freq, rope_qk

N_EMBD, N_FF, N_HEAD, N_HEAD_KV, HEAD_DIM, N_LAYER = 4096, 14336, 32, 8, 128, 32
PER_BLOCK = {"rmsnorm": 2, "swiglu": 1, "rope q+k": 1}


def in_mode(mode: str, fn):
    """`fn` with JUNO_PY_KERNELS=mode (read by the dispatch at each call)."""

    def call():
        os.environ["JUNO_PY_KERNELS"] = mode
        return fn()

    return call


def leaves(*shapes_dtypes, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(s, generator=gen, device="cuda", dtype=torch.float32).to(d).requires_grad_(True)
        for s, d in shapes_dtypes
    ]


def cases(b: int, t: int):
    """name -> (forward of the inputs, inputs, output gradients)."""
    bf = torch.bfloat16
    n = b * t
    norm = RMSNorm(torch.randn(N_EMBD) * 0.1 + 1.0, 1e-5).cuda()
    norm.out_dtype = bf
    (x,) = leaves(((n, N_EMBD), bf), seed=1)
    gate, up = leaves(((n, N_FF), bf), ((n, N_FF), bf), seed=2)
    q, k = leaves(((b, t, N_HEAD, HEAD_DIM), bf), ((b, t, N_HEAD_KV, HEAD_DIM), bf), seed=3)
    positions = torch.arange(t, device="cuda").expand(b, t)
    rope = rope_cos_sin(positions, rope_inv_freq(HEAD_DIM, 500000.0).cuda(), 1.0, bf)
    gen = torch.Generator(device="cuda").manual_seed(4)

    def grad_like(a):
        return torch.randn(a.shape, generator=gen, device="cuda").to(a.dtype)

    return {
        "rmsnorm": (lambda: (norm(x),), [x], [grad_like(x)]),
        "swiglu": (lambda: (gated(F.silu, gate, up),), [gate, up], [grad_like(gate)]),
        "rope q+k": (lambda: rope_qk(q, k, rope, "norm"), [q, k], [grad_like(q), grad_like(k)]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    harness.add_output_args(ap)
    args = ap.parse_args()
    saved_mode = os.environ.get("JUNO_PY_KERNELS")
    columns = [
        "op",
        "shape",
        "eager fwd ms",
        "fused fwd ms",
        "fwd ratio",
        "eager fwd+bwd ms",
        "fused fwd+bwd ms",
        "fwd+bwd ratio",
        "step saving ms",
    ]
    rows = []
    total = 0.0
    shapes = {
        "rmsnorm": f"{args.batch * args.seq} x {N_EMBD}",
        "swiglu": f"{args.batch * args.seq} x {N_FF}",
        "rope q+k": f"{args.batch}x{args.seq} x ({N_HEAD}+{N_HEAD_KV}) x {HEAD_DIM}",
    }
    try:
        for name, (fwd, inputs, grads) in cases(args.batch, args.seq).items():

            def clear(inputs=inputs):
                for a in inputs:
                    a.grad = None

            def step(fwd=fwd, grads=grads):
                torch.autograd.backward(fwd(), grads)

            def forward(fwd=fwd):
                with torch.no_grad():
                    fwd()

            ms = {}
            for mode in ("eager", "fused"):
                ms[mode, "fwd"] = harness.event_ms(in_mode(mode, forward), args.reps, warmup=5)
                ms[mode, "step"] = harness.event_ms(in_mode(mode, step), args.reps, warmup=5, setup=clear)
            saving = N_LAYER * PER_BLOCK[name] * (ms["eager", "step"] - ms["fused", "step"])
            total += saving
            rows.append(
                [
                    name,
                    shapes[name],
                    round(ms["eager", "fwd"], 3),
                    round(ms["fused", "fwd"], 3),
                    f"{ms['eager', 'fwd'] / ms['fused', 'fwd']:.2f}x",
                    round(ms["eager", "step"], 3),
                    round(ms["fused", "step"], 3),
                    f"{ms['eager', 'step'] / ms['fused', 'step']:.2f}x",
                    round(saving, 1),
                ]
            )
    finally:
        if saved_mode is None:
            os.environ.pop("JUNO_PY_KERNELS", None)
        else:
            os.environ["JUNO_PY_KERNELS"] = saved_mode
    rows.append(["all", "per 8B step", "", "", "", "", "", "", round(total, 1)])
    record = harness.results(
        "elementwise-gpu",
        "A block's fused elementwise kernels against eager torch on one GPU",
        harness.command_line("benchmarks.elementwise_gpu"),
        columns,
        rows,
        [
            "CUDA events, median of the calls; bf16 activations, fp32 norm weights and arithmetic.",
            "step saving: (eager − fused) fwd+bwd × the op's calls in 32 blocks (two norms, one SwiGLU, one RoPE).",
        ],
        device="cuda",
    )
    print(harness.markdown_table(columns, rows))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
