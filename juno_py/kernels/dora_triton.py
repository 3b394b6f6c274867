"""Fused Triton kernels for DoRA's composition `y = g·(base + s·lora)` and its norm assembly.

Each kernel has an eager torch reference in `juno_py.kernels.reference` (`compose_eager`,
`norm_assemble_eager`); `docs/kernels.md` states their numerics. g and all arithmetic are fp32; base, lora,
y, inner and the input gradients may be bf16 or fp32. A bf16 result is rounded from fp32 with integer
operations (round to nearest even), so Triton's interpreter, which truncates, writes the same bits as the GPU.

This module imports triton: `juno_py.kernels` loads it only when a fused path runs (triton is optional, and
`@triton.jit` reads TRITON_INTERPRET when the kernels are defined, i.e. when this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from juno_py.kernels import split_lo_mask
from juno_py.kernels.dequant_triton import _bf16_bits
from juno_py.kernels.launch import cdiv, interpreting, next_pow2
from juno_py.kernels.launch import launch as _launch

# Decided by triton when the kernels below were defined: CPU tensors run only under the interpreter.
INTERPRETED = interpreting()

FUSED_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _store(ptr, x, mask, TO_BF16: tl.constexpr):
    """Store fp32 `x`; to bf16 (through an int16 view of the output) with integer round-to-nearest-even."""
    if TO_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # a NaN stays a (quiet) NaN instead of carrying into Inf
        tl.store(ptr, rounded.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _compose_fwd_kernel(
    base_ptr,
    lora_ptr,
    g_ptr,
    y_ptr,
    inner_ptr,
    M,
    N,
    s,
    WRITE_INNER: tl.constexpr,
    Y_BF16: tl.constexpr,
    INNER_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: the tile of rows [pid_m·BLOCK_M, +BLOCK_M) and columns [pid_n·BLOCK_N, +BLOCK_N)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    base = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lora = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = base + s * lora
    _store(y_ptr + offs, g[None, :] * inner, mask, Y_BF16)
    if WRITE_INNER:
        _store(inner_ptr + offs, inner, mask, INNER_BF16)


@triton.jit
def _compose_xa_fwd_kernel(
    base_ptr,
    xa_ptr,
    b_ptr,
    g_ptr,
    y_ptr,
    inner_ptr,
    M,
    N,
    R,
    s,
    WRITE_INNER: tl.constexpr,
    Y_BF16: tl.constexpr,
    INNER_BF16: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """`_compose_fwd_kernel` with the adapter's product formed here: lora = xa·Bᵀ over the rank (xa `[M, R]`, B
    `[N, R]`, both contiguous, tensor-core dots with fp32 accumulation; IEEE: fp32 dots without TF32, for fp32
    operands and under the interpreter, whose bf16 dot is wrong in triton 3.9, so bf16 tiles are widened first, which
    is exact), kept in
    fp32 (never rounded to xa's dtype) and added to the base tile. The [M, N] lora array is neither written nor
    read back. K_TILES (constexpr) steps of BLOCK_K rank columns."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(K_TILES):
        ks = k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < R
        a = tl.load(xa_ptr + rows64[:, None] * R + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + cols64[None, :] * R + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc=acc)
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows64[:, None] * N + cols64[None, :]
    inner = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32) + s * acc
    _store(y_ptr + offs, g[None, :] * inner, mask, Y_BF16)
    if WRITE_INNER:
        _store(inner_ptr + offs, inner, mask, INNER_BF16)


@triton.jit
def _compose_bwd_kernel(
    dy_ptr,
    g_ptr,
    inner_ptr,
    d_base_ptr,
    d_lora_ptr,
    partial_ptr,
    M,
    N,
    s,
    WRITE_D_BASE: tl.constexpr,
    WRITE_D_LORA: tl.constexpr,
    REDUCE_D_G: tl.constexpr,
    D_BASE_BF16: tl.constexpr,
    D_LORA_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
):
    """d_base = g·dy, d_lora = g·s·dy over TILES row tiles of BLOCK_M rows, and this row group's partial
    Σ inner·dy per column (stage one of d_g). TILES is a constexpr power of two: a compile-time loop bound
    (Triton 3.6's interpreter cannot loop over a runtime one) with few variants whatever the token count."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    row0 = tl.program_id(1) * (TILES * BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES):
        rows = row0 + t * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # both loads before the stores: the compiler cannot tell that the outputs do not alias inner, so a load
        # after a store waits for it (82 % of the copy's bandwidth with d_lora, 96 % loaded first: H200, bf16)
        if REDUCE_D_G:
            inner = tl.load(inner_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            acc += inner * dy
        d_inner = g[None, :] * dy
        if WRITE_D_BASE:
            _store(d_base_ptr + offs, d_inner, mask, D_BASE_BF16)
        if WRITE_D_LORA:
            _store(d_lora_ptr + offs, d_inner * s, mask, D_LORA_BF16)
    if REDUCE_D_G:
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _norm_assemble_kernel(base_sq_ptr, cross_ptr, ba_sq_ptr, out_ptr, n, s, BLOCK: tl.constexpr):
    """‖W + sBA‖_row = sqrt(max(‖W‖² + 2s·cross + s²·‖BA‖², 0)), fp32, correctly rounded square root."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    base_sq = tl.load(base_sq_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    cross = tl.load(cross_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    ba_sq = tl.load(ba_sq_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    total = base_sq + (2.0 * s) * cross + (s * s) * ba_sq
    total = tl.where(total < 0.0, 0.0, total)  # rounding can push a zero row slightly negative; NaN passes through
    tl.store(out_ptr + offs, tl.sqrt_rn(total), mask=ok)


@triton.jit
def _store_norm(base_sq_ptr, out_ptr, rows, row_ok, acc, eps):
    """out[rows] = max(sqrt(max(‖W‖²_row + Σ acc_row, 0)), eps) in fp32 with the correctly rounded square root: the
    end of both row-norm kernels, `acc` `[rows, rank tile]` holding Σ_j B_ij·(2s·U_ij + s²·V_ij) by columns."""
    total = tl.load(base_sq_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) + tl.sum(acc, axis=1)
    total = tl.where(total < 0.0, 0.0, total)  # rounding can push a zero row slightly negative; NaN passes through
    norm = tl.sqrt_rn(total)
    norm = tl.where(norm < eps, eps, norm)
    tl.store(out_ptr + rows, norm, mask=row_ok)


@triton.jit
def _norm_rows_kernel(
    base_sq_ptr,
    b_ptr,
    u_ptr,
    v_ptr,
    out_ptr,
    n,
    r,
    sb0,
    sb1,
    su0,
    su1,
    sv0,
    sv1,
    two_s,
    s_sq,
    eps,
    HAS_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    R_TILES: tl.constexpr,
):
    """Rows [pid·BLOCK_D, +BLOCK_D) of ‖W + sBA‖ = sqrt(max(‖W‖² + Σ_j B_ij·(2s·U_ij + s²·V_ij), 0)), then
    max(·, eps), with U = W·Aᵀ and V = B·(A·Aᵀ), all `[n, r]` with any strides; fp32, correctly rounded sqrt.
    Without HAS_V the s² term is left out (the caller folded it into U). R_TILES (constexpr) tiles of BLOCK_R
    rank columns: a compile-time loop bound, as the interpreter needs."""
    rows = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < n
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_D, BLOCK_R], dtype=tl.float32)
    for t in range(R_TILES):
        cols = t * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = row_ok[:, None] & (cols < r)[None, :]
        c64 = cols.to(tl.int64)[None, :]
        b = tl.load(b_ptr + rows64[:, None] * sb0 + c64 * sb1, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows64[:, None] * su0 + c64 * su1, mask=mask, other=0.0).to(tl.float32)
        if HAS_V:
            v = tl.load(v_ptr + rows64[:, None] * sv0 + c64 * sv1, mask=mask, other=0.0).to(tl.float32)
            acc += b * (two_s * u + s_sq * v)
        else:
            acc += b * (two_s * u)
    _store_norm(base_sq_ptr, out_ptr, rows, row_ok, acc, eps)


@triton.jit
def _norm_rows_gram_kernel(
    base_sq_ptr,
    b_ptr,
    u_ptr,
    g_ptr,
    part_ptr,
    out_ptr,
    n,
    r,
    sb0,
    sb1,
    su0,
    su1,
    sg0,
    sg1,
    two_s,
    s_sq,
    eps,
    SPLIT: tl.constexpr,
    FINISH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
):
    """Program (i, j): rows [i·BLOCK_D, +BLOCK_D) and rank columns [j·BLOCK_R, +BLOCK_R) of ‖W + sBA‖'s sum
    Σ_c B_ic·(2s·U_ic + s²·V_ic), with the tile of V = B·G formed here over all r (tensor-core dots in 3×TF32:
    fp32 accuracy), from G = A·Aᵀ `[r, r]` or, with SPLIT, from the half Gram matrix P = [A_hi; A_lo]·A_hiᵀ of the
    split A `[2r, r]` (G = P_top + P_bot + P_botᵀ). FINISH (one rank tile): the norm itself, as `_norm_rows_kernel`
    ends; else the tile's row sums go to `part[j, rows]` for `_norm_finish_kernel`. Each program reads one column
    tile of G, so G is read n/BLOCK_D times in all, not once per row tile and column tile pair (the L2 traffic that
    bounds a one-dimensional grid of row tiles)."""
    rows = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.program_id(1)
    row_ok = rows < n
    rows64 = rows.to(tl.int64)
    cj = j * BLOCK_R + tl.arange(0, BLOCK_R)
    cj_ok = cj < r
    cj64 = cj.to(tl.int64)
    v = tl.zeros([BLOCK_D, BLOCK_R], dtype=tl.float32)
    for k in range(K_TILES):
        ck = k * BLOCK_K + tl.arange(0, BLOCK_K)
        ck_ok = ck < r
        ck64 = ck.to(tl.int64)
        b_k = tl.load(
            b_ptr + rows64[:, None] * sb0 + ck64[None, :] * sb1, mask=row_ok[:, None] & ck_ok[None, :], other=0.0
        ).to(tl.float32)
        g_mask = ck_ok[:, None] & cj_ok[None, :]
        g_offs = ck64[:, None] * sg0 + cj64[None, :] * sg1
        g = tl.load(g_ptr + g_offs, mask=g_mask, other=0.0)
        if SPLIT:  # G = A_hi·A_hiᵀ + A_lo·A_hiᵀ + (A_lo·A_hiᵀ)ᵀ from the half Gram matrix
            g += tl.load(g_ptr + g_offs + r * sg0, mask=g_mask, other=0.0)
            g += tl.load(g_ptr + (r + cj64[None, :]) * sg0 + ck64[:, None] * sg1, mask=g_mask, other=0.0)
        v = tl.dot(b_k, g.to(tl.float32), acc=v, input_precision="tf32x3")
    mask = row_ok[:, None] & cj_ok[None, :]
    b = tl.load(b_ptr + rows64[:, None] * sb0 + cj64[None, :] * sb1, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows64[:, None] * su0 + cj64[None, :] * su1, mask=mask, other=0.0).to(tl.float32)
    acc = b * (two_s * u + s_sq * v)
    if FINISH:
        _store_norm(base_sq_ptr, out_ptr, rows, row_ok, acc, eps)
    else:
        tl.store(part_ptr + j * n + rows64, tl.sum(acc, axis=1), mask=row_ok)


@triton.jit
def _norm_finish_kernel(
    base_sq_ptr, part_ptr, out_ptr, n, eps, J: tl.constexpr, J_POW: tl.constexpr, BLOCK: tl.constexpr
):
    """out[rows] from the J rank tiles' row sums `part [J, n]` of `_norm_rows_gram_kernel`, added in a fixed order."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n
    js = tl.arange(0, J_POW)
    acc = tl.load(
        part_ptr + js[None, :].to(tl.int64) * n + rows[:, None], mask=row_ok[:, None] & (js < J)[None, :], other=0.0
    )
    _store_norm(base_sq_ptr, out_ptr, rows, row_ok, acc, eps)


@triton.jit
def _split_track_kernel(
    a_ptr,
    ref_ptr,
    parts_ptr,
    d_ptr,
    n,
    k,
    row_stride,
    part_step,
    TRACK: tl.constexpr,
    COPIES: tl.constexpr,
    N_PARTS: tl.constexpr,
    LO_MASK: tl.constexpr,
    SIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Elements [pid·BLOCK, +BLOCK) of fp32 A `[n, k]` (contiguous): its bf16 parts A_hi = bf16(A) and
    A_lo = bf16(A − A_hi) into `parts` (int16 view), N_PARTS of them, part p the low one where bit p of LO_MASK is
    set: element (i, c) of part p at i·row_stride + c + p·part_step (stacked `[N_PARTS·n, k]`: row_stride k,
    part_step n·k; side by side, SIDE, `[n, N_PARTS·k]`: row_stride N_PARTS·k, part_step k). With TRACK also
    D = bf16(A − A_ref), written COPIES times along each row of `d` `[n, COPIES·k]` (int16 view), and A_ref += D in
    place. Every rounding is to nearest even with integer operations, each difference one fp32 subtraction: the
    bits of `split_bf16` and `track_delta`'s torch operations."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n * k
    a = tl.load(a_ptr + offs, mask=ok, other=0.0)
    top = _bf16_bits(a)
    low = _bf16_bits(a - (top << 16).to(tl.float32, bitcast=True))
    if SIDE or COPIES > 1:  # (a 64-bit division per element: only where the row is needed)
        row = offs // k
        col = offs - row * k
    if SIDE:
        at_part = row * row_stride + col
    else:
        at_part = offs
    for p in tl.static_range(N_PARTS):
        if (LO_MASK >> p) & 1:
            tl.store(parts_ptr + at_part + p * part_step, low.to(tl.int16), mask=ok)
        else:
            tl.store(parts_ptr + at_part + p * part_step, top.to(tl.int16), mask=ok)
    if TRACK:
        ref = tl.load(ref_ptr + offs, mask=ok, other=0.0)
        d = _bf16_bits(a - ref)
        tl.store(ref_ptr + offs, ref + (d << 16).to(tl.float32, bitcast=True), mask=ok)
        if COPIES > 1:
            at = row * (COPIES * k) + col
        else:
            at = offs
        for c in tl.static_range(COPIES):
            tl.store(d_ptr + at + c * k, d.to(tl.int16), mask=ok)


# ---- launch configuration --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Tile of one program step and warps per program; `groups_target` bounds the d_g partial buffer."""

    block_m: int = 16
    block_n: int = 256
    num_warps: int = 4
    groups_target: int = 1024  # aim for about this many programs in the backward (a few per SM on an H200)


# measured on the H200 (benchmarks/dora_layer.py --tiles, bf16, 134 M elements): every forward tile tried reads
# and writes at copy bandwidth; the backward, which loops over row tiles to keep d_g's partials few, does best
# with narrow, tall tiles (3.8 TB/s against 3.2 TB/s for 16 x 256; the copy: 4.2 TB/s)
FORWARD_CONFIG = TileConfig()
# the backward with inner loaded before its stores (H200, bf16, 134 M elements; `dora_layer.py --tiles`
# sweeps these): 32 x 128 with about 4096 programs moved 96.0 % of the copy's bandwidth with d_lora and 97.5 %
# without (about 1024 programs: 89.6 and 99.2 %; 64 x 128, 8 warps: 94.9 and 78.9 %)
BACKWARD_CONFIG = TileConfig(block_m=32, block_n=128, num_warps=4, groups_target=4096)
NORM_BLOCK = 1024
SPLIT_BLOCK = 1024  # elements of A per program of `_split_track_kernel`
NORM_ROWS_ELEMENTS = 1024  # rows × rank columns per step of `_norm_rows_kernel` (8192 rows, r 384: 512 programs)


@dataclass(frozen=True)
class NormGramConfig:
    """Tile of `_norm_rows_gram_kernel`: rows, rank columns (of V) and inner rank steps per program; warps and
    pipeline stages (None: triton's default). A rank up to `one_tile_rank` is one rank tile of `one_tile_block_d`
    rows per program: one launch, no finishing kernel.

    Defaults measured on the H200 (benchmarks/norm_gram_sweep.py, GPU time): 128 × 32 × 32 tiles ran 65 µs at
    8192 rows and r = 384 and 37 µs at 4096 rows (a one-dimensional grid of row tiles: 134 and 96 µs); r ≤ 64 keeps
    64-row tiles (2.4 and 5.0 µs at 4096 rows, r = 16 and 64; 128-row tiles were slower)."""

    block_d: int = 128
    block_r: int = 32
    block_k: int = 32
    num_warps: int = 4
    num_stages: int | None = 3
    one_tile_rank: int = 64
    one_tile_block_d: int = 64


NORM_GRAM_CONFIG = NormGramConfig()


@dataclass(frozen=True)
class ComposeXaConfig:
    """Tile of `_compose_xa_fwd_kernel`: output rows × columns, rank step, warps and pipeline stages.

    Measured on the H200 (benchmarks/compose_xa_sweep.py --sweep, bf16, with inner): 64 × 128 × 64, 4 warps, 3
    stages was the best or within 1 % of it at 4096 × 8192, r = 384 (100 µs) and 8192 × 4096, r = 16 and 384 (61 and
    99 µs); 66 against 62 µs at r = 64 (64 × 64 tiles, 4 stages). Loading the base tile before the rank loop gained
    nothing elsewhere."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int | None = 3


COMPOSE_XA_CONFIG = ComposeXaConfig()
NORM_FINISH_BLOCK = 256


def _tile(cfg: TileConfig, M: int, N: int) -> tuple[int, int]:
    # small problems get smaller tiles (fewer masked lanes; under the interpreter, less numpy work)
    return min(cfg.block_m, next_pow2(M)), min(cfg.block_n, next_pow2(N))


def _out_arg(t: torch.Tensor) -> torch.Tensor:
    """What a kernel stores into: bf16 outputs through an int16 view (integer rounding), fp32 as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _check_2d(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2 or t.dtype not in FUSED_DTYPES:
        raise ValueError(
            f"fused DoRA compose: {name} is {tuple(t.shape)} {t.dtype}, expected a 2-D float32 or bfloat16 tensor"
        )
    return t.contiguous()


def _forward_outputs(base: torch.Tensor, lora_dtype: torch.dtype, write_inner: bool):
    """(y, inner) of a composition forward: y like base, inner (when written) in the wider of base's and lora's
    dtypes, or None."""
    inner = torch.empty_like(base, dtype=torch.promote_types(base.dtype, lora_dtype)) if write_inner else None
    return torch.empty_like(base), inner


def compose_forward(
    base: torch.Tensor,
    lora: torch.Tensor,
    g: torch.Tensor,
    s: float,
    write_inner: bool = False,
    cfg: TileConfig = FORWARD_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = g·(base + s·lora) for base, lora `[M, N]` and g `[N]` fp32; also inner = base + s·lora if asked.

    y has base's dtype; inner has the wider of base's and lora's dtypes (it feeds d_g's sum)."""
    base, lora = _check_2d("base", base), _check_2d("lora", lora)
    M, N = base.shape
    if lora.shape != base.shape or g.shape != (N,) or g.dtype != torch.float32:
        raise ValueError(
            f"fused DoRA compose: base {tuple(base.shape)}, lora {tuple(lora.shape)}, g "
            f"{tuple(g.shape)} {g.dtype}: expected equal shapes and float32 g of {N} values"
        )
    g = g.contiguous()
    y, inner = _forward_outputs(base, lora.dtype, write_inner)
    if M == 0 or N == 0:
        return y, inner
    bm, bn = _tile(cfg, M, N)
    grid = (cdiv(N, bn), cdiv(M, bm))
    _launch(
        _compose_fwd_kernel,
        grid,
        (base, lora, g, _out_arg(y), _out_arg(inner) if write_inner else y, M, N, float(s)),
        cfg.num_warps,
        WRITE_INNER=write_inner,
        Y_BF16=y.dtype == torch.bfloat16,
        INNER_BF16=write_inner and inner.dtype == torch.bfloat16,
        BLOCK_M=bm,
        BLOCK_N=bn,
    )
    return y, inner


def compose_forward_xa(
    base: torch.Tensor,
    xa: torch.Tensor,
    B: torch.Tensor,
    g: torch.Tensor,
    s: float,
    write_inner: bool = False,
    cfg: ComposeXaConfig = COMPOSE_XA_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = g·(base + s·xa·Bᵀ) for base `[M, N]`, the adapter's input product xa = x·Aᵀ `[M, r]`, B `[N, r]` (xa's
    dtype) and g `[N]` fp32, with the product xa·Bᵀ formed inside the kernel in fp32; also inner = base + s·xa·Bᵀ
    if asked. What `compose_forward(base, xa @ B.T, g, s)` gives, without the [M, N] lora array (written once and
    read once there) and with lora unrounded. y has base's dtype; inner the wider of base's and xa's."""
    base, xa, B = _check_2d("base", base), _check_2d("xa", xa), _check_2d("B", B)
    M, N = base.shape
    r = xa.shape[1]
    if xa.shape[0] != M or B.shape != (N, r) or B.dtype != xa.dtype or g.shape != (N,) or g.dtype != torch.float32:
        raise ValueError(
            f"fused DoRA compose: base {tuple(base.shape)}, xa {tuple(xa.shape)} {xa.dtype}, B "
            f"{tuple(B.shape)} {B.dtype}, g {tuple(g.shape)} {g.dtype}: expected [M, N], [M, r], "
            f"[N, r] of xa's dtype and float32 g of {N} values"
        )
    if r == 0:  # no rank: the composition of a zero lora
        return compose_forward(base, torch.zeros_like(base), g, s, write_inner)
    g = g.contiguous()
    y, inner = _forward_outputs(base, xa.dtype, write_inner)
    if M == 0 or N == 0:
        return y, inner
    # tl.dot takes tiles of 16 and more in every dimension; small problems get small tiles
    bm = max(16, min(cfg.block_m, next_pow2(M)))
    bn = max(16, min(cfg.block_n, next_pow2(N)))
    bk = max(16, min(cfg.block_k, next_pow2(r)))
    grid = (cdiv(N, bn), cdiv(M, bm))
    _launch(
        _compose_xa_fwd_kernel,
        grid,
        (base, xa, B, g, _out_arg(y), _out_arg(inner) if write_inner else y, M, N, r, float(s)),
        cfg.num_warps,
        cfg.num_stages,
        WRITE_INNER=write_inner,
        Y_BF16=y.dtype == torch.bfloat16,
        INNER_BF16=write_inner and inner.dtype == torch.bfloat16,
        IEEE=xa.dtype == torch.float32 or INTERPRETED,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        K_TILES=cdiv(r, bk),
    )
    return y, inner


def compose_backward(
    dy: torch.Tensor,
    g: torch.Tensor,
    inner: torch.Tensor | None,
    s: float,
    base_dtype: torch.dtype | None,
    lora_dtype: torch.dtype | None,
    cfg: TileConfig = BACKWARD_CONFIG,
    reduce_d_g: bool = True,
):
    """(d_base, d_lora, d_g) of y = g·(base + s·lora) in one pass over dy (and inner, when d_g is wanted).

    `base_dtype` / `lora_dtype` None: that gradient is not written. `inner` None: no d_g. d_g (fp32 `[N]`) is
    reduced deterministically in two stages: each row group writes its column sums to a partial buffer
    `[groups, N]`, then torch's sum over the buffer's first dimension adds the groups (a fixed-order reduction;
    one torch op launches faster than a second Triton kernel). No atomics: the same inputs give the same bits.
    `reduce_d_g` False: the third result is the partial buffer itself, for the caller to sum over its first
    dimension later (DoRA's layer step issues its big GEMM first)."""
    dy = _check_2d("dy", dy)
    M, N = dy.shape
    d_base = torch.empty(M, N, dtype=base_dtype, device=dy.device) if base_dtype is not None else None
    d_lora = torch.empty(M, N, dtype=lora_dtype, device=dy.device) if lora_dtype is not None else None
    if M == 0 or N == 0 or (d_base is None and d_lora is None and inner is None):
        d_g = (
            torch.zeros(N if reduce_d_g else (1, N), dtype=torch.float32, device=dy.device)
            if inner is not None
            else None
        )
        return d_base, d_lora, d_g
    if inner is not None:
        inner = _check_2d("inner", inner)
    bm, bn = _tile(cfg, M, N)
    col_blocks = cdiv(N, bn)
    row_tiles = cdiv(M, bm)
    groups = max(1, min(row_tiles, cdiv(cfg.groups_target, col_blocks)))
    tiles = next_pow2(cdiv(row_tiles, groups))
    groups = cdiv(row_tiles, tiles)
    partial = torch.empty(groups, N, dtype=torch.float32, device=dy.device) if inner is not None else None
    placeholder = dy  # never touched: the constexpr flags switch its use off
    _launch(
        _compose_bwd_kernel,
        (col_blocks, groups),
        (
            dy,
            g.contiguous(),
            inner if inner is not None else placeholder,
            _out_arg(d_base) if d_base is not None else placeholder,
            _out_arg(d_lora) if d_lora is not None else placeholder,
            partial if partial is not None else placeholder,
            M,
            N,
            float(s),
        ),
        cfg.num_warps,
        WRITE_D_BASE=d_base is not None,
        WRITE_D_LORA=d_lora is not None,
        REDUCE_D_G=partial is not None,
        D_BASE_BF16=base_dtype == torch.bfloat16,
        D_LORA_BF16=lora_dtype == torch.bfloat16,
        BLOCK_M=bm,
        BLOCK_N=bn,
        TILES=tiles,
    )
    if not reduce_d_g:
        return d_base, d_lora, partial
    d_g = partial.sum(dim=0) if partial is not None else None  # stage two
    return d_base, d_lora, d_g


def norm_assemble(base_sq: torch.Tensor, cross: torch.Tensor, ba_sq: torch.Tensor, s: float) -> torch.Tensor:
    """‖W + sBA‖_row from its three factored parts (1-D, any float dtype read as fp32), fp32 `[n]`."""
    n = base_sq.numel()
    if cross.numel() != n or ba_sq.numel() != n:
        raise ValueError(
            f"fused DoRA norm: base_sq has {n} rows, cross {cross.numel()}, ba_sq {ba_sq.numel()}: "
            f"expected equal lengths"
        )
    out = torch.empty(n, dtype=torch.float32, device=base_sq.device)
    if n:
        block = min(NORM_BLOCK, next_pow2(n))
        flat = [t.reshape(-1).contiguous() for t in (base_sq, cross, ba_sq)]
        _launch(_norm_assemble_kernel, (cdiv(n, block),), (*flat, out, n, float(s)), 4, BLOCK=block)
    return out


def norm_rows(
    base_sq: torch.Tensor, B: torch.Tensor, U: torch.Tensor, V: torch.Tensor | None, s: float, eps: float = 0.0
) -> torch.Tensor:
    """max(‖W + sBA‖_row, eps) = max(sqrt(max(‖W‖² + Σ_j B_ij·(2s·U_ij + s²·V_ij), 0)), eps), fp32 `[n]`, in one
    launch: B, U = W·Aᵀ and V = B·(A·Aᵀ) are `[n, r]` fp32 or bf16 with any strides (U may be a transposed view).
    V None: no s² term (the caller folded it into U)."""
    n, r = B.shape
    if U.shape != (n, r) or (V is not None and V.shape != (n, r)) or base_sq.numel() != n:
        raise ValueError(
            f"fused DoRA norm: base_sq {tuple(base_sq.shape)}, B {tuple(B.shape)}, U {tuple(U.shape)}, "
            f"V {None if V is None else tuple(V.shape)}: expected [n] and three [n, r]"
        )
    out = torch.empty(n, dtype=torch.float32, device=B.device)
    if n == 0:
        return out
    block_r = min(64, next_pow2(max(r, 1)))
    block_d = min(max(1, NORM_ROWS_ELEMENTS // block_r), next_pow2(n))
    Vt = U if V is None else V  # never read without HAS_V
    _launch(
        _norm_rows_kernel,
        (cdiv(n, block_d),),
        (
            base_sq.reshape(-1).contiguous(),
            B,
            U,
            Vt,
            out,
            n,
            r,
            *B.stride(),
            *U.stride(),
            *Vt.stride(),
            2.0 * s,
            s * s,
            float(eps),
        ),
        4,
        HAS_V=V is not None,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        R_TILES=cdiv(r, block_r),
    )
    return out


def split_track(
    A: torch.Tensor, A_ref: Optional[torch.Tensor] = None, copies: int = 1, order: str = "hl", side: bool = False
):
    """`split_bf16(A, order, side)` in one launch (`[2n, k]` bf16 by default); with A_ref (fp32 `[n, k]`,
    contiguous) also `track_delta(A, A_ref, copies)` in the same pass: returns (parts, D), D `[n, copies·k]` bf16,
    A_ref moved by D. Bit-identical to the torch operations they replace (four or five launches)."""
    if A.dtype != torch.float32 or A.dim() != 2 or not A.is_contiguous():
        raise ValueError(f"split_track: A {tuple(A.shape)} {A.dtype}: expected a contiguous fp32 matrix")
    lo_mask = split_lo_mask(order, "split_track")
    n, k = A.shape
    track = A_ref is not None
    if track and (A_ref.shape != A.shape or A_ref.dtype != torch.float32 or not A_ref.is_contiguous()):
        raise ValueError(
            f"split_track: A_ref {tuple(A_ref.shape)} {A_ref.dtype}: expected a contiguous fp32 {tuple(A.shape)}"
        )
    m = len(order)
    shape, row_stride, step = ((n, m * k), m * k, k) if side else ((m * n, k), k, n * k)
    parts = torch.empty(*shape, dtype=torch.bfloat16, device=A.device)
    D = torch.empty(n, copies * k, dtype=torch.bfloat16, device=A.device) if track else None
    if n * k:
        _launch(
            _split_track_kernel,
            (cdiv(n * k, SPLIT_BLOCK),),
            (
                A,
                A_ref if track else A,
                parts.view(torch.int16),
                D.view(torch.int16) if track else parts,
                n,
                k,
                row_stride,
                step,
            ),
            4,
            TRACK=track,
            COPIES=copies if track else 1,
            N_PARTS=m,
            LO_MASK=lo_mask,
            SIDE=bool(side),
            BLOCK=SPLIT_BLOCK,
        )
    return (parts, D) if track else parts


def norm_rows_gram(
    base_sq: torch.Tensor,
    B: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    s: float,
    eps: float = 0.0,
    split: bool = False,
    cfg: NormGramConfig = NORM_GRAM_CONFIG,
) -> torch.Tensor:
    """`norm_rows` with V = B·G formed inside the kernel: G = A·Aᵀ fp32 `[r, r]`, or with `split` the fp32 half
    Gram matrix P = [A_hi; A_lo]·A_hiᵀ `[2r, r]` of the split A (`split_bf16`), G = P_top + P_bot + P_botᵀ. One
    launch when r fits one rank tile, else two (the tiles' row sums, then `_norm_finish_kernel`), instead of a GEMM
    for V (fp32, without tensor cores) and a row kernel."""
    n, r = B.shape
    k = 2 * r if split else r
    if U.shape != (n, r) or G.shape != (k, r) or base_sq.numel() != n or G.dtype != torch.float32:
        raise ValueError(
            f"fused DoRA norm: base_sq {tuple(base_sq.shape)}, B {tuple(B.shape)}, U {tuple(U.shape)}, "
            f"G {tuple(G.shape)} {G.dtype}: expected [n], two [n, r] and a float32 [{k}, {r}]"
        )
    out = torch.empty(n, dtype=torch.float32, device=B.device)
    if n == 0:
        return out
    r2 = max(16, next_pow2(max(r, 1)))  # tl.dot takes tiles of 16 and more
    one = r2 <= cfg.one_tile_rank
    block_r = r2 if one else max(16, min(cfg.block_r, r2))
    block_k = r2 if one else max(16, min(cfg.block_k, r2))
    block_d = max(16, min(cfg.one_tile_block_d if one else cfg.block_d, next_pow2(n)))
    J = cdiv(r, block_r)
    base_sq = base_sq.reshape(-1).contiguous()
    part = torch.empty(J, n, dtype=torch.float32, device=B.device) if J > 1 else out  # (unused with one tile)
    _launch(
        _norm_rows_gram_kernel,
        (cdiv(n, block_d), J),
        (base_sq, B, U, G, part, out, n, r, *B.stride(), *U.stride(), *G.stride(), 2.0 * s, s * s, float(eps)),
        cfg.num_warps,
        cfg.num_stages,
        SPLIT=bool(split),
        FINISH=J == 1,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        K_TILES=cdiv(r, block_k),
    )
    if J > 1:
        block = min(NORM_FINISH_BLOCK, next_pow2(n))
        _launch(
            _norm_finish_kernel,
            (cdiv(n, block),),
            (base_sq, part, out, n, float(eps)),
            4,
            J=J,
            J_POW=next_pow2(J),
            BLOCK=block,
        )
    return out


class DoraComposeFn(torch.autograd.Function):
    """Training composition: the forward writes y (and inner when g needs a gradient), the backward is one pass.

    Saved for backward: g `[N]` fp32 and, only when g requires grad, inner `[M, N]` in the wider of base's and
    lora's dtypes. Neither base nor lora is kept.
    """

    @staticmethod
    def forward(ctx, base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
        shape, N = base.shape, base.shape[-1]
        want_d_g = ctx.needs_input_grad[2]
        y, inner = compose_forward(base.reshape(-1, N), lora.reshape(-1, N), g, s, write_inner=want_d_g)
        ctx.save_for_backward(g, inner)
        ctx.s = s
        ctx.shapes = (shape, lora.shape)
        ctx.dtypes = (base.dtype, lora.dtype)
        return y.reshape(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        g, inner = ctx.saved_tensors
        need_base, need_lora, need_g = ctx.needs_input_grad[:3]
        base_shape, lora_shape = ctx.shapes
        d_base, d_lora, d_g = compose_backward(
            dy.reshape(-1, base_shape[-1]),
            g,
            inner if need_g else None,
            ctx.s,
            ctx.dtypes[0] if need_base else None,
            ctx.dtypes[1] if need_lora else None,
        )
        return (
            d_base.reshape(base_shape) if d_base is not None else None,
            d_lora.reshape(lora_shape) if d_lora is not None else None,
            d_g,
            None,
        )


__all__ = [
    "DoraComposeFn",
    "compose_forward",
    "compose_forward_xa",
    "compose_backward",
    "norm_assemble",
    "norm_rows",
    "norm_rows_gram",
    "split_track",
    "TileConfig",
    "NormGramConfig",
    "ComposeXaConfig",
    "INTERPRETED",
    "FUSED_DTYPES",
]
