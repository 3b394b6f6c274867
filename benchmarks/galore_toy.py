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

    python benchmarks/galore_toy.py                                # the table on stdout
    python benchmarks/galore_toy.py --append docs/benchmarks.md    # and appended there
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from juno_py.train.galore import GaLoreAdamW, GaLoreConfig  # noqa: E402

METHODS = ("galore", "galore-frozen", "lora", "adamw")
LRS = (1e-3, 3e-3, 1e-2)


@dataclass
class Toy:
    w_star: torch.Tensor  # [d, d]
    x: torch.Tensor  # [n, d]
    y: torch.Tensor  # [n, d]

    def error(self, w: torch.Tensor) -> float:
        return float((w - self.w_star).square().sum() / self.w_star.square().sum())


def make_toy(d: int = 256, n: int = 8192, seed: int = 0) -> Toy:
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    sigma = torch.arange(1, d + 1, dtype=torch.float64) ** -0.5
    w_star = ((u * sigma) @ v.T).float()
    x = torch.randn(n, d, generator=g)
    return Toy(w_star, x, x @ w_star.T)


def eckart_young_floor(d: int = 256, rank: int = 16) -> float:
    s2 = torch.arange(1, d + 1, dtype=torch.float64) ** -1.0
    return float(s2[rank:].sum() / s2.sum())


def train_toy(toy: Toy, method: str, lr: float, steps: int, rank: int = 16, gap: int = 50, scale: float = 0.25,
              svd: str = "exact", batch: int = 256, seed: int = 0) -> list[tuple[int, float]]:
    """Train one method; returns (step, error) every 100 steps and at the end."""
    d = toy.w_star.shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    if method == "lora":
        b = torch.nn.Parameter(torch.zeros(d, rank))
        a = torch.nn.Parameter(torch.randn(rank, d, generator=g) / math.sqrt(d))
        params, weight = [a, b], lambda: b @ a
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    else:
        w = torch.nn.Parameter(torch.zeros(d, d))
        params, weight = [w], lambda: w
        if method == "adamw":
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        else:
            never = method == "galore-frozen"
            cfg = GaLoreConfig(rank=rank, update_gap=steps + 1 if never else gap, scale=scale, svd=svd,
                               stagger=False)
            opt = GaLoreAdamW([("w", w)], lr, 0.0, cfg, seed=seed)
    n = toy.x.shape[0]
    order = torch.randperm(n, generator=g)
    curve = []
    for step in range(steps):
        lo = (step * batch) % n
        if lo == 0 and step:
            order = torch.randperm(n, generator=g)
        idx = order[lo:lo + batch]
        loss = (toy.x[idx] @ weight().T - toy.y[idx]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            with torch.no_grad():
                curve.append((step + 1, toy.error(weight())))
    return curve


def best_of(toy: Toy, method: str, steps: int, lrs=LRS, **kw) -> tuple[float, list[tuple[int, float]], dict]:
    """The learning rate with the lowest final error, its curve, and every rate's final error."""
    finals, curves = {}, {}
    for lr in lrs:
        curves[lr] = train_toy(toy, method, lr, steps, **kw)
        finals[lr] = curves[lr][-1][1]
    best = min(finals, key=lambda k: finals[k] if math.isfinite(finals[k]) else math.inf)
    return best, curves[best], finals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--svd", default="exact", choices=["exact", "randomized"], help="GaLore's refresh")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (256x256 matmuls gain little from more; 0: torch's default)")
    ap.add_argument("--append", type=Path, help="append the results to this markdown file")
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
        rows.append((method, lr, at.get(500), at.get(1000), at.get(2000), curve[-1][1], below, finals,
                     time.perf_counter() - t0))
        print(f"{method:14s} lr {lr:g}: final error {curve[-1][1]:.3e} ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr)
    lines = ["| method | best lr | error @500 | @1000 | @2000 | @3000 (final) | first step below 1e-3 | final error at "
             "lr 1e-3 / 3e-3 / 1e-2 |", "|---|---|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
    for method, lr, e500, e1000, e2000, final, below, finals, _ in rows:
        lines.append(f"| {method} | {lr:g} | {fmt(e500)} | {fmt(e1000)} | {fmt(e2000)} | {final:.2e} | "
                     f"{below if below is not None else 'never'} | "
                     f"{' / '.join(f'{finals[k]:.2e}' for k in LRS)} |")
    lines += ["", f"256x256 target, σᵢ = i^(-1/2), 8,192 Gaussian inputs, batch 256, MSE, W0 = 0, Adam 0.9/0.999, "
                  f"rank 16, GaLore α = 0.25, gap 50 ({args.svd} SVD), {args.steps} steps; Eckart-Young floor at rank "
                  f"16: {eckart_young_floor():.4f}. Errors every 100 steps ‖W − W*‖²/‖W*‖². "
                  f"torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} CPUs; {sum(r[-1] for r in rows):.0f} s in all."]
    text = "\n".join(lines)
    print(text)
    if args.append:
        command = "python benchmarks/galore_toy.py " + " ".join(sys.argv[1:])
        with open(args.append, "a") as f:
            f.write(f"\n## GaLore toy problem (CPU)\n\n`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
