"""Dequantization of GGML blocks on the device (Triton), beside its eager torch reference.

`dequantize_tile` decodes any rectangle of a quantized weight (rows and columns, no alignment needed) straight
from its bytes into bf16 or fp32: the GPU frozen linear multiplies such tiles with cuBLAS at training token
counts. `dequant_matvec` fuses decoding into a matrix-vector product for a few tokens (playback decode), where
writing a dequantized tile would cost more than the product. The kernels live in `dequant_triton`, imported
only when one first runs (Triton is optional; `@triton.jit` reads TRITON_INTERPRET when a kernel is defined).

Numerics: every block type decodes as `code · scale (+ bias)` where the products are exact in fp32 (an f16
scale of 11 significant bits times integers small enough that the product fits 24 bits), so only the one
addition rounds, as in the torch codecs: the fp32 values are bit-identical to `juno_py.gguf.quants.dequantize`
(a fused multiply-add changes nothing, since the product is exact). fp32 → bf16 rounds to nearest even with
integer operations on the bit pattern (NaN → 0x7FC0, as torch), never with a float cast: Triton's interpreter
truncates on that cast while the GPU rounds, and this way both give torch's `.to(torch.bfloat16)`.

Types with a kernel: `TRITON_TYPES`. Every other type decodes through the torch codecs (on the CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from typing import Optional

import torch

from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType

TRITON_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                          GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
OUT_DTYPES = (torch.bfloat16, torch.float32)

# tile of one program of the dequantization kernel: 8 rows x 256 columns (one K-quant super-block per row)
TILE_ROWS, TILE_COLS = 8, 256
# tile of one program of the matrix-vector kernel: 32 output rows, 256 input columns per step
MATVEC_ROWS, MATVEC_COLS = 32, 256

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_kernels = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_ready(device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: a CUDA device, or any device under the
    interpreter (TRITON_INTERPRET=1, CPU tests)."""
    return _HAS_TRITON and (torch.device(device).type == "cuda" or interpreting())


def has_kernel(ggml_type: int) -> bool:
    return int(ggml_type) in TRITON_TYPES


def kernels():
    """The `dequant_triton` module (imported on first use)."""
    global _kernels
    if _kernels is None:
        _kernels = importlib.import_module("juno_py.kernels.dequant_triton")
    return _kernels


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _on(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check(raw: torch.Tensor, ggml_type: int, n_cols: int) -> int:
    if not has_kernel(ggml_type):
        raise ValueError(f"no Triton kernel for GGML type {GGMLType(ggml_type).name}")
    block, size = GGML_BLOCK_SIZES[ggml_type]
    row_bytes = n_cols // block * size
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes or n_cols % block:
        raise ValueError(f"raw bytes {tuple(raw.shape)} {raw.dtype}: expected uint8 [rows, {row_bytes}] for "
                         f"{n_cols} {GGMLType(ggml_type).name} columns")
    if not raw.is_contiguous():
        raise ValueError("raw bytes must be contiguous rows")
    return row_bytes


def dequantize_tile(raw: torch.Tensor, ggml_type: int, n_cols: int, rows: Optional[tuple[int, int]] = None,
                    cols: Optional[tuple[int, int]] = None, dtype: torch.dtype = torch.bfloat16,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W[r0:r1, c0:c1] decoded from `raw` (uint8 `[n_rows, row_bytes]`, on the device the kernel runs on) into
    `dtype`: bf16 (the exact value rounded to nearest even) or fp32 (exact). `out`: a buffer to write into (its
    leading rows and columns; any row stride)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize_tile: dtype {dtype}, expected torch.bfloat16 or torch.float32")
    row_bytes = _check(raw, ggml_type, n_cols)
    r0, r1 = rows or (0, raw.shape[0])
    c0, c1 = cols or (0, n_cols)
    if not (0 <= r0 <= r1 <= raw.shape[0] and 0 <= c0 <= c1 <= n_cols):
        raise ValueError(f"dequantize_tile: rows {r0}:{r1}, cols {c0}:{c1} outside [{raw.shape[0]}, {n_cols}]")
    shape = (r1 - r0, c1 - c0)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif out.dtype != dtype or out.shape[0] < shape[0] or out.shape[1] < shape[1] or out.stride(1) != 1:
        raise ValueError(f"dequantize_tile: out {tuple(out.shape)} {out.dtype} cannot hold {shape} {dtype}")
    if shape[0] and shape[1]:
        dst = out.view(torch.int16) if dtype == torch.bfloat16 else out  # bf16 is written as its bit pattern
        grid = (_cdiv(shape[0], TILE_ROWS), _cdiv(shape[1], TILE_COLS))
        with _on(raw):
            kernels().dequant_kernel[grid](raw, dst, raw.shape[0], n_cols, row_bytes, r0, c0, shape[0], shape[1],
                                           out.stride(0), TYPE=int(ggml_type), BF16=dtype == torch.bfloat16,
                                           BR=TILE_ROWS, BC=TILE_COLS, num_warps=4)
    return out[: shape[0], : shape[1]]


def dequant_matvec(raw: torch.Tensor, ggml_type: int, n_cols: int, x: torch.Tensor,
                   round_bf16: bool = True) -> torch.Tensor:
    """`x · Wᵀ` for a few tokens, x `[T, n_cols]`, decoding W inside the product: one program per 32 output rows
    and token, fp32 accumulation, the weight rounded to bf16 first when `round_bf16` (as the tile path multiplies
    it). Returns fp32 `[T, n_rows]`."""
    row_bytes = _check(raw, ggml_type, n_cols)
    if x.dim() != 2 or x.shape[1] != n_cols:
        raise ValueError(f"dequant_matvec: x {tuple(x.shape)}, expected [tokens, {n_cols}]")
    x = x.to(torch.float32).contiguous()
    n_rows = raw.shape[0]
    y = torch.empty(x.shape[0], n_rows, dtype=torch.float32, device=raw.device)
    if x.shape[0] and n_rows:
        grid = (_cdiv(n_rows, MATVEC_ROWS), x.shape[0])
        with _on(raw):
            kernels().matvec_kernel[grid](raw, x, y, n_rows, n_cols, row_bytes, x.stride(0), y.stride(0),
                                          TYPE=int(ggml_type), ROUND_BF16=round_bf16, BN=MATVEC_ROWS,
                                          BK=MATVEC_COLS, num_warps=4)
    return y


# ---- eager references -------------------------------------------------------------------------------------------

def dequantize_reference(raw: torch.Tensor, ggml_type: int, n_cols: int,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The torch codec's fp32 values (on the CPU), cast to `dtype` (torch rounds to nearest even)."""
    w = quants.dequantize(ggml_type, raw.detach().cpu(), n_cols)
    return w if dtype == torch.float32 else w.to(dtype)


def matvec_reference(raw: torch.Tensor, ggml_type: int, n_cols: int, x: torch.Tensor,
                     round_bf16: bool = True) -> torch.Tensor:
    """fp64 `x · Wᵀ` over the codec's values (rounded to bf16 first when `round_bf16`)."""
    w = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16 if round_bf16 else torch.float32)
    return x.detach().cpu().double() @ w.double().T


__all__ = ["TRITON_TYPES", "OUT_DTYPES", "triton_ready", "has_kernel", "interpreting", "dequantize_tile",
           "dequant_matvec", "dequantize_reference", "matvec_reference"]
