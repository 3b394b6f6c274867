"""GaLore-AdamW: every weight of 2-D matrices trains, while Adam's moments live in a rank-r subspace of the gradient.

Per matrix W `[m, n]` with gradient G: a projector from the top-r singular vectors of G, left `P [m, r]` when
m ≤ n (the projected gradient is `R = Pᵀ G`, `[r, n]`), else right `Q [n, r]` (`R = G Q`, `[m, r]`), recomputed
every `update_gap` steps, with the matrices' refreshes staggered over the gap. Adam's moments and its normalized
step `N` are computed on R exactly as `torch.optim.AdamW` does on a full gradient; the step is lifted back (`P N`
or `N Qᵀ`), scaled by α and applied after the decoupled weight decay. With P = I and α = 1 it is AdamW; with any
rotating projector it is not (Adam is element-wise). The moments are kept across a refresh, as the paper does.

Row pieces (`GaLoreConfig.row_chunks`, and every matrix FSDP2 shards under `--shard`): a matrix may be projected as
pieces of consecutive rows (torch.chunk's dim-0 split), each with its own projector, moments and sketch seed; with
more than one piece this is a different algorithm from GaLore on the whole matrix, the one a sharded run computes.

Per-layer mode updates each matrix in a post-accumulate-gradient hook the moment its gradient is complete and
frees the gradient, so the gradients of all matrices never exist together. Diagnostics per matrix: the captured
fraction ‖R‖/‖G‖ of every step (a `galore` metrics event) and the optimizer state's size against AdamW's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from juno_py.errors import JunoError
from juno_py.train.optim import BETAS, EPS, TrainOptimizer
from juno_py.train.sharded import is_sharded, local_part
from juno_py.train.state import StateError

SVD_METHODS = ("randomized", "exact", "identity")  # identity: P = I (a check that GaLore reduces to AdamW)
# a matrix whose mean captured fraction between refreshes stays below this gets a warning: the subspace goes
# stale before the next refresh (lower the update gap or raise the rank)
LOW_CAPTURE = 0.3


class GaLoreConfigError(JunoError, ValueError):
    """A GaLore setting, or a combination of training settings, that cannot work."""


@dataclass(frozen=True)
class GaLoreConfig:
    rank: int = 128
    update_gap: int = 200  # T: steps between refreshes of a matrix's projector
    scale: float = 0.25  # α, independent of the rank
    svd: str = "randomized"  # or "exact" (torch.linalg.svd), or "identity"
    stagger: bool = True  # spread the matrices' refreshes over the gap
    per_layer: bool = False  # update each matrix in its gradient hook, during backward
    max_matrix_norm: float = 0.0  # clip each matrix's gradient to this L2 norm (0: off)
    oversample: int = 8  # randomized SVD: extra columns beyond r
    power_iters: int = 2  # randomized SVD: subspace iterations
    # split each matrix into this many row pieces (torch.chunk along dim 0, as FSDP2 shards it), each with its own
    # projector and moments: one process running what `--shard` on this many processes runs (`row_pieces`)
    row_chunks: int = 1

    def __post_init__(self):
        if self.rank < 1:
            raise GaLoreConfigError(f"--galore-rank {self.rank}: expected at least 1")
        if self.update_gap < 1:
            raise GaLoreConfigError(f"--galore-update-gap {self.update_gap}: expected at least 1")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise GaLoreConfigError(f"--galore-scale {self.scale}: expected a positive number")
        if self.svd not in SVD_METHODS:
            raise GaLoreConfigError(f"--galore-svd {self.svd!r}: expected one of {', '.join(SVD_METHODS)}")
        if self.max_matrix_norm < 0:
            raise GaLoreConfigError(f"per-matrix clipping norm {self.max_matrix_norm}: expected >= 0")
        if self.row_chunks < 1:
            raise GaLoreConfigError(f"--galore-row-chunks {self.row_chunks}: expected at least 1")


def check_per_layer(
    accumulation: int, max_grad_norm: float, bptt_window: int = 0, world_size: int = 1, sharded: bool = False
) -> None:
    """Refuse what per-layer updates cannot do: each matrix steps as soon as one backward pass has produced its
    gradient, so nothing may need the gradients of several passes, or of all matrices at once."""
    if accumulation > 1:
        raise GaLoreConfigError(
            f"--galore-per-layer updates each matrix during backward, so gradient accumulation "
            f"(--gradient-accumulation {accumulation}) cannot add up several micro-batches: "
            f"use --no-galore-per-layer, or a larger --batch-size"
        )
    if max_grad_norm > 0:
        raise GaLoreConfigError(
            "--galore-per-layer updates each matrix before the others have gradients, so the "
            "global gradient norm is never known before an update: use --grad-clip per-matrix "
            "(each matrix clipped to --max-grad-norm), or --no-galore-per-layer"
        )
    if bptt_window:
        raise GaLoreConfigError(
            f"--galore-per-layer needs one backward pass per step; --bptt-window {bptt_window} "
            f"runs one per window: use --no-galore-per-layer"
        )
    if world_size > 1:
        raise GaLoreConfigError(
            f"--galore-per-layer would update each process's matrices before the {world_size} "
            f"processes average their gradients: use --no-galore-per-layer"
        )
    if sharded:
        raise GaLoreConfigError(
            "--galore-per-layer with --shard: FSDP2 hands each process its part of a gradient after the "
            "backward pass, so no matrix can step during it: use --no-galore-per-layer"
        )


def resolve_update_mode(
    optimizer: str,
    per_layer: Optional[bool],
    grad_clip: str,
    max_norm: float,
    accumulation: int = 1,
    bptt_window: int = 0,
    world_size: int = 1,
    sharded: bool = False,
) -> tuple[bool, str, float, float]:
    """`juno-py full`'s update mode from its options: (per-layer updates, clipping 'global' or 'per-matrix', the
    loop's global clipping norm, GaLore's per-matrix norm). per_layer None: on for GaLore in a single unsharded
    process.
    grad_clip 'auto': per matrix in per-layer mode, else global. Refuses the combinations that cannot work."""
    galore = optimizer == "galore"
    if per_layer is None:
        per_layer = galore and world_size == 1 and not sharded
    elif per_layer and not galore:
        raise GaLoreConfigError("--galore-per-layer applies to --optimizer galore")
    clip = grad_clip if grad_clip != "auto" else ("per-matrix" if per_layer else "global")
    if clip not in ("global", "per-matrix"):
        raise GaLoreConfigError(f"--grad-clip {grad_clip!r}: expected auto, global or per-matrix")
    if clip == "per-matrix" and not galore:
        raise GaLoreConfigError("--grad-clip per-matrix applies to --optimizer galore (AdamW clips globally)")
    global_norm = max_norm if clip == "global" else 0.0
    if per_layer:
        check_per_layer(accumulation, global_norm, bptt_window, world_size, sharded)
    return per_layer, clip, global_norm, max_norm if clip == "per-matrix" else 0.0


# -------------------------------------------------------------------------------------------------- projector
def projector_side(shape: Sequence[int]) -> str:
    """'left' (P [m, r], the smaller side) when m ≤ n, else 'right' (Q [n, r])."""
    return "left" if shape[0] <= shape[1] else "right"


def top_singular_vectors(
    g: torch.Tensor,
    r: int,
    side: str = "left",
    method: str = "randomized",
    generator: Optional[torch.Generator] = None,
    oversample: int = 8,
    power_iters: int = 2,
) -> torch.Tensor:
    """An orthonormal basis of the top-r singular subspace of `g` `[m, n]`: left singular vectors `[m, r]` or right
    ones `[n, r]`, in g's dtype.

    exact: `torch.linalg.svd(g)` (U[:, :r], or Vh[:r]ᵀ: the signs LAPACK gives, as galore-torch takes them).
    randomized: a Gaussian sketch of r + oversample columns, `power_iters` subspace iterations
    (re-orthonormalized), then the exact SVD of the small projected matrix (Halko, Martinsson, Tropp 2011); where
    the sketch would be as wide as the matrix, the exact SVD. identity: the first r unit vectors."""
    d = g.shape[0] if side == "left" else g.shape[1]
    if method == "identity":
        return torch.eye(d, r, dtype=g.dtype, device=g.device)
    q = r + oversample
    if method == "exact" or q >= min(g.shape):
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        return (u[:, :r] if side == "left" else vh[:r].T).contiguous()
    a = g if side == "left" else g.T  # [d, k]: its left singular vectors are the ones wanted
    omega = torch.randn(a.shape[1], q, generator=generator, dtype=a.dtype, device=a.device)
    y = a @ omega
    for _ in range(power_iters):
        y = torch.linalg.qr(y).Q
        y = a @ (a.T @ y)
    basis = torch.linalg.qr(y).Q  # [d, q]
    # the SVD of the small Qᵀa [q, k] through its QR (Qᵀa = Rᵀ Q₂ᵀ): only a q×q SVD, several times cheaper
    r_small = torch.linalg.qr((basis.T @ a).T).R  # [q, q]
    u_small, _, _ = torch.linalg.svd(r_small.T)
    return (basis @ u_small[:, :r]).contiguous()


def state_numel(shape: Sequence[int], rank: int) -> dict[str, int]:
    """Values GaLore keeps for one matrix (two moments in r-space, the projector) and what AdamW would keep."""
    m, n = int(shape[0]), int(shape[1])
    r = min(rank, m, n)
    small = m if projector_side((m, n)) == "left" else n
    return {"moments": 2 * r * (m + n - small), "projector": small * r, "adamw": 2 * m * n}


# -------------------------------------------------------------------------------------------------- optimizer
def row_pieces(n_rows: int, chunks: int) -> list[tuple[int, int, int]]:
    """(piece, first row, end row) of a matrix of `n_rows` rows split as `torch.chunk(w, chunks, dim=0)` splits it,
    which is how FSDP2 shards a parameter over `chunks` ranks: pieces of ceil(n_rows / chunks) rows, the last one
    shorter, and none past the end (rank j of a sharded run holds piece j; ranks beyond the last piece hold none)."""
    k = math.ceil(n_rows / chunks) if n_rows else 0
    return [(j, j * k, min(n_rows, (j + 1) * k)) for j in range(chunks) if k and j * k < n_rows]


class GaLoreAdamW(TrainOptimizer, torch.optim.Optimizer):
    """GaLore-AdamW over named 2-D parameters: one parameter group named 'weights' (the schedule sets its `lr` from
    `base_lr`). `recorder` (a MetricsRecorder) receives one `galore` event per step; `seed` makes the randomized
    SVD's sketches reproducible (each refresh draws from a generator seeded by seed, matrix, piece and step).

    Row pieces: each matrix is projected as one or more pieces of consecutive rows, each with its own projector
    and moments (`state[p]` is the state of p's first piece, its only one unless split). A whole matrix is split
    into `config.row_chunks` pieces (`row_pieces`); a matrix sharded by FSDP2 (a DTensor: `--shard`) is, on each
    rank, the one piece it holds, numbered by the rank, so N ranks run what one process runs with row_chunks N.
    With one piece per matrix this is GaLore on the whole matrix."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        lr: float,
        weight_decay: float = 0.0,
        config: GaLoreConfig = GaLoreConfig(),
        betas: tuple[float, float] = BETAS,
        eps: float = EPS,
        seed: int = 0,
        recorder=None,
    ):
        named_params = list(named_params)
        if not named_params:
            raise GaLoreConfigError("GaLore has no matrices to train")
        for name, p in named_params:
            if p.dim() != 2:
                raise GaLoreConfigError(f"{name}: shape {tuple(p.shape)}, GaLore trains 2-D matrices only")
        params = [p for _, p in named_params]
        self.sharded = any(is_sharded(p) for p in params)
        if self.sharded and config.row_chunks != 1:
            raise GaLoreConfigError(
                f"GaLore row_chunks {config.row_chunks} on sharded matrices: each rank's shard is its piece "
                f"(row_chunks emulates a sharded run in one process); use row_chunks 1"
            )
        if self.sharded and config.per_layer:
            raise GaLoreConfigError(
                "GaLore's per-layer updates cannot run on sharded matrices: use --no-galore-per-layer"
            )
        group = {"name": "weights", "params": params, "lr": lr, "base_lr": lr, "weight_decay": weight_decay}
        super().__init__([group], dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.config, self.seed, self.recorder = config, seed, recorder
        self.names = {id(p): name for name, p in named_params}
        self.pieces: dict[int, list[dict[str, Any]]] = {}
        gap = config.update_gap
        for i, p in enumerate(params):
            n_rows, n_cols = local_part(p).shape
            if is_sharded(p):  # this rank's rows: piece number `rank` of the FSDP2 split
                rank = p.device_mesh.get_local_rank()  # type: ignore[attr-defined]
                spans = [(rank, 0, n_rows)] if n_rows else []
            else:
                spans = row_pieces(n_rows, config.row_chunks)
            pieces: list[dict[str, Any]] = []
            for j, a, b in spans:
                st = self.state[p] if not pieces else {}
                st.update(
                    index=i,
                    piece=j,
                    rows=(a, b),
                    step=0,
                    rank=min(config.rank, b - a, n_cols),
                    side=projector_side((b - a, n_cols)),
                    phase=(i * gap) // len(params) if config.stagger else 0,
                    projector=None,
                    exp_avg=None,
                    exp_avg_sq=None,
                    captured=float("nan"),
                    sum_all=0.0,
                    n_all=0,
                    sum_window=0.0,
                    n_window=0,
                    window_mean=float("nan"),
                    refreshes=0,
                )
                pieces.append(st)
            self.pieces[id(p)] = pieces
        self.steps = 0
        self._step_info = self._new_step_info()
        if config.per_layer:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def updates_in_backward(self) -> bool:
        """True in per-layer mode: the weights change during backward, before the loop sees a gradient norm."""
        return self.config.per_layer

    def _named_pieces(self, names: Optional[dict[int, str]] = None) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        """(name, parameter, state) of every piece this process holds: a matrix in one piece by its own name, the
        pieces of a split one as '<name>#<piece>'."""
        names = self.names if names is None else names
        out = []
        for p in self.param_groups[0]["params"]:
            pieces = self.pieces[id(p)]
            for st in pieces:
                name = names[id(p)] if len(pieces) == 1 else f"{names[id(p)]}#{st['piece']}"
                out.append((name, p, st))
        return out

    # ---- one matrix ---------------------------------------------------------------------------------------
    @staticmethod
    def _new_step_info() -> dict:
        return {"sq": 0.0, "finite": True, "refreshes": 0, "refresh_ms": 0.0, "clipped": 0}

    def _refresh_due(self, st: dict) -> bool:
        return st["projector"] is None or st["step"] % self.config.update_gap == st["phase"]

    def _refresh(self, st: dict, grad: torch.Tensor) -> None:
        c = self.config
        if grad.is_cuda:  # time the refresh itself, not the queue before it
            torch.cuda.synchronize(grad.device)
        t0 = time.perf_counter()
        gen = None
        if c.svd == "randomized":
            gen = torch.Generator(device=grad.device)
            gen.manual_seed(
                (self.seed * 1_000_003 + st["index"] * 10_007 + st["step"] + st["piece"] * 1_299_709) % (2**63)
            )
        st["projector"] = top_singular_vectors(grad, st["rank"], st["side"], c.svd, gen, c.oversample, c.power_iters)
        if grad.is_cuda:
            torch.cuda.synchronize(grad.device)
        if st["n_window"]:
            st["window_mean"] = st["sum_window"] / st["n_window"]
        st["sum_window"], st["n_window"] = 0.0, 0
        st["refreshes"] += 1
        self._step_info["refreshes"] += 1
        self._step_info["refresh_ms"] += 1e3 * (time.perf_counter() - t0)

    @torch.no_grad()
    def _update(
        self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], ok: Optional[torch.Tensor] = None
    ) -> None:
        """One GaLore-AdamW step of each piece of `p` this process holds, from the matrix's (clipped) gradient
        `grad` (this rank's part of it when sharded)."""
        w = local_part(p)
        for st in self.pieces[id(p)]:
            a, b = st["rows"]
            self._update_piece(st, w[a:b], grad[a:b], group, ok)

    @torch.no_grad()
    def _update_piece(
        self,
        st: dict[str, Any],
        p: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        ok: Optional[torch.Tensor] = None,
    ) -> None:
        """One GaLore-AdamW step of one piece `p` (a view of the matrix's rows) from its (already clipped) gradient.
        `ok`: a 0-d bool tensor on the device (per-layer mode on a GPU, where the host does not wait for each
        matrix): where it is false (a non-finite gradient) the weights and moments keep their values."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        grad = grad.to(p.dtype)
        refreshed = self._refresh_due(st)
        if refreshed:
            if ok is not None and not bool(ok):  # an SVD of a non-finite matrix: wait and skip (about once a step)
                return
            self._refresh(st, grad)
        P = st["projector"]
        low = P.T @ grad if st["side"] == "left" else grad @ P
        # ‖R‖/‖G‖, read with the other matrices' at the end of the step (one device sync, not one per matrix)
        g_norm = torch.linalg.vector_norm(grad)
        st["pending"] = (torch.where(g_norm > 0, torch.linalg.vector_norm(low) / g_norm, 1.0), refreshed)
        if st["exp_avg"] is None:
            st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(low), torch.zeros_like(low)
        st["step"] += 1
        t = st["step"]
        # torch.optim.AdamW's arithmetic, in r-space
        m, v = st["exp_avg"], st["exp_avg_sq"]
        if ok is not None:  # work on copies; keep them only where the gradient was finite
            m, v = m.clone(), v.clone()
        m.lerp_(low, 1 - beta1)
        v.mul_(beta2).addcmul_(low, low, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        normalized = m / denom
        step = P @ normalized if st["side"] == "left" else normalized @ P.T
        w = p if ok is None else p.clone()
        if wd:
            w.mul_(1 - lr * wd)
        w.add_(step, alpha=-lr / (1 - beta1**t) * self.config.scale)
        if ok is not None:
            for old, new in ((st["exp_avg"], m), (st["exp_avg_sq"], v), (p, w)):
                old.copy_(torch.where(ok, new, old))

    def _clip(self, grad: torch.Tensor, norm) -> torch.Tensor:
        """Per-matrix clipping to `max_matrix_norm`; `norm` a float or a 0-d tensor (then nothing waits for it)."""
        limit = self.config.max_matrix_norm
        if limit <= 0:
            return grad
        if isinstance(norm, torch.Tensor):
            self._step_info["clipped"] += (norm > limit).int()
            return grad * (limit / (norm + 1e-6)).clamp(max=1.0)
        if norm > limit:
            self._step_info["clipped"] += 1
            return grad * (limit / (norm + 1e-6))
        return grad

    def _on_grad(self, p: torch.Tensor) -> None:
        """Per-layer mode: step this matrix as soon as backward has accumulated its gradient; free the gradient.
        On the CPU, after a non-finite gradient no further matrix of this step is updated; on a GPU the check
        stays on the device (no wait per matrix) and only the matrices with a non-finite gradient keep their
        values. Either way the loop then stops the run without a checkpoint."""
        grad, p.grad = p.grad, None
        info = self._step_info
        if grad is None or not info["finite"]:
            return
        norm = torch.linalg.vector_norm(grad, dtype=torch.float64)  # an fp64 sum without an fp64 copy
        if grad.is_cuda:
            info["sq"] = info["sq"] + norm.square()
            self._update(p, self._clip(grad, norm), self.param_groups[0], ok=torch.isfinite(norm))
            return
        norm = float(norm)
        if not math.isfinite(norm):
            info["finite"] = False
            return
        info["sq"] += norm * norm
        self._update(p, self._clip(grad, norm), self.param_groups[0])

    # ---- the loop's interface -----------------------------------------------------------------------------
    def grad_norm(self, params: Sequence[torch.Tensor]) -> float:
        """The global gradient norm of this step (inf/nan after a non-finite gradient). In per-layer mode the
        gradients are gone: the norm was summed in the hooks."""
        if self.config.per_layer:
            sq = float(self._step_info["sq"])  # a device tensor on a GPU: one wait for the whole step
            return math.sqrt(sq) if self._step_info["finite"] and math.isfinite(sq) else math.inf
        return super().grad_norm(params)

    def _matrix_norms(self, grads: list[Optional[torch.Tensor]]) -> list[Any]:
        """Each matrix's gradient norm for per-matrix clipping (fp64). Sharded: the squares of the ranks' parts,
        all-reduced in one collective, so every rank clips by the whole matrix's norm, as one process does."""
        if not self.sharded:
            return [0.0 if g is None else torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
        import torch.distributed as dist

        device = next(local_part(p).device for p in self.param_groups[0]["params"])
        sq = torch.zeros(len(grads), dtype=torch.float64, device=device)
        for i, g in enumerate(grads):
            if g is not None and g.numel():
                sq[i] = torch.linalg.vector_norm(g, dtype=torch.float64).square()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        return list(sq.sqrt().unbind())

    @torch.no_grad()
    def step(self, closure=None):
        """Update every matrix that has a gradient (in per-layer mode that happened during backward), then record
        the step's diagnostics."""
        if closure is not None:
            raise GaLoreConfigError("GaLoreAdamW.step takes no closure")
        group = self.param_groups[0]
        if not self.config.per_layer:
            grads = [None if p.grad is None else local_part(p.grad) for p in group["params"]]
            norms = self._matrix_norms(grads) if self.config.max_matrix_norm > 0 else [0.0] * len(grads)
            for p, grad, norm in zip(group["params"], grads, norms):
                if grad is not None:
                    self._update(p, self._clip(grad, norm), group)
        self.steps += 1
        self._collect()
        self._emit()
        self._step_info = self._new_step_info()

    def _collect(self) -> None:
        """Fold this step's captured fractions into each piece's statistics."""
        updated = [st for _, _, st in self._named_pieces() if st.get("pending") is not None]
        if not updated:
            return
        values = torch.stack([st["pending"][0].float() for st in updated]).tolist()
        for st, value in zip(updated, values):
            refreshed = st.pop("pending")[1]
            st["captured"] = value
            st["sum_all"] += value
            st["n_all"] += 1
            if not refreshed:  # a fresh projector captures its own gradient best: the window measures staleness
                st["sum_window"] += value
                st["n_window"] += 1
        clipped = self._step_info["clipped"]
        self._step_info["clipped"] = int(clipped)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._step_info = self._new_step_info()

    # ---- diagnostics --------------------------------------------------------------------------------------
    def captured(self) -> dict[str, float]:
        """The captured fraction ‖R‖/‖G‖ of each piece (each matrix, unless split) at its last update; sharded:
        of the pieces this rank holds."""
        return {name: st["captured"] for name, _, st in self._named_pieces()}

    def _emit(self) -> None:
        if self.recorder is None:
            return
        fractions = [f for f in self.captured().values() if math.isfinite(f)]
        info = self._step_info
        per_matrix = {f"captured.{name}": f for name, f in self.captured().items()}
        self.recorder.emit(
            "galore",
            step=self.steps,
            captured_mean=sum(fractions) / max(1, len(fractions)),
            captured_min=min(fractions, default=float("nan")),
            refreshes=info["refreshes"],
            refresh_ms=info["refresh_ms"],
            clipped_matrices=info["clipped"],
            **per_matrix,
        )

    def state_size(self) -> dict[str, int]:
        """Values held by this process: moments and projectors as allocated (or as they will be, before the first
        step), and what AdamW would hold for the same rows."""
        out = {"moments": 0, "projector": 0, "adamw": 0}
        for _, p, st in self._named_pieces():
            a, b = st["rows"]
            planned = state_numel((b - a, local_part(p).shape[1]), self.config.rank)
            out["moments"] += (
                st["exp_avg"].numel() + st["exp_avg_sq"].numel() if st["exp_avg"] is not None else planned["moments"]
            )
            out["projector"] += st["projector"].numel() if st["projector"] is not None else planned["projector"]
            out["adamw"] += planned["adamw"]
        return out

    def summary(self) -> dict:
        """Per piece (each matrix, unless split): mean captured fraction over all steps and over the steps between
        refreshes (the staleness), refreshes; the pieces whose between-refresh mean is below LOW_CAPTURE; the state
        size."""
        rows = {}
        for name, _, st in self._named_pieces():
            window = (st["sum_window"] / st["n_window"]) if st["n_window"] else st["window_mean"]
            rows[name] = {
                "captured_mean": st["sum_all"] / st["n_all"] if st["n_all"] else float("nan"),
                "captured_between_refreshes": window,
                "refreshes": st["refreshes"],
                "rank": st["rank"],
                "side": st["side"],
            }
        low = sorted(
            (k for k, r in rows.items() if r["captured_between_refreshes"] < LOW_CAPTURE),
            key=lambda k: rows[k]["captured_between_refreshes"],
        )
        return {"matrices": rows, "low_capture": low, "state": self.state_size(), "config": asdict(self.config)}

    def summary_lines(self) -> list[str]:
        """What `juno-py full` prints: state size against AdamW, captured fractions, a warning for stale ones."""
        s = self.summary()
        size, rows = s["state"], s["matrices"]
        fmt = lambda n: f"{n / 1e6:.2f}M"  # noqa: E731
        lines = [
            f"GaLore state: {fmt(size['moments'])} moment values + {fmt(size['projector'])} projector values "
            f"({fmt(size['moments'] + size['projector'])}) vs AdamW's {fmt(size['adamw'])} "
            f"({(size['moments'] + size['projector']) / max(size['adamw'], 1):.3f}x)"
        ]
        means = [r["captured_mean"] for r in rows.values() if math.isfinite(r["captured_mean"])]
        stale = {
            k: r["captured_between_refreshes"]
            for k, r in rows.items()
            if math.isfinite(r["captured_between_refreshes"])
        }
        if means:
            worst = min(stale, key=stale.get) if stale else None
            lines.append(
                f"captured gradient fraction |P^T G|/|G|: mean {sum(means) / len(means):.3f} over "
                f"{len(means)} matrices"
                + (
                    f"; between refreshes mean {sum(stale.values()) / len(stale):.3f}"
                    f", lowest {stale[worst]:.3f} ({worst})"
                    if stale
                    else ""
                )
            )
        if s["low_capture"]:
            shown = ", ".join(f"{k} {stale[k]:.2f}" for k in s["low_capture"][:4])
            more = f" and {len(s['low_capture']) - 4} more" if len(s["low_capture"]) > 4 else ""
            lines.append(
                f"warning: {len(s['low_capture'])} matrices keep less than {LOW_CAPTURE} of their gradient "
                f"between refreshes ({shown}{more}): the subspace goes stale; lower --galore-update-gap or "
                f"raise --galore-rank"
            )
        return lines

    # ---- resume state -------------------------------------------------------------------------------------
    def _config_doc(self) -> dict:
        c = asdict(self.config)
        doc = {k: c[k] for k in ("rank", "update_gap", "scale", "svd", "stagger", "oversample", "power_iters")}
        if self.config.row_chunks != 1:
            doc["row_chunks"] = self.config.row_chunks
        return doc

    def state_bytes(self, params: Sequence[torch.Tensor]) -> int:
        """Moments and projectors in fp32, as `state_size` plans them."""
        size = self.state_size()
        return 4 * (size["moments"] + size["projector"])

    _DOC_KEYS = (
        "step",
        "phase",
        "rank",
        "side",
        "captured",
        "sum_all",
        "n_all",
        "sum_window",
        "n_window",
        "window_mean",
        "refreshes",
    )

    def state_tensors(self, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict]:
        """Moments and projectors as tensors; per piece (each matrix, unless split; sharded: this rank's pieces)
        its step, refresh phase and statistics as JSON."""
        tensors, doc = {}, {"galore": self._config_doc(), "steps": self.steps, "matrices": {}}
        for name, _, st in self._named_pieces(names):
            doc["matrices"][name] = {k: st[k] for k in self._DOC_KEYS}
            for k in ("exp_avg", "exp_avg_sq", "projector"):
                if st[k] is not None:
                    tensors[f"galore/{name}/{k}"] = st[k]
        return tensors, doc

    def load_state_tensors(self, names: dict[int, str], tensors: dict, doc: dict, where: str) -> None:
        saved = doc.get("galore") if isinstance(doc, dict) else None
        if saved != self._config_doc():
            raise StateError(
                f"{where}: the run's GaLore settings differ from this one's ({saved} vs "
                f"{self._config_doc()}); resume with the same --galore-* options"
            )
        for name, p, st in self._named_pieces(names):
            entry = doc["matrices"].get(name)
            if entry is None:
                raise StateError(f"{where}: GaLore state of {name!r} is missing")
            st.update(entry)
            for k in ("exp_avg", "exp_avg_sq", "projector"):
                t = tensors.get(f"galore/{name}/{k}")
                st[k] = None if t is None else t.clone().to(local_part(p).device)
            if st["projector"] is not None:
                a, b = st["rows"]
                want = (b - a if st["side"] == "left" else local_part(p).shape[1], st["rank"])
                if tuple(st["projector"].shape) != want:
                    raise StateError(
                        f"{where}: GaLore projector of {name!r} has shape "
                        f"{tuple(st['projector'].shape)}, expected {want}"
                    )
        self.steps = int(doc["steps"])
