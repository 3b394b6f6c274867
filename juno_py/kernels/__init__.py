"""DoRA composition kernels and the dispatch that picks fused or eager.

`dora_compose(base, lora, g, s)` computes `g·(base + s·lora)`. On CPU, without Triton, or when forced with
`JUNO_PY_KERNELS=eager`, it runs the eager torch reference; the fused Triton paths arrive with the GPU issue
behind this same call.
"""

from __future__ import annotations

import os

import torch

from juno_py.kernels.reference import compose_eager, norm_assemble_eager

_MODES = ("auto", "eager", "fused")


def kernel_mode() -> str:
    mode = os.environ.get("JUNO_PY_KERNELS", "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"JUNO_PY_KERNELS={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def dora_compose(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
    """Autograd-aware `g·(base + s·lora)`, g broadcast over the last dimension, arithmetic in fp32."""
    if kernel_mode() == "fused":
        raise NotImplementedError("JUNO_PY_KERNELS=fused: the fused Triton DoRA kernels are not built yet "
                                  "(they arrive with the GPU path); use auto or eager")
    return compose_eager(base, lora, g, s)


__all__ = ["dora_compose", "compose_eager", "norm_assemble_eager", "kernel_mode"]
