"""Which path a decoder block's elementwise work takes: the fused Triton kernels of
`juno_py.kernels.elementwise_triton` (RMSNorm, the gated activations, RoPE on q and k) or the model's eager torch
code (`juno_py.models.model`), by the rules of `juno_py.kernels.kernel_mode`: fused for float32/bfloat16 CUDA tensors
under auto (the default) and fused, never under eager. On an H200 at Llama-3-8B training shapes the fused forward and
backward take 0.35× (RMSNorm), 0.64× (SwiGLU) and 0.39× (RoPE on q and k) of the eager code's time
(`benchmarks/elementwise_gpu.py`). CPU tensors take the eager code in every mode, so CPU results are the eager code's
exactly; `INTERPRET_CPU = True` (tests) lets
JUNO_PY_KERNELS=fused run them through Triton's interpreter (TRITON_INTERPRET=1) instead.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from juno_py.kernels import FUSED_DTYPES, fused_kernels, kernel_mode

INTERPRET_CPU = False  # CPU tensors through the interpreted kernels under JUNO_PY_KERNELS=fused (tests)


def fused_elementwise(*ts: torch.Tensor):
    """The `elementwise_triton` module when the fused kernels take these tensors (one device, float32 or bfloat16),
    else None. Raises `KernelUnavailable` under JUNO_PY_KERNELS=fused where triton cannot run them."""
    first = ts[0]
    if first.is_cpu and not INTERPRET_CPU:  # the CPU's common case: no import, no checks
        return None
    mode = kernel_mode()
    if first.is_cpu and mode != "fused":
        return None
    if mode == "eager" or any(t.dtype not in FUSED_DTYPES or t.device != first.device for t in ts):
        return None
    if fused_kernels(first.device, mode) is None:
        return None
    return importlib.import_module("juno_py.kernels.elementwise_triton")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """`x / rms(x) · weight` through the fused kernel, or None where the eager code runs (also for a norm weight that
    takes gradients: the fused backward gives x's gradient only, or weights wider than one row of x)."""
    if x.is_cpu and not INTERPRET_CPU:
        return None
    if weight.requires_grad or weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
        return None
    if out_dtype not in FUSED_DTYPES:
        return None
    fk = fused_elementwise(x, weight)
    return None if fk is None else fk.RMSNormFn.apply(x, weight, float(eps), out_dtype)


def gated(act: str, gate: torch.Tensor, up: torch.Tensor) -> Optional[torch.Tensor]:
    """`act(gate)·up` ("silu", "gelu_tanh") through the fused kernels, or None where the eager code runs."""
    if (gate.is_cpu and not INTERPRET_CPU) or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    fk = fused_elementwise(gate, up)
    return None if fk is None else fk.GatedFn.apply(gate, up, act)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """q and k `[B, T, H, D]` rotated by RoPE in one fused launch, or None where the eager code runs."""
    if (
        (q.is_cpu and not INTERPRET_CPU)
        or style not in ("norm", "neox")
        or q.dim() != 4
        or k.dim() != 4
        or q.dtype != k.dtype
    ):
        return None
    fk = fused_elementwise(q, k, cos, sin)
    return None if fk is None else fk.RopeQKFn.apply(q, k, cos, sin, style)


__all__ = ["fused_elementwise", "rms_norm", "gated", "rope_qk"]
