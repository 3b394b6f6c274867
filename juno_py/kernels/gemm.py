"""GEMMs with an fp32 result from bf16 operands, the accumulator never rounded to bf16: `mm_out` (a new result) and
`addmm_out_` (accumulated in place into an fp32 C). On CUDA they are cuBLAS's bf16 GEMMs with fp32 output
(`torch.mm` / `torch.addmm` with `out_dtype`, torch 2.8 and later); where torch lacks that, or on the CPU, the bf16
values are widened (exactly) and multiplied in fp32. Whether torch takes `out_dtype` is learnt on first use, once
for each of the two functions.
"""

from __future__ import annotations

import torch

_MM_OUT_DTYPE = [True]  # whether torch.mm takes out_dtype here
_ADDMM_OUT_DTYPE = [True]  # whether torch.addmm takes out_dtype here
_OLD_TORCH = (TypeError, RuntimeError, NotImplementedError)


def mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` with the result in `out_dtype`: bf16 operands with an fp32 result use cuBLAS's fp32 output (the
    accumulator, never rounded to bf16 first); elsewhere the bf16 values are widened (exact) and multiplied in fp32."""
    if a.dtype == out_dtype:
        return torch.mm(a, b)
    if a.dtype == torch.bfloat16 and out_dtype == torch.float32:
        if a.is_cuda and _MM_OUT_DTYPE[0]:
            try:
                return torch.mm(a, b, torch.float32)
            except _OLD_TORCH:  # a torch without mm's out_dtype (before 2.8)
                _MM_OUT_DTYPE[0] = False
        return torch.mm(a.float(), b.float())
    return torch.mm(a, b).to(out_dtype)


def addmm_out_(
    C: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 1.0
) -> torch.Tensor:
    """C = beta·C + alpha·(a·b) in place, for an fp32 C whose rows are contiguous (a contiguous tensor or a slice of
    its rows) and fp32 or bf16 a, b: one cuBLAS GEMM accumulating into C in fp32 on CUDA. beta = 0: C is not read (a
    fresh buffer may hold anything)."""
    if C.dtype != torch.float32 or not C.is_contiguous():
        raise ValueError(
            f"addmm_out_: C {tuple(C.shape)} {C.dtype} with strides {C.stride()}: expected a contiguous float32 tensor"
        )
    if a.is_cuda and a.dtype == b.dtype == torch.float32:
        return torch.addmm(C, a, b, beta=beta, alpha=alpha, out=C)
    if a.is_cuda and _ADDMM_OUT_DTYPE[0]:
        try:
            return torch.addmm(C, a, b, beta=beta, alpha=alpha, out_dtype=torch.float32, out=C)
        except _OLD_TORCH:  # a torch without addmm's out_dtype
            _ADDMM_OUT_DTYPE[0] = False
    if not a.is_cuda:  # the exact bf16 values in fp32 (beta = 0: torch's addmm ignores C)
        return C.addmm_(a.float(), b.float(), beta=beta, alpha=alpha)
    product = mm_out(a, b, torch.float32)
    if beta == 0:
        return C.copy_(product).mul_(alpha) if alpha != 1.0 else C.copy_(product)
    if beta != 1.0:
        C.mul_(beta)
    return C.add_(product, alpha=alpha)


__all__ = ["mm_out", "addmm_out_"]
