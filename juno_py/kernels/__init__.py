"""The kernels' shared dispatch: which path (fused Triton or eager torch) a kernel call takes, the bf16 splits of fp32
operands, and the loss chunk's cross-entropy.

`kernel_mode()` reads `JUNO_PY_KERNELS=fused|eager|auto`; `fused_kernels(device, mode)` says whether a fused path may
run on a device (fused on CPU tensors needs `TRITON_INTERPRET=1`: Triton runs CPU tensors only in its interpreter).
`split_bf16` / `split_track` / `track_delta` give the bf16 parts of fp32 tensors that bf16 tensor-core products take
at fp32 accuracy. `cross_entropy_grad_(z, targets, ignore_index, in_place)` gives a loss chunk's summed cross-entropy
and its gradient with respect to the logits: the fused kernel for fp32/bf16 logits on CUDA, else the eager reference
(the same JUNO_PY_KERNELS rules). DoRA's numerics and its dispatch thresholds are in `juno_py.kernels.dora`. Triton
is optional: it is imported only when a fused path runs. `docs/kernels.md` has the measurements.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch

from juno_py.kernels.reference import cross_entropy_grad_eager, online_tile_eager

_MODES = ("auto", "eager", "fused")

EAGER, FUSED = "eager", "fused"

FUSED_DTYPES = (torch.float32, torch.bfloat16)


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
        raise ValueError(
            f"track_delta: A {tuple(A.shape)} {A.dtype} and A_ref {tuple(A_ref.shape)} {A_ref.dtype}: "
            f"expected two fp32 tensors of one shape"
        )
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


def fused_kernels(device: torch.device, mode: str):
    """Kernel module if a fused path may run on `device` in `mode`; else None (auto) or KernelUnavailable (fused)."""
    if mode == "fused":
        if triton_kernels() is None:
            raise KernelUnavailable(
                f"JUNO_PY_KERNELS=fused: triton cannot be imported ({_triton_error}); install "
                f"it (pip install triton, Linux) or use JUNO_PY_KERNELS=auto"
            )
        if device.type == "cpu" and not triton_kernels().INTERPRETED:
            raise KernelUnavailable(
                "JUNO_PY_KERNELS=fused on CPU tensors: Triton runs them only in its interpreter; "
                "set TRITON_INTERPRET=1 before juno_py's kernels load, or use JUNO_PY_KERNELS=auto"
            )
        return triton_kernels()
    return triton_kernels() if device.type == "cuda" else None


def cross_entropy_path(z: torch.Tensor) -> str:
    """Which path `cross_entropy_grad_` takes for logits z now: FUSED (fp32/bf16 `[n, V]` on CUDA, or anywhere under
    JUNO_PY_KERNELS=fused) or EAGER (CPU in auto mode, fp64 and other dtypes in every mode, JUNO_PY_KERNELS=eager,
    no triton). Raises KernelUnavailable like `fused_kernels`."""
    mode = kernel_mode()
    if mode == "eager" or z.dtype not in FUSED_DTYPES or z.dim() != 2 or fused_kernels(z.device, mode) is None:
        return EAGER
    return FUSED


def cross_entropy_grad_(
    z: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, its gradient softmax(z) − onehot(t) in z's dtype) of logits z `[n, V]` and int64
    targets `[n]`; rows whose target is `ignore_index` carry no loss and a zero gradient. `in_place`: the gradient
    is written into z's buffer (z's values are lost); else z is left as it is. fp32 arithmetic (fp64 for fp64 z, on
    the eager path); the loss is an fp32 (fp64) 0-dim tensor. Nothing waits for the device: CUDA graphs capture it."""
    if cross_entropy_path(z) == EAGER:
        return cross_entropy_grad_eager(z, targets, ignore_index, in_place)
    fused = importlib.import_module("juno_py.kernels.cross_entropy_triton")
    losses, grad = fused.cross_entropy_grad(z, targets, ignore_index, in_place)
    return losses.sum(), grad


def online_tile_(
    z: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    state: tuple[torch.Tensor, ...],
    ignore_index: int = -100,
    cap: float = 0.0,
) -> None:
    """One vocabulary tile of the tiled loss head (`reference.online_tile_eager` states the arithmetic): z `[n, R]`
    overwritten with the gradient product's factors, the rows' running state updated in place. The fused kernel
    where `cross_entropy_path(z)` is FUSED and the state is fp32, the eager reference elsewhere. Nothing waits for
    the device: CUDA graphs capture it."""
    if cross_entropy_path(z) == EAGER or state[0].dtype != torch.float32:
        return online_tile_eager(z, targets, start, state, ignore_index, cap)
    fused = importlib.import_module("juno_py.kernels.cross_entropy_triton")
    fused.online_tile(z, targets, start, state, ignore_index, cap)


__all__ = [
    "online_tile_",
    "cross_entropy_grad_",
    "cross_entropy_path",
    "cross_entropy_grad_eager",
    "kernel_mode",
    "triton_kernels",
    "fused_kernels",
    "split_bf16",
    "split_track",
    "track_delta",
    "split_lo_mask",
    "KernelUnavailable",
    "EAGER",
    "FUSED",
    "FUSED_DTYPES",
]
