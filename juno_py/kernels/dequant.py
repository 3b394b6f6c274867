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
import math
import os
from typing import Optional

import torch

from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType

TRITON_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                          GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
OUT_DTYPES = (torch.bfloat16, torch.float32)

# values per block as the kernels cut rows (float types: 256 columns a block), and per type (decode: blocks a program
# NB, warps; matvec: rows a program BN, blocks a step KB). Chosen by `benchmarks/dequant_gpu.py --sweep` on the H200:
# 4096 values a program for the 32-value types, 2048 (Q4_K) or 4096 (Q5_K, Q6_K) for the K-quants.
KERNEL_BLOCK = {GGMLType.F32: 256, GGMLType.F16: 256, GGMLType.BF16: 256}
KERNEL_CONFIG = {t: ((128, 4, 16, 8) if GGML_BLOCK_SIZES[t][0] == 32 else (8, 4, 16, 1)) for t in TRITON_TYPES}
KERNEL_CONFIG.update({GGMLType.Q5_K: (16, 4, 16, 1), GGMLType.Q6_K: (16, 4, 16, 1)})

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


def _geometry(ggml_type: int) -> tuple[int, int]:
    """(values, bytes) of one block as the kernels see it: float types are cut into blocks of 256 columns."""
    block, size = GGML_BLOCK_SIZES[ggml_type]
    b = KERNEL_BLOCK.get(ggml_type, block)
    return b, b // block * size


def _row_alignment(row_bytes: int) -> int:
    """The largest power of two up to 16 that divides a row's bytes: passed to the kernel as a compile-time factor
    of the row stride, so the compiler knows how wide the loads of a block may be."""
    return math.gcd(row_bytes, 16)


def _aligned(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """`raw`, or an aligned copy of it when its first byte is not aligned to the float type's element size (the
    float kernels read whole elements)."""
    size = GGML_BLOCK_SIZES[ggml_type][1] if ggml_type in KERNEL_BLOCK else 1
    return raw if raw.data_ptr() % size == 0 else raw.clone()


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
        raw = _aligned(raw, ggml_type)
        dst = out.view(torch.int16) if dtype == torch.bfloat16 else out  # bf16 is written as its bit pattern
        B, block_bytes = _geometry(ggml_type)
        blk0 = c0 // B
        n_blk = _cdiv(c1, B) - blk0
        nb, warps = KERNEL_CONFIG[ggml_type][:2]
        ra = _row_alignment(row_bytes)
        grid = (_cdiv(shape[0] * n_blk, nb),)
        with _on(raw):
            kernels().dequant_kernel[grid](raw, dst, row_bytes // ra, r0, blk0, n_blk, shape[0], c0, c1,
                                           out.stride(0), TYPE=int(ggml_type), B=B, BLOCK_BYTES=block_bytes,
                                           RA=ra, BF16=dtype == torch.bfloat16,
                                           EDGES=bool(c0 % B or c1 % B), NB=nb, num_warps=warps)
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
        raw = _aligned(raw, ggml_type)
        B, block_bytes = _geometry(ggml_type)
        _, _, bn, kb = KERNEL_CONFIG[ggml_type]
        ra = _row_alignment(row_bytes)
        grid = (_cdiv(n_rows, bn), x.shape[0])
        with _on(raw):
            kernels().matvec_kernel[grid](raw, x, y, n_rows, n_cols, _cdiv(n_cols, B), row_bytes // ra, x.stride(0),
                                          y.stride(0), TYPE=int(ggml_type), B=B, BLOCK_BYTES=block_bytes, RA=ra,
                                          ROUND_BF16=round_bf16, BN=bn, KB=kb, num_warps=4)
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
