"""Dequantization of GGML blocks on the device (Triton), beside its eager torch reference.

`dequantize_tile` decodes any rectangle of a quantized weight (rows and columns, no alignment needed) straight
from its bytes into bf16 or fp32: the GPU frozen linear multiplies such tiles with cuBLAS at training token
counts. `dequantize_split_tile` writes both bf16 halves of each value (w_hi = bf16(w), w_lo = bf16(w − w_hi)) in
one pass, for products that need fp32 accuracy on bf16 tensor cores (DoRA's U = W·Aᵀ) beside the bf16 one.
`dequant_matvec` fuses decoding into a matrix-vector product for a few tokens (playback decode), where writing a
dequantized tile would cost more than the product: the GEMV of `matvec_triton` for the types playback meets
(`GEMV_TYPES`, configured per type by `MATVEC_CONFIG` and JUNO_PY_GEMV), `dequant_triton.matvec_kernel` for the
others. `dequant_matvec_group` runs the GEMV of 2 or 3 matrices that read one x in one launch (optionally with the
gated activation of gate and up), bit for bit the separate unsplit launches. The kernels live in `dequant_triton`
and `matvec_triton`, imported only when one first runs (Triton is optional; `@triton.jit` reads TRITON_INTERPRET
when a kernel is defined).

Numerics: every block type decodes as `code · scale (+ bias)` where the products are exact in fp32 (an f16
scale of 11 significant bits times integers small enough that the product fits 24 bits), so only the one
addition rounds, as in the torch codecs: the fp32 values are bit-identical to `juno_py.gguf.quants.dequantize`
(a fused multiply-add changes nothing, since the product is exact, except where it overflows: MXFP4's largest
scales, whose split low halves are set to NaN outright). fp32 → bf16 rounds to nearest even with
integer operations on the bit pattern (NaN → 0x7FC0, as torch): Triton's interpreter truncates on a float cast
while the GPU rounds, and this way both give torch's `.to(torch.bfloat16)`. The variants with bit 1 (`variants`)
round with the cast on the GPU (to nearest even too, NaN → 0x7FFF; the integer operations under the interpreter).
The split halves are rounded the same way; w − w_hi is exact in fp32, so w_lo is `kernels.split_bf16`'s, bit for
bit.

Types with a kernel: `TRITON_TYPES`. Every other type decodes through the torch codecs (on the CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
from typing import Optional, Sequence

import torch

from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType
from juno_py.kernels import split_bf16
from juno_py.kernels.launch import interpreting, launch, row_warps

# the codebook types read their grid points from a table on the device (`_grid_table`)
CODEBOOK_TYPES = frozenset(
    {
        GGMLType.IQ1_S,
        GGMLType.IQ1_M,
        GGMLType.IQ2_XXS,
        GGMLType.IQ2_XS,
        GGMLType.IQ2_S,
        GGMLType.IQ3_XXS,
        GGMLType.IQ3_S,
    }
)
# the non-linear 4-bit types read their 16 int8 levels from a table on the device
LEVEL_TYPES = frozenset({GGMLType.IQ4_NL, GGMLType.IQ4_XS})
TRITON_TYPES = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
        GGMLType.TQ1_0,
        GGMLType.TQ2_0,
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.IQ4_NL,
        GGMLType.IQ4_XS,
    }
    | CODEBOOK_TYPES
    | ({GGMLType.MXFP4} if "MXFP4" in quants.supported_types() else set())
)
OUT_DTYPES = (torch.bfloat16, torch.float32)

# values per block as the kernels cut rows (float types: 256 columns a block), and per type (decode: blocks a program
# NB, warps; matvec: rows a program BN, blocks a step KB): a default by block size, then (below) the settings
# `benchmarks/dequant_gpu.py --sweep` chose on the H200 for every type.
KERNEL_BLOCK = {GGMLType.F32: 256, GGMLType.F16: 256, GGMLType.BF16: 256}
KERNEL_CONFIG = {t: ((128, 4, 16, 8) if GGML_BLOCK_SIZES[t][0] == 32 else (8, 4, 16, 1)) for t in TRITON_TYPES}
# the types whose VARIANT 1 decodes in `_grouped`'s layouts (fields read once per group of values and broadcast)
GROUPED_TYPES = frozenset(
    {GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS}
    | CODEBOOK_TYPES
    | ({GGMLType.MXFP4} if GGMLType.MXFP4 in TRITON_TYPES else set())
)
# the layout variant (`dequant_kernel`'s VARIANT, see `variants`) the decode and the matvec use, per type
KERNEL_VARIANT: dict[int, int] = {t: 0 for t in TRITON_TYPES}
MATVEC_VARIANT: dict[int, int] = {t: 0 for t in TRITON_TYPES}
# chosen by `python -m benchmarks.dequant_gpu --sweep` on 1 x NVIDIA H200; Intel(R) Xeon(R) Processor, 16 CPUs
KERNEL_CONFIG.update(
    {
        GGMLType.F32: (8, 4, 16, 1),
        GGMLType.F16: (8, 4, 16, 1),
        GGMLType.Q4_0: (128, 4, 16, 8),
        GGMLType.Q4_1: (128, 4, 16, 8),
        GGMLType.Q5_0: (128, 4, 16, 8),
        GGMLType.Q5_1: (64, 4, 16, 8),
        GGMLType.Q8_0: (256, 8, 16, 8),
        GGMLType.Q2_K: (8, 4, 16, 1),
        GGMLType.Q3_K: (16, 4, 16, 1),
        GGMLType.Q4_K: (32, 4, 16, 1),
        GGMLType.Q5_K: (8, 4, 16, 1),
        GGMLType.Q6_K: (8, 4, 16, 1),
        GGMLType.IQ2_XXS: (4, 1, 16, 1),
        GGMLType.IQ2_XS: (4, 1, 16, 1),
        GGMLType.IQ3_XXS: (4, 2, 16, 1),
        GGMLType.IQ1_S: (4, 1, 16, 1),
        GGMLType.IQ4_NL: (128, 4, 16, 8),
        GGMLType.IQ3_S: (4, 2, 16, 1),
        GGMLType.IQ2_S: (4, 1, 16, 1),
        GGMLType.IQ4_XS: (32, 4, 16, 1),
        GGMLType.IQ1_M: (4, 1, 16, 1),
        GGMLType.BF16: (8, 4, 16, 1),
        GGMLType.TQ1_0: (8, 2, 16, 1),
        GGMLType.TQ2_0: (16, 4, 16, 1),
        GGMLType.MXFP4: (256, 4, 16, 8),
    }
)
KERNEL_VARIANT.update(
    {
        GGMLType.F32: 0,
        GGMLType.F16: 2,
        GGMLType.Q4_0: 2,
        GGMLType.Q4_1: 3,
        GGMLType.Q5_0: 2,
        GGMLType.Q5_1: 3,
        GGMLType.Q8_0: 3,
        GGMLType.Q2_K: 3,
        GGMLType.Q3_K: 3,
        GGMLType.Q4_K: 3,
        GGMLType.Q5_K: 2,
        GGMLType.Q6_K: 2,
        GGMLType.IQ2_XXS: 7,
        GGMLType.IQ2_XS: 7,
        GGMLType.IQ3_XXS: 7,
        GGMLType.IQ1_S: 7,
        GGMLType.IQ4_NL: 2,
        GGMLType.IQ3_S: 7,
        GGMLType.IQ2_S: 7,
        GGMLType.IQ4_XS: 2,
        GGMLType.IQ1_M: 7,
        GGMLType.BF16: 2,
        GGMLType.TQ1_0: 3,
        GGMLType.TQ2_0: 3,
        GGMLType.MXFP4: 3,
    }
)

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_kernels = None


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


_GRID_TABLES: dict = {}


def _grid_table(raw: torch.Tensor, ggml_type: int, variant: int = 0) -> torch.Tensor:
    """The int8 grid `[points, 8 or 4]` of a codebook type (as fp32 for a variant with bit 3), or the 16 levels of
    IQ4_NL/IQ4_XS, on raw's device (made once per device), or `raw` itself for the other types (their kernels never
    read it)."""
    if ggml_type not in CODEBOOK_TYPES and ggml_type not in LEVEL_TYPES:
        return raw
    floats = ggml_type in CODEBOOK_TYPES and variant & 8
    key = (int(ggml_type), raw.device, bool(floats))
    table = _GRID_TABLES.get(key)
    if table is None:
        if ggml_type in LEVEL_TYPES:
            from juno_py.gguf.quants.iquants import IQ4_LEVELS as grid
        else:
            from juno_py.gguf.quants.codebooks import GRIDS

            grid = GRIDS[GGMLType(ggml_type)]
        table = grid.to(torch.float32 if floats else torch.int8).contiguous().to(raw.device)
        _GRID_TABLES[key] = table
    return table


def variants(ggml_type: int) -> tuple[int, ...]:
    """The variants of a type's kernels (`dequant_kernel`'s VARIANT), all decoding the same bits. Bit 0 (quantized
    types): `_grouped`'s layouts for GROUPED_TYPES, and for the others the per-value layouts with 16-bit loads of
    their float16 fields; codes made fp32 with integer and float additions rather than conversions, and one
    division a program to find the rows of its blocks; bit 1: bf16 rounded by the GPU's float cast (two values an instruction) rather than with
    integer operations (under the interpreter, whose cast truncates, the integer operations still). Codebook
    types only, with bit 0: bit 2 reads each grid row as one word and its bytes by shifts, bit 3 reads the points
    from an fp32 copy of the grid (no integer work a value); see `dequant_triton._grid_points`."""
    if int(ggml_type) in KERNEL_BLOCK:
        return (0, 2)
    if int(ggml_type) in CODEBOOK_TYPES:
        return (0, 1, 2, 3, 5, 7, 9, 11)
    return (0, 1, 2, 3)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _on(t: torch.Tensor):
    """The device guard of a launch on t's device: none where it is already the current one (a guard costs CPU
    time every launch)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _geometry(ggml_type: int) -> tuple[int, int]:
    """(values, bytes) of one block as the kernels see it: float types are cut into blocks of 256 columns."""
    block, size = GGML_BLOCK_SIZES[ggml_type]
    b = KERNEL_BLOCK.get(ggml_type, block)
    return b, b // block * size


def _row_alignment(row_bytes: int) -> int:
    """The largest power of two up to 16 that divides a row's bytes: passed to the kernel as a compile-time factor
    of the row stride, so the compiler knows how wide the loads of a block may be."""
    return math.gcd(row_bytes, 16)


def _aligned(raw: torch.Tensor, ggml_type: int, variant: int = 0) -> torch.Tensor:
    """`raw`, or an aligned copy of it when its first byte is not aligned to the float type's element size (the
    float kernels read whole elements) or, for an odd variant of a block type of even size, to 2 (it reads 16-bit
    fields)."""
    size = GGML_BLOCK_SIZES[ggml_type][1]
    if ggml_type not in KERNEL_BLOCK:
        size = 2 if variant % 2 and size % 2 == 0 else 1
    return raw if raw.data_ptr() % size == 0 else raw.clone()


def _check(raw: torch.Tensor, ggml_type: int, n_cols: int) -> int:
    if not has_kernel(ggml_type):
        raise ValueError(f"no Triton kernel for GGML type {GGMLType(ggml_type).name}")
    block, size = GGML_BLOCK_SIZES[ggml_type]
    row_bytes = n_cols // block * size
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes or n_cols % block:
        raise ValueError(
            f"raw bytes {tuple(raw.shape)} {raw.dtype}: expected uint8 [rows, {row_bytes}] for "
            f"{n_cols} {GGMLType(ggml_type).name} columns"
        )
    if not raw.is_contiguous():
        raise ValueError("raw bytes must be contiguous rows")
    return row_bytes


def _rectangle(
    raw: torch.Tensor,
    ggml_type: int,
    n_cols: int,
    rows: Optional[tuple[int, int]],
    cols: Optional[tuple[int, int]],
    what: str,
) -> tuple[int, int, int, int, int]:
    """(row_bytes, r0, r1, c0, c1) of a rectangle of W, checked against the bytes."""
    row_bytes = _check(raw, ggml_type, n_cols)
    r0, r1 = rows or (0, raw.shape[0])
    c0, c1 = cols or (0, n_cols)
    if not (0 <= r0 <= r1 <= raw.shape[0] and 0 <= c0 <= c1 <= n_cols):
        raise ValueError(f"{what}: rows {r0}:{r1}, cols {c0}:{c1} outside [{raw.shape[0]}, {n_cols}]")
    return row_bytes, r0, r1, c0, c1


def _decode(
    raw: torch.Tensor,
    ggml_type: int,
    n_cols: int,
    row_bytes: int,
    r0: int,
    r1: int,
    c0: int,
    c1: int,
    dst: torch.Tensor,
    lo_dst: Optional[torch.Tensor],
    stride: int,
    bf16: bool,
) -> None:
    """Launch `dequant_kernel` over W[r0:r1, c0:c1] into `dst` (and its w_lo halves into `lo_dst`: the split
    variant), both with row stride `stride`; bf16 outputs are int16 views."""
    if r1 == r0 or c1 == c0:
        return
    variant = KERNEL_VARIANT[ggml_type]
    raw = _aligned(raw, ggml_type, variant)
    B, block_bytes = _geometry(ggml_type)
    blk0 = c0 // B
    n_blk = _cdiv(c1, B) - blk0
    nb, warps = KERNEL_CONFIG[ggml_type][:2]
    ra = _row_alignment(row_bytes)
    with _on(raw):
        launch(
            kernels().dequant_kernel,
            (_cdiv((r1 - r0) * n_blk, nb),),
            (
                raw,
                _grid_table(raw, ggml_type, variant),
                dst,
                dst if lo_dst is None else lo_dst,
                row_bytes // ra,
                r0,
                blk0,
                n_blk,
                r1 - r0,
                c0,
                c1,
                stride,
            ),
            warps,
            TYPE=int(ggml_type),
            B=B,
            BLOCK_BYTES=block_bytes,
            RA=ra,
            BF16=bf16,
            EDGES=bool(c0 % B or c1 % B),
            NB=nb,
            SPLIT=lo_dst is not None,
            VARIANT=variant,
        )


def dequantize_tile(
    raw: torch.Tensor,
    ggml_type: int,
    n_cols: int,
    rows: Optional[tuple[int, int]] = None,
    cols: Optional[tuple[int, int]] = None,
    dtype: torch.dtype = torch.bfloat16,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """W[r0:r1, c0:c1] decoded from `raw` (uint8 `[n_rows, row_bytes]`, on the device the kernel runs on) into
    `dtype`: bf16 (the exact value rounded to nearest even) or fp32 (exact). `out`: a buffer to write into (its
    leading rows and columns; any row stride)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize_tile: dtype {dtype}, expected torch.bfloat16 or torch.float32")
    row_bytes, r0, r1, c0, c1 = _rectangle(raw, ggml_type, n_cols, rows, cols, "dequantize_tile")
    shape = (r1 - r0, c1 - c0)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif out.dtype != dtype or out.shape[0] < shape[0] or out.shape[1] < shape[1] or out.stride(1) != 1:
        raise ValueError(f"dequantize_tile: out {tuple(out.shape)} {out.dtype} cannot hold {shape} {dtype}")
    bf16 = dtype == torch.bfloat16
    _decode(
        raw,
        ggml_type,
        n_cols,
        row_bytes,
        r0,
        r1,
        c0,
        c1,
        out.view(torch.int16) if bf16 else out,
        None,
        out.stride(0),
        bf16,
    )
    return out[: shape[0], : shape[1]]


def dequantize_split_tile(
    raw: torch.Tensor,
    ggml_type: int,
    n_cols: int,
    rows: Optional[tuple[int, int]] = None,
    cols: Optional[tuple[int, int]] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """W[r0:r1, c0:c1] decoded once into both bf16 halves of each value, `[2, r1 − r0, c1 − c0]` bf16: [0] is
    w_hi = bf16(w) (bit-identical to `dequantize_tile(..., dtype=bf16)`), [1] is w_lo = bf16(w − w_hi), each rounded
    to nearest even; w_hi + w_lo is within 2⁻¹⁶ of w (about 2⁻¹⁷ on average). The same values as
    `kernels.split_bf16` of the fp32 tile, without writing the fp32 tile and reading it back. `out`: a bf16 buffer
    `[2, ≥ rows, ≥ cols]` to write into (its leading rows and columns; any row stride)."""
    row_bytes, r0, r1, c0, c1 = _rectangle(raw, ggml_type, n_cols, rows, cols, "dequantize_split_tile")
    shape = (r1 - r0, c1 - c0)
    if out is None:
        out = torch.empty((2, *shape), dtype=torch.bfloat16, device=raw.device)
    elif (
        out.dtype != torch.bfloat16
        or out.dim() != 3
        or out.shape[0] != 2
        or out.shape[1] < shape[0]
        or out.shape[2] < shape[1]
        or out.stride(2) != 1
    ):
        raise ValueError(f"dequantize_split_tile: out {tuple(out.shape)} {out.dtype} cannot hold 2×{shape} bf16")
    bits = out.view(torch.int16)
    _decode(raw, ggml_type, n_cols, row_bytes, r0, r1, c0, c1, bits[0], bits[1], out.stride(1), True)
    return out[:, : shape[0], : shape[1]]


# the types with the dedicated GEMV (`matvec_triton`), and its configuration per type: (rows a program BR, blocks
# of each row a step KB, warps, split-K). `benchmarks/gemv_gpu.py --sweep` times the candidates on the GPU
# and prints the best as a JUNO_PY_GEMV value; that variable (`TYPE=BR,KB,WARPS,SPLIT;...`) overrides this table.
# Q8_0: the sweep's winner on the H200; Q4_K and Q6_K: the best decode step of the Llama-3-8B-shaped Q4_K_M model,
# Q4_1 of the SmolLM2-135M-shaped Q4_1 model (`benchmarks/decode_gpu.py`, JUNO_PY_GEMV over the sweep's leaders) on
# the H100, where the sweep's total, each shape counted once, misweighs a model's products (ffn_down's 4096x14336
# comes 32 times a token, the output once); Q4_0 and Q5_K (not swept): configs whose sm_90 compile
# (`benchmarks/gemv_compile.py`) exchanges no step values through shared memory
GEMV_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
# the GEMV types whose split-K gives the same bits every launch on the H200; Q4_0 and Q4_1 did not (within the fp32
# bound, but not repeatable), so they always run unsplit
SPLIT_K_TYPES = frozenset({GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
MATVEC_CONFIG: dict[int, tuple[int, int, int, int]] = {
    GGMLType.Q4_0: (4, 8, 4, 1),
    GGMLType.Q4_1: (1, 32, 4, 1),
    GGMLType.Q8_0: (4, 8, 2, 1),
    GGMLType.Q4_K: (8, 1, 2, 4),
    GGMLType.Q5_K: (4, 2, 4, 1),
    GGMLType.Q6_K: (4, 2, 2, 1),
}
# how the GEMV turns codes into floats and rounds the weights to bf16: its decode, not its bytes, bounds it on the
# GPU (about 28 fp32-issue slots a weight with a quarter-rate integer-to-float conversion and a rounding made of
# seven integer operations). MAGIC: codes through the float bits of 2²³ + q (an OR and a subtraction, exact);
# HW_ROUND: the hardware's fp32 -> bf16 conversion (nearest even, as the integer rounding; the interpreter's cast
# truncates, so there the integer rounding stays). Both give the same bits as the plain operations.
GEMV_MAGIC_CODES = True
GEMV_HW_ROUND = True
_GEMV_ENV = "JUNO_PY_GEMV"
_gemv_env_read = False


def parse_gemv_config(text: str) -> dict[int, tuple[int, int, int, int]]:
    """`TYPE=BR,KB,WARPS,SPLIT;...` (e.g. `Q4_K=2,2,4,1;Q6_K=4,1,4,2`) as {type: config}; ValueError naming the
    entry otherwise. BR, KB and WARPS are powers of two; SPLIT ≥ 1."""
    out: dict[int, tuple[int, int, int, int]] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        name, _, values = item.partition("=")
        try:
            t = GGMLType[name.strip()]
            cfg = tuple(int(v) for v in values.split(","))
        except (KeyError, ValueError):
            cfg, t = (), None
        if t not in GEMV_TYPES or len(cfg) != 4 or any(v < 1 for v in cfg) or any(v & (v - 1) for v in cfg[:3]):
            raise ValueError(
                f"{_GEMV_ENV}: {item!r}: expected TYPE=BR,KB,WARPS,SPLIT with TYPE one of "
                f"{', '.join(sorted(GGMLType(t).name for t in GEMV_TYPES))}, BR, KB, WARPS powers of two, SPLIT >= 1"
            )
        out[int(t)] = (cfg[0], cfg[1], cfg[2], cfg[3])
    return out


def gemv_config(ggml_type: int) -> tuple[int, int, int, int]:
    """The GEMV configuration of a type: `MATVEC_CONFIG`, with JUNO_PY_GEMV's entries over it (read once)."""
    global _gemv_env_read
    if not _gemv_env_read:
        import os

        MATVEC_CONFIG.update(parse_gemv_config(os.environ.get(_GEMV_ENV, "")))
        _gemv_env_read = True
    return MATVEC_CONFIG[ggml_type]


_gemv_module = None


def gemv_kernels():
    """The `matvec_triton` module (imported on first use)."""
    global _gemv_module
    if _gemv_module is None:
        _gemv_module = importlib.import_module("juno_py.kernels.matvec_triton")
    return _gemv_module


def _words(raw: torch.Tensor, word: int) -> torch.Tensor:
    """raw's bytes viewed as `word`-byte integers (a copy where its first byte is not so aligned)."""
    if raw.data_ptr() % word:
        raw = raw.clone()
    return raw.view(torch.int32 if word == 4 else torch.int16)


def dequant_matvec(
    raw: torch.Tensor,
    ggml_type: int,
    n_cols: int,
    x: torch.Tensor,
    round_bf16: bool = True,
    out_dtype: torch.dtype = torch.float32,
    config: Optional[tuple[int, int, int, int]] = None,
    lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
) -> torch.Tensor:
    """`x · Wᵀ` for a few tokens, x `[T, n_cols]` (any float dtype; read as it is, widened to fp32 exactly),
    decoding W inside the product with fp32 accumulation, the weight rounded to bf16 first when `round_bf16` (as
    the tile path multiplies it). Returns `[T, n_rows]` in `out_dtype` (fp32, or bf16 rounded to nearest even from
    the fp32 sum). The GEMV types (`GEMV_TYPES`) at 1 to 4 tokens take `matvec_triton.gemv_kernel` with the type's
    `gemv_config` (or `config`: (BR, KB, warps, split-K)); the others, and more tokens, `dequant_triton.matvec_kernel`
    (one program per rows and token), converted to `out_dtype` after. `lora`: (xa `[T, r]`, B `[n_rows, r]`,
    alpha), a LoRA term alpha · xa · Bᵀ added to the fp32 sums before they are rounded (the GEMV types at 1 to 4
    tokens only: `gemv_takes`)."""
    row_bytes = _check(raw, ggml_type, n_cols)
    if x.dim() != 2 or x.shape[1] != n_cols:
        raise ValueError(f"dequant_matvec: x {tuple(x.shape)}, expected [tokens, {n_cols}]")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"dequant_matvec: out_dtype {out_dtype}, expected torch.bfloat16 or torch.float32")
    n_rows, tokens = raw.shape[0], x.shape[0]
    if gemv_takes(ggml_type, tokens) and n_rows:
        cfg = config or gemv_config(ggml_type)
        return _gemv(raw, ggml_type, n_cols, row_bytes, x, round_bf16, out_dtype, cfg, lora)
    if lora is not None:
        raise ValueError(f"dequant_matvec: a LoRA term needs the GEMV (1 to 4 tokens of {sorted(GEMV_TYPES)})")
    x = x.to(torch.float32).contiguous()
    y = torch.empty(tokens, n_rows, dtype=torch.float32, device=raw.device)
    if tokens and n_rows:
        variant = MATVEC_VARIANT[ggml_type]
        raw = _aligned(raw, ggml_type, variant)
        B, block_bytes = _geometry(ggml_type)
        _, _, bn, kb = KERNEL_CONFIG[ggml_type]
        ra = _row_alignment(row_bytes)
        grid = (_cdiv(n_rows, bn), tokens)
        with _on(raw):
            launch(
                kernels().matvec_kernel,
                grid,
                (
                    raw,
                    _grid_table(raw, ggml_type, variant),
                    x,
                    y,
                    n_rows,
                    n_cols,
                    _cdiv(n_cols, B),
                    row_bytes // ra,
                    x.stride(0),
                    y.stride(0),
                ),
                4,
                TYPE=int(ggml_type),
                B=B,
                BLOCK_BYTES=block_bytes,
                RA=ra,
                ROUND_BF16=round_bf16,
                BN=bn,
                KB=kb,
                VARIANT=variant,
            )
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def gemv_takes(ggml_type: int, tokens: int) -> bool:
    """Whether `dequant_matvec` of `tokens` tokens of this type runs the GEMV (and can add a LoRA term)."""
    return ggml_type in GEMV_TYPES and 0 < tokens <= 4


def _gemv_x(x: torch.Tensor, word: int, n_cols: int) -> tuple[torch.Tensor, int, int, bool]:
    """(x as the GEMV reads it, its row stride in those elements, XI, XPACK): bf16 x as words of the XI values one
    weight word's part multiplies (`_dot`'s XPACK) where its alignment allows, else x itself (unit column stride)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    xi = word
    xpack = x.dtype == torch.bfloat16 and x.stride(0) % xi == 0 and x.data_ptr() % (2 * xi) == 0 and n_cols % xi == 0
    if not xpack:
        return x, x.stride(0), xi, False
    return x.view(torch.int64 if xi == 4 else torch.int32), x.stride(0) // xi, xi, True


def _lora_args(
    lora: Optional[tuple[torch.Tensor, torch.Tensor, float]], x: torch.Tensor, n_rows: int, what: str
) -> tuple[tuple, int]:
    """The GEMV's LoRA arguments (xa, B, alpha, rank, xa's and B's row strides) and RP (a power of two ≥ the rank;
    0 without a term, whose arguments are then placeholders the kernel never reads), checked against `x`'s tokens
    and the `n_rows` rows."""
    if lora is None:
        return (x, x, 0.0, 0, 0, 0), 0
    xa, lb, alpha = lora
    tokens, rank = x.shape[0], xa.shape[-1]
    if xa.shape != (tokens, rank) or lb.shape != (n_rows, rank) or xa.stride(-1) != 1 or lb.stride(-1) != 1:
        raise ValueError(
            f"{what}: LoRA xa {tuple(xa.shape)} and B {tuple(lb.shape)}: expected [{tokens}, r] and "
            f"[{n_rows}, r] with contiguous rows"
        )
    return (xa, lb, float(alpha), rank, xa.stride(0), lb.stride(0)), max(2, 1 << (rank - 1).bit_length())


def _gemv(
    raw: torch.Tensor,
    ggml_type: int,
    n_cols: int,
    row_bytes: int,
    x: torch.Tensor,
    round_bf16: bool,
    out_dtype: torch.dtype,
    config: tuple[int, int, int, int],
    lora: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
) -> torch.Tensor:
    mod = gemv_kernels()
    t = int(ggml_type)
    br, kb, warps, split = config
    if t not in SPLIT_K_TYPES:
        split = 1
    word = mod.WORD_BYTES[t]
    rw = _words(raw, word)
    n_rows, tokens = raw.shape[0], x.shape[0]
    xk, x_stride, xi, xpack = _gemv_x(x, word, n_cols)
    block = mod.BLOCK_VALUES[t]
    n_blk = n_cols // block
    split_blk = _cdiv(_cdiv(n_blk, max(1, split)), kb) * kb
    split = _cdiv(n_blk, split_blk)
    row_words = row_bytes // word
    ra = math.gcd(row_words, 16 // word)
    even = n_blk % kb == 0 and split_blk % kb == 0
    y = torch.empty(tokens, n_rows, dtype=out_dtype, device=raw.device)
    y_bits = y.view(torch.int16) if out_dtype == torch.bfloat16 else y
    grid = (_cdiv(n_rows, br), split)
    extra, rp = _lora_args(lora, x, n_rows, "dequant_matvec")
    consts = dict(
        TYPE=t,
        B=block,
        BLOCK_WORDS=mod.BLOCK_WORDS[t],
        RA=ra,
        T=tokens,
        ROUND_BF16=bool(round_bf16),
        OUT_BF16=out_dtype == torch.bfloat16,
        EVEN=even,
        MAGIC=GEMV_MAGIC_CODES,
        HW_ROUND=GEMV_HW_ROUND and not interpreting(),
        NPART=mod.PARTS[t],
        XI=xi,
        XPACK=xpack,
        RP=rp,
        BR=br,
        KB=kb,
    )
    with _on(raw):
        if split == 1:
            args = (raw, rw, xk, y_bits, n_rows, n_blk, split_blk, row_words // ra, x_stride, y.stride(0), *extra)
            launch(mod.gemv_kernel, grid, args, warps, PARTIAL=False, **consts)
        else:
            part = torch.empty(split, tokens, n_rows, dtype=torch.float32, device=raw.device)
            args = (raw, rw, xk, part, n_rows, n_blk, split_blk, row_words // ra, x_stride, 0, *extra)
            launch(mod.gemv_kernel, grid, args, warps, PARTIAL=True, **{**consts, "RP": 0})
            n = tokens * n_rows
            launch(
                mod.gemv_finish_kernel,
                (_cdiv(n, 1024 // max(rp, 1)),),
                (part, y_bits, n_rows, n, y.stride(0), *extra),
                4,
                SPLIT=split,
                OUT_BF16=out_dtype == torch.bfloat16,
                RP=rp,
                BLOCK=1024 // max(rp, 1),
            )
    return y


# the gated activations the grouped GEMV can apply to gate and up (`elementwise_triton.ACTIVATIONS`), as its ACT
GEMV_GROUP_ACTS = {"silu": 1, "gelu_tanh": 2}
GroupPart = tuple[torch.Tensor, int, int, Optional[tuple[torch.Tensor, torch.Tensor, float]]]


def gemv_group_takes(ggml_types: Sequence[int], n_cols: Sequence[int], tokens: int) -> bool:
    """Whether `dequant_matvec_group` takes these parts: 2 or 3 of one GEMV type and one width, 1 to 4 tokens."""
    return (
        2 <= len(ggml_types) <= 3
        and len(n_cols) == len(ggml_types)
        and len(set(ggml_types)) == 1
        and len(set(n_cols)) == 1
        and gemv_takes(ggml_types[0], tokens)
    )


def dequant_matvec_group(
    parts: Sequence[GroupPart],
    x: torch.Tensor,
    round_bf16: bool = True,
    out_dtype: torch.dtype = torch.float32,
    act: Optional[str] = None,
    config: Optional[tuple[int, int, int, int]] = None,
) -> torch.Tensor:
    """`x · W_iᵀ` of 2 or 3 matrices that read the same x `[T ≤ 4, n_cols]`, in one launch
    (`matvec_triton.gemv_group_kernel`). parts: (raw, ggml_type, n_cols, lora or None) each, one GEMV type and one
    n_cols for all, lora = (xa `[T, r]`, B `[n_rows, r]`, alpha) as in `dequant_matvec`. Returns `[T, Σ n_rows]` in
    `out_dtype`, part i's columns after those of the parts before it; each part bit for bit what `dequant_matvec`
    gives with the same configuration unsplit (`config`, else the type's `gemv_config`, split-K forced to 1). `act`
    ("silu" or "gelu_tanh"; two parts of equal rows, gate then up): `[T, n_rows]` holding act(gate)·up, bit for bit
    `elementwise_triton.gated_forward` of the two products as `dequant_matvec` stores them."""
    what = "dequant_matvec_group"
    if not 2 <= len(parts) <= 3:
        raise ValueError(f"{what}: {len(parts)} parts, expected 2 or 3")
    types = sorted({int(p[1]) for p in parts})
    if len(types) != 1:
        raise ValueError(f"{what}: GGML types {[GGMLType(t).name for t in types]}, expected one type for all parts")
    widths = sorted({int(p[2]) for p in parts})
    if len(widths) != 1:
        raise ValueError(f"{what}: n_cols {widths}, expected one width for all parts")
    t, n_cols = types[0], widths[0]
    if t not in GEMV_TYPES:
        raise ValueError(f"{what}: GGML type {GGMLType(t).name} has no GEMV (types {sorted(GEMV_TYPES)})")
    row_bytes = [_check(p[0], t, n_cols) for p in parts][0]
    if x.dim() != 2 or x.shape[1] != n_cols or not gemv_takes(t, x.shape[0]):
        raise ValueError(f"{what}: x {tuple(x.shape)}, expected [1 to 4 tokens, {n_cols}]")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{what}: out_dtype {out_dtype}, expected torch.bfloat16 or torch.float32")
    rows = [p[0].shape[0] for p in parts]
    if act is not None and act not in GEMV_GROUP_ACTS:
        raise ValueError(f"{what}: act {act!r}, expected None or one of {', '.join(GEMV_GROUP_ACTS)}")
    if act is not None and (len(parts) != 2 or rows[0] != rows[1]):
        raise ValueError(f"{what}: a gated activation needs two parts of equal rows (gate, up), got rows {rows}")
    if len({p[0].device for p in parts} | {x.device}) != 1:
        raise ValueError(
            f"{what}: parts on {[str(p[0].device) for p in parts]} and x on {x.device}, expected one device"
        )
    mod = gemv_kernels()
    br, kb, warps, _ = config or gemv_config(t)
    word = mod.WORD_BYTES[t]
    rws = [_words(p[0], word) for p in parts]
    if interpreting() and x.device.type != "cpu":
        # the interpreter copies each tensor argument to the host, where another tensor's offset means nothing: one
        # buffer holds all parts
        flat = torch.cat([rw.reshape(-1) for rw in rws]).split([rw.numel() for rw in rws])
        rws = [f.view(rw.shape) for f, rw in zip(flat, rws)]
    # parts 1 and 2 are addressed from part 0's words: each offset a whole number of words (each part word-aligned),
    # passed in units of OA words, the largest power of two up to 16 bytes dividing them all (the rows' alignment)
    offs = [rw.data_ptr() - rws[0].data_ptr() for rw in rws[1:]]
    assert all(d % word == 0 for d in offs), "word-aligned parts"
    offs = [d // word for d in offs]
    oa = 16 // word
    while any(d % oa for d in offs):
        oa //= 2
    offs = [d // oa for d in offs] + [0] * (3 - len(parts))
    tokens = x.shape[0]
    xk, x_stride, xi, xpack = _gemv_x(x, word, n_cols)
    n_blk = n_cols // mod.BLOCK_VALUES[t]
    row_words = row_bytes // word
    ra = math.gcd(row_words, 16 // word)
    # one RP for all parts (the term's sum runs in rank order, so padding leaves its bits as they are); a part
    # without a term gets rank 0 and another part's factors as placeholders (one pointer type for every part)
    loras = [_lora_args(p[3], x, n, what) for p, n in zip(parts, rows)]
    terms = [a for a, rp in loras if rp]
    if len({(a[0].dtype, a[1].dtype) for a in terms}) > 1:
        raise ValueError(
            f"{what}: LoRA factors of dtypes {[(str(a[0].dtype), str(a[1].dtype)) for a in terms]}, expected one pair"
        )
    rp = max(r for _, r in loras)
    args3 = [a if r or not terms else (terms[0][0], terms[0][1], 0.0, 0, 0, 0) for a, r in loras]
    args3 += [args3[0]] * (3 - len(parts))
    gated = act is not None
    y = torch.empty(tokens, rows[0] if gated else sum(rows), dtype=out_dtype, device=x.device)
    y_bits = y.view(torch.int16) if out_dtype == torch.bfloat16 else y
    programs = _cdiv(rows[0], br) if gated else sum(_cdiv(n, br) for n in rows)
    if not programs:
        return y
    args = (rws[0].view(torch.uint8), rws[0], xk, y_bits, *(rows + [0] * (3 - len(parts))), *offs[:2])
    args += (n_blk, row_words // ra, x_stride, y.stride(0), *args3[0], *args3[1], *args3[2])
    with _on(x):
        launch(
            mod.gemv_group_kernel,
            (programs,),
            args,
            warps,
            TYPE=t,
            B=mod.BLOCK_VALUES[t],
            BLOCK_WORDS=mod.BLOCK_WORDS[t],
            RA=ra,
            OA=oa,
            T=tokens,
            ROUND_BF16=bool(round_bf16),
            OUT_BF16=out_dtype == torch.bfloat16,
            EVEN=n_blk % kb == 0,
            MAGIC=GEMV_MAGIC_CODES,
            HW_ROUND=GEMV_HW_ROUND and not interpreting(),
            NPART=mod.PARTS[t],
            XI=xi,
            XPACK=xpack,
            NG=len(parts),
            ACT=GEMV_GROUP_ACTS[act] if gated else 0,
            RP=rp,
            BR=br,
            KB=kb,
        )
    return y


def lora_xa(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """`x · Aᵀ` `[1, R]` in x's dtype for one token x `[1, d]` and A `[R, d]` (bf16 or fp32, the same dtype, on the
    GPU or under the interpreter; `matvec_triton.lora_xa_kernel`): the first product of a played LoRA, fp32 sums
    rounded once. `torch.mm` elsewhere (more tokens, other dtypes or devices)."""
    if (
        x.dim() != 2
        or x.shape[0] != 1
        or A.dim() != 2
        or x.shape[1] != A.shape[1]
        or x.dtype != A.dtype
        or x.dtype not in OUT_DTYPES
        or not triton_ready(x.device)
        or x.stride(-1) != 1
        or A.stride(-1) != 1
    ):
        return x @ A.T
    mod = gemv_kernels()
    n_rows, d = A.shape
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device)
    bits = out.view(torch.int16) if x.dtype == torch.bfloat16 else out
    # one row of A a program, its whole width in one or a few steps: the product is a few microseconds of
    # latency, not of bytes, so each program issues all its loads at once
    rb, block = 1, min(4096, 1 << max(d - 1, 1).bit_length())
    with _on(x):
        launch(
            mod.lora_xa_kernel,
            (_cdiv(n_rows, rb),),
            (x, A, bits, n_rows, d, A.stride(0)),
            row_warps(block),  # add_rms's count: its fused product gives these bits
            OUT_BF16=x.dtype == torch.bfloat16,
            RB=rb,
            BLOCK=block,
        )
    return out


# ---- eager references -------------------------------------------------------------------------------------------


def dequantize_reference(
    raw: torch.Tensor, ggml_type: int, n_cols: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The torch codec's fp32 values (on the CPU), cast to `dtype` (torch rounds to nearest even)."""
    w = quants.dequantize(ggml_type, raw.detach().cpu(), n_cols)
    return w if dtype == torch.float32 else w.to(dtype)


def dequantize_split_reference(raw: torch.Tensor, ggml_type: int, n_cols: int) -> torch.Tensor:
    """The torch codec's fp32 values (on the CPU) split into their bf16 halves by `kernels.split_bf16`,
    `[2, n_rows, n_cols]`: [0] = bf16(w), [1] = bf16(w − [0])."""
    w = quants.dequantize(ggml_type, raw.detach().cpu(), n_cols)
    return split_bf16(w).view(2, *w.shape)


def matvec_reference(
    raw: torch.Tensor, ggml_type: int, n_cols: int, x: torch.Tensor, round_bf16: bool = True
) -> torch.Tensor:
    """fp64 `x · Wᵀ` over the codec's values (rounded to bf16 first when `round_bf16`)."""
    w = dequantize_reference(raw, ggml_type, n_cols, torch.bfloat16 if round_bf16 else torch.float32)
    return x.detach().cpu().double() @ w.double().T


__all__ = [
    "TRITON_TYPES",
    "OUT_DTYPES",
    "triton_ready",
    "has_kernel",
    "interpreting",
    "dequantize_tile",
    "dequantize_split_tile",
    "dequant_matvec",
    "GEMV_TYPES",
    "gemv_takes",
    "dequant_matvec_group",
    "gemv_group_takes",
    "GEMV_GROUP_ACTS",
    "MATVEC_CONFIG",
    "gemv_config",
    "parse_gemv_config",
    "dequantize_reference",
    "dequantize_split_reference",
    "matvec_reference",
]
