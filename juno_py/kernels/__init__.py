"""DoRA composition kernels, the loss chunk's cross-entropy kernel, and the dispatch that picks fused or eager.

`dora_compose(base, lora, g, s)` computes `g·(base + s·lora)` on one of three paths (DESIGN.md §3):
the fused training kernels (`DoraComposeFn`: forward writes y and inner, one-pass backward) when a gradient
is wanted on CUDA and the problem is at least `FUSED_TRAIN_MIN_ELEMENTS`; the fused inference kernel when no
gradient is wanted on CUDA; the eager torch reference on CPU, without Triton, below the crossover, or for
dtypes the kernels do not take (fp64 exactness checks, fp16). `JUNO_PY_KERNELS=fused|eager|auto` forces a
path; fused on CPU tensors needs `TRITON_INTERPRET=1` (Triton runs CPU tensors only in its interpreter).
`cross_entropy_grad_(z, targets, ignore_index, in_place)` gives a loss chunk's summed cross-entropy and its gradient
with respect to the logits: the fused kernel for fp32/bf16 logits on CUDA, else the eager reference (the same
JUNO_PY_KERNELS rules). Triton is optional: it is imported only when a fused path runs. `docs/kernels.md` has the
measurements.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from juno_py.kernels.gemm import mm_out
from juno_py.kernels.reference import (compose_eager, cross_entropy_grad_eager, norm_assemble_eager, norm_rows_eager,
                                       norm_rows_gram_eager)

_MODES = ("auto", "eager", "fused")

# Elements of base ([tokens, d_out]) from which the fused training kernels beat eager torch on the H200 (fwd+bwd,
# wall time per call): below it both are launch-bound and Triton's launches cost more than torch's; see
# docs/kernels.md for the sweep.
FUSED_TRAIN_MIN_ELEMENTS = 1 << 24

# Up to this rank the bf16 composition forms the adapter's product xa·Bᵀ inside its kernel (`compose_forward_xa`)
# instead of after a GEMM that writes it out. On the H200 (benchmarks/compose_xa_sweep.py, GPU µs, with inner): 61
# against 93 at 8192 × 4096, r = 16; 100 against 114 at 4096 × 8192, r = 384; but 157 against 142 at r = 768, where
# the kernel's dots (about half of cuBLAS's rate there) cost more than the traffic they save.
COMPOSE_XA_MAX_RANK = 512

EAGER, FUSED_INFERENCE, FUSED_TRAINING, FUSED = "eager", "fused-inference", "fused-training", "fused"

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


class KernelUnavailable(RuntimeError):
    """JUNO_PY_KERNELS=fused was asked for where the fused kernels cannot run."""


def split_lo_mask(order: str, what: str = "split_bf16") -> int:
    """The bit mask of `order`'s low parts (bit p set: part p is x_lo), for an order of 1 to 4 parts named 'h'
    (x_hi) and 'l' (x_lo); ValueError naming `what` otherwise."""
    if not order or set(order) - {"h", "l"} or len(order) > 4:
        raise ValueError(f"{what}: order {order!r}: expected 1 to 4 of 'h' (the bf16 part) and 'l' (the rest)")
    return sum(1 << p for p, c in enumerate(order) if c == "l")


def split_bf16(x: torch.Tensor, order: str = "hl", side: bool = False) -> torch.Tensor:
    """x `[n, k]` (fp32) in bf16 parts x_hi = bf16(x) and x_lo = bf16(x − x_hi), together within about 2⁻¹⁷ of x,
    so that bf16 tensor-core products of the parts (fp32 accumulation) reach fp32 accuracy. `order` names the parts
    in turn ('h' x_hi, 'l' x_lo; up to four): stacked `[len(order)·n, k]` (default `[x_hi; x_lo]`), or with `side`
    side by side along each row, `[n, len(order)·k]` (e.g. "hhl": `[x_hi | x_hi | x_lo]`)."""
    tk = _split_kernels(x)
    if tk is not None:  # one launch (`dora_triton.split_track`), the same bits
        return tk.split_track(x, order=order, side=side)
    split_lo_mask(order)
    n, k = x.shape
    m = len(order)
    out = torch.empty(n, m, k, dtype=torch.bfloat16, device=x.device)
    view = out if side else out.view(m, n, k).transpose(0, 1)  # [n, part, k] either way
    hi, lo = order.index("h") if "h" in order else None, order.index("l") if "l" in order else None
    hi_part = view[:, hi] if hi is not None else torch.empty(n, k, dtype=torch.bfloat16, device=x.device)
    hi_part.copy_(x)
    if lo is not None:
        torch.sub(x, hi_part, out=view[:, lo])
    for p, c in enumerate(order):
        if p not in (hi, lo):
            view[:, p].copy_(view[:, hi if c == "h" else lo])
    return out.view(n, m * k) if side else out.view(m * n, k)


def split_track(A: torch.Tensor, A_ref: torch.Tensor, copies: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(`split_bf16(A)`, `track_delta(A, A_ref, copies)`), A_ref moved by D: one kernel on CUDA
    (`dora_triton.split_track`) instead of four or five, the same bits; the torch operations elsewhere."""
    tk = _split_kernels(A, A_ref)
    if tk is not None:
        return tk.split_track(A, A_ref, copies)
    parts = split_bf16(A)
    return parts, track_delta(A, A_ref, copies)


def _split_kernels(*ts: torch.Tensor):
    """The kernel module for `split_track` on these tensors (contiguous fp32 matrices on CUDA, JUNO_PY_KERNELS not
    eager, triton importable), else None."""
    if not all(t.is_cuda and t.dtype == torch.float32 and t.dim() == 2 and t.is_contiguous() for t in ts):
        return None
    if kernel_mode() == "eager":
        return None
    return triton_kernels()


def track_delta(A: torch.Tensor, A_ref: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """D = bf16(A − A_ref) `[r, copies·k]` (the difference repeated `copies` times along each row: `[D | D]` for a
    product over a split W's concatenated halves), then A_ref += D in place, for fp32 A and A_ref `[r, k]`.

    A running U = W·A_refᵀ updated by W·Dᵀ then stays the product of W with what A_ref holds: the part of the
    difference that D's rounding drops (at most 2⁻⁹ of it) stays in A − A_ref and enters the next difference
    instead of being lost (error feedback). Two kernels (three with copies = 2)."""
    if A.shape != A_ref.shape or A.dtype != torch.float32 or A_ref.dtype != torch.float32:
        raise ValueError(f"track_delta: A {tuple(A.shape)} {A.dtype} and A_ref {tuple(A_ref.shape)} {A_ref.dtype}: "
                         f"expected two fp32 tensors of one shape")
    r, k = A.shape
    D = torch.empty(r, copies, k, dtype=torch.bfloat16, device=A.device)
    torch.sub(A, A_ref, out=D[:, 0])  # the fp32 difference, rounded to nearest even
    A_ref.add_(D[:, 0])
    if copies > 1:
        D[:, 1:].copy_(D[:, :1].expand(r, copies - 1, k))
    return D.view(r, copies * k)


def kernel_mode() -> str:
    mode = os.environ.get("JUNO_PY_KERNELS", "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"JUNO_PY_KERNELS={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


_triton_module = None
_triton_error: Optional[str] = None


def triton_kernels():
    """The `dora_triton` module, or None when triton cannot be imported (the reason is in `_triton_error`)."""
    global _triton_module, _triton_error
    if _triton_module is None and _triton_error is None:
        try:
            _triton_module = importlib.import_module("juno_py.kernels.dora_triton")
        except ImportError as e:  # not installed (macOS, a CPU-only install) or broken
            _triton_error = f"{type(e).__name__}: {e}"
    return _triton_module


def _fusable(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the kernels take these tensors at all: fp32/bf16 base and lora of one shape, g one value per column."""
    return (base.dtype in _FUSED_DTYPES and lora.dtype in _FUSED_DTYPES and g.dtype in _FUSED_DTYPES
            and base.shape == lora.shape and base.dim() >= 1 and g.numel() == base.shape[-1]
            and base.device == lora.device == g.device)


def _wants_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _fused_kernels(device: torch.device, mode: str):
    """Kernel module if a fused path may run on `device` in `mode`; else None (auto) or KernelUnavailable (fused)."""
    if mode == "fused":
        if triton_kernels() is None:
            raise KernelUnavailable(f"JUNO_PY_KERNELS=fused: triton cannot be imported ({_triton_error}); install "
                                    f"it (pip install triton, Linux) or use JUNO_PY_KERNELS=auto")
        if device.type == "cpu" and not triton_kernels().INTERPRETED:
            raise KernelUnavailable("JUNO_PY_KERNELS=fused on CPU tensors: Triton runs them only in its interpreter; "
                                    "set TRITON_INTERPRET=1 before juno_py's kernels load, or use JUNO_PY_KERNELS=auto")
        return triton_kernels()
    return triton_kernels() if device.type == "cuda" else None


def _norm_kernels(device: torch.device, *tensors: Optional[torch.Tensor], G: Optional[torch.Tensor] = None):
    """The kernel module a norm function runs on (fp32/bf16 tensors, an fp32 G if any, CUDA or JUNO_PY_KERNELS=fused),
    or None for its eager reference; KernelUnavailable as `_fused_kernels`."""
    mode = kernel_mode()
    narrow = all(t.dtype in _FUSED_DTYPES for t in tensors if t is not None)
    if mode == "eager" or not narrow or (G is not None and G.dtype != torch.float32):
        return None
    return _fused_kernels(device, mode)


def compose_path(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor) -> str:
    """Which path `dora_compose` takes for these tensors now: EAGER, FUSED_INFERENCE or FUSED_TRAINING.

    Raises KernelUnavailable when JUNO_PY_KERNELS=fused cannot be honoured (no triton; CPU tensors without
    TRITON_INTERPRET=1)."""
    mode = kernel_mode()
    if mode == "eager" or not _fusable(base, lora, g) or _fused_kernels(base.device, mode) is None:
        return EAGER
    if not _wants_grad(base, lora, g):
        return FUSED_INFERENCE
    if mode == "auto" and base.numel() < FUSED_TRAIN_MIN_ELEMENTS:
        return EAGER
    return FUSED_TRAINING


def layer_training_fused(x: torch.Tensor, n_out: int, *params: torch.Tensor) -> bool:
    """Whether a DoRA layer's training step on input x (output `[..., n_out]`) takes the fused training path: the
    same rule as `compose_path` giving FUSED_TRAINING for the layer's base and lora outputs (fp32/bf16, a gradient
    wanted through x or a parameter, kernels on x's device, at least `FUSED_TRAIN_MIN_ELEMENTS` in auto).

    `AdaptedLinear` then runs the whole step as one autograd Function (`DoraLinearFn`), which orders the GEMMs so
    the GPU runs them while the CPU issues the small work. Raises KernelUnavailable like `compose_path`."""
    mode = kernel_mode()
    if mode == "eager" or x.dtype not in _FUSED_DTYPES or x.dim() < 1:
        return False
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        return False
    if _fused_kernels(x.device, mode) is None:
        return False
    return mode == "fused" or (x.numel() // max(x.shape[-1], 1)) * n_out >= FUSED_TRAIN_MIN_ELEMENTS


def dora_compose(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
    """Autograd-aware `g·(base + s·lora)`, g broadcast over the last dimension, arithmetic in fp32.

    The result has base's dtype (fp32 stays fp32; on the eager path fp64 inputs give fp64)."""
    path = compose_path(base, lora, g)
    if path == EAGER:
        return compose_eager(base, lora, g, s)
    kernels = triton_kernels()
    g32 = g.reshape(-1).to(torch.float32)
    if path == FUSED_TRAINING:
        return kernels.DoraComposeFn.apply(base, lora, g32, float(s))
    N = base.shape[-1]
    y, _ = kernels.compose_forward(base.reshape(-1, N), lora.reshape(-1, N), g32, float(s))
    return y.reshape(base.shape)


def dora_compose_xa(base: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
    """`dora_compose(base, xa·Bᵀ, g, s)` given the adapter's input product xa = x·Aᵀ `[..., r]` and B `[N, r]`.
    Where no gradient is wanted (inference, playback), xa and B are bf16 on a fused path and the rank is at most
    COMPOSE_XA_MAX_RANK, one kernel forms xa·Bᵀ in fp32 inside the composition (`compose_forward_xa`: no
    [tokens, N] lora array written and read back, lora not rounded to bf16); everywhere else
    `dora_compose(base, lora, g, s)` with lora = xa @ B.T, which on CUDA without a gradient, up to that rank, is
    also left in fp32 (cuBLAS's fp32 output of the bf16 product, `mm_out`): the eager path then computes what the
    kernel does, up to the order of fp32 sums. Rounding lora to bf16 there had put the eager playback of a trained
    tiny model 1.04 % of the adapter's effect away from the fused one (the GPU acceptance allows 1 %), all of it
    the eager side's rounding."""
    mode = kernel_mode()
    N, r = B.shape
    if (mode != "eager" and r <= COMPOSE_XA_MAX_RANK and xa.dtype == B.dtype == torch.bfloat16
            and base.dtype in _FUSED_DTYPES
            and base.dim() >= 1 and base.shape[-1] == N and xa.shape[:-1] == base.shape[:-1] and xa.shape[-1] == r
            and g.numel() == N and g.dtype in _FUSED_DTYPES and base.device == xa.device == B.device == g.device
            and not _wants_grad(base, xa, B, g) and _fused_kernels(base.device, mode) is not None):
        y, _ = triton_kernels().compose_forward_xa(base.reshape(-1, N), xa.reshape(-1, r), B,
                                                   g.reshape(-1).to(torch.float32), float(s))
        return y.reshape(base.shape)
    if xa.is_cuda and r <= COMPOSE_XA_MAX_RANK and xa.dtype == B.dtype == torch.bfloat16 and not _wants_grad(
            base, xa, B, g):
        lora = mm_out(xa.reshape(-1, r), B.t(), torch.float32).reshape(*xa.shape[:-1], N)
    else:
        lora = xa @ B.T
    return dora_compose(base, lora, g, s)


def norm_assemble(base_sq: torch.Tensor, cross: torch.Tensor, ba_sq: torch.Tensor, s: float) -> torch.Tensor:
    """‖W + sBA‖_row = sqrt(max(base_sq + 2s·cross + s²·ba_sq, 0)): the fused kernel on CUDA (fp32 or bf16 inputs,
    result fp32), else the eager reference (which keeps fp64 for fp64 inputs). Same JUNO_PY_KERNELS rules."""
    kernels = _norm_kernels(base_sq.device, base_sq, cross, ba_sq)
    if kernels is None:
        return norm_assemble_eager(base_sq, cross, ba_sq, s)
    return kernels.norm_assemble(base_sq, cross, ba_sq, s)


def norm_rows(base_sq: torch.Tensor, B: torch.Tensor, U: torch.Tensor, V: Optional[torch.Tensor], s: float,
              eps: float = 0.0) -> torch.Tensor:
    """max(‖W + sBA‖_row, eps) = max(sqrt(max(‖W‖² + Σ_j B_ij·(2s·U_ij + s²·V_ij), 0)), eps) with U = W·Aᵀ and
    V = B·(A·Aᵀ) `[n, r]` (V None: no s² term, the caller folded it into U): one fused kernel on CUDA (fp32 or bf16
    inputs, result fp32), else the eager reference (which keeps fp64 for fp64 inputs). Same JUNO_PY_KERNELS rules
    as `norm_assemble`."""
    kernels = _norm_kernels(B.device, base_sq, B, U, V)
    if kernels is None:
        return norm_rows_eager(base_sq, B, U, V, s, eps)
    return kernels.norm_rows(base_sq, B, U, V, s, eps)


def norm_rows_gram(base_sq: torch.Tensor, B: torch.Tensor, U: torch.Tensor, G: torch.Tensor, s: float,
                   eps: float = 0.0, split: bool = False) -> torch.Tensor:
    """`norm_rows` with V = B·G formed inside one fused kernel on CUDA: G = A·Aᵀ fp32 `[r, r]`, or with `split` the
    fp32 half Gram matrix P = [A_hi; A_lo]·A_hiᵀ `[2r, r]` of the split A (`split_bf16`), G = P_top + P_bot + P_botᵀ.
    Else the eager reference (fp64 stays fp64). Same JUNO_PY_KERNELS rules as `norm_assemble`."""
    kernels = _norm_kernels(B.device, base_sq, B, U, G=G)
    if kernels is None:
        return norm_rows_gram_eager(base_sq, B, U, G, s, eps, split)
    return kernels.norm_rows_gram(base_sq, B, U, G, s, eps, split)


def cross_entropy_path(z: torch.Tensor) -> str:
    """Which path `cross_entropy_grad_` takes for logits z now: FUSED (fp32/bf16 `[n, V]` on CUDA, or anywhere under
    JUNO_PY_KERNELS=fused) or EAGER (CPU in auto mode, fp64 and other dtypes in every mode, JUNO_PY_KERNELS=eager,
    no triton). Raises KernelUnavailable like `compose_path`."""
    mode = kernel_mode()
    if mode == "eager" or z.dtype not in _FUSED_DTYPES or z.dim() != 2 or _fused_kernels(z.device, mode) is None:
        return EAGER
    return FUSED


def cross_entropy_grad_(z: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                        in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, its gradient softmax(z) − onehot(t) in z's dtype) of logits z `[n, V]` and int64
    targets `[n]`; rows whose target is `ignore_index` carry no loss and a zero gradient. `in_place`: the gradient
    is written into z's buffer (z's values are lost); else z is left as it is. fp32 arithmetic (fp64 for fp64 z, on
    the eager path); the loss is an fp32 (fp64) 0-dim tensor. Nothing waits for the device: CUDA graphs capture it."""
    if cross_entropy_path(z) == EAGER:
        return cross_entropy_grad_eager(z, targets, ignore_index, in_place)
    fused = importlib.import_module("juno_py.kernels.cross_entropy_triton")
    losses, grad = fused.cross_entropy_grad(z, targets, ignore_index, in_place)
    return losses.sum(), grad


__all__ = ["dora_compose", "dora_compose_xa", "norm_assemble", "norm_rows", "norm_rows_gram", "compose_path",
           "layer_training_fused", "compose_eager", "norm_assemble_eager", "norm_rows_eager", "norm_rows_gram_eager",
           "cross_entropy_grad_", "cross_entropy_path", "cross_entropy_grad_eager", "kernel_mode", "triton_kernels", "KernelUnavailable",
           "FUSED_TRAIN_MIN_ELEMENTS", "COMPOSE_XA_MAX_RANK", "EAGER", "FUSED_INFERENCE", "FUSED_TRAINING", "FUSED"]
