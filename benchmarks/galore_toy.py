"""GaLore's toy problem: one 256x256 linear layer regressed onto a target of slowly decaying spectrum.

Target W* = U diag(σ) Vᵀ with σᵢ = i^(-1/2) and random orthogonal U, V; 8,192 Gaussian inputs x, outputs W* x;
batches of 256, mean-squared error, weights starting at zero; Adam betas 0.9/0.999 (no weight decay), GaLore
α = 0.25; error ‖W − W*‖²_F / ‖W*‖²_F after each run, best of learning rates 1e-3, 3e-3, 1e-2. Methods:

- `galore`: GaLore-AdamW (juno_py.train.galore) at rank 16, projector refreshed every 50 steps (full-rank
  trajectory from a low-rank state): expected below 1e-3 within 3,000 steps;
- `galore-frozen`: the same with the projector taken from the first gradient and never refreshed: it can only
  move W inside that 16-dimensional subspace and stalls near 0.5;
- `lora`: a trained rank-16 product B·A (B = 0, A Gaussian): stalls near the Eckart-Young floor
  Σ_{i>16} σᵢ² / Σ σᵢ² ≈ 0.448;
- `adamw`: full AdamW on W, for reference.

    python -m benchmarks.galore_toy          # the table on stdout and in benchmarks/results/galore-toy.json

The problem and its trainers are `juno_py.testing.galore_toy`.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import harness
from juno_py.testing.galore_toy import LRS, METHODS, best_of, eckart_young_floor, make_toy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--svd", default="exact", choices=["exact", "randomized"], help="GaLore's refresh")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (256x256 matmuls gain little from more; 0: torch's default)",
    )
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    toy = make_toy()
    rows = []
    for method in METHODS:
        t0 = time.perf_counter()
        lr, curve, finals = best_of(toy, method, args.steps, svd=args.svd)
        at = {s: e for s, e in curve}
        below = next((s for s, e in curve if e < 1e-3), None)
        rows.append(
            (method, lr, at.get(500), at.get(1000), at.get(2000), curve[-1][1], below, finals, time.perf_counter() - t0)
        )
        print(
            f"{method:14s} lr {lr:g}: final error {curve[-1][1]:.3e} ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )
    columns = [
        "method",
        "best lr",
        "error @500",
        "@1000",
        "@2000",
        f"@{args.steps} (final)",
        "first step below 1e-3",
        "final error at lr 1e-3 / 3e-3 / 1e-2",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
    table = [
        [
            method,
            f"{lr:g}",
            fmt(e500),
            fmt(e1000),
            fmt(e2000),
            f"{final:.2e}",
            below if below is not None else "never",
            " / ".join(f"{finals[k]:.2e}" for k in LRS),
        ]
        for method, lr, e500, e1000, e2000, final, below, finals, _ in rows
    ]
    note = (
        f"256x256 target, σᵢ = i^(-1/2), 8,192 Gaussian inputs, batch 256, MSE, W0 = 0, Adam 0.9/0.999, rank 16, "
        f"GaLore α = 0.25, gap 50 ({args.svd} SVD), {args.steps} steps; Eckart-Young floor at rank 16: "
        f"{eckart_young_floor():.4f}. Errors every 100 steps ‖W − W*‖²/‖W*‖²; {torch.get_num_threads()} torch "
        f"threads; {sum(r[-1] for r in rows):.0f} s in all."
    )
    print(harness.markdown_table(columns, table))
    print(note)
    harness.write_results(
        args,
        harness.results(
            "galore-toy",
            "GaLore's toy problem (CPU)",
            harness.command_line("benchmarks.galore_toy"),
            columns,
            table,
            [note],
        ),
    )


if __name__ == "__main__":
    main()
