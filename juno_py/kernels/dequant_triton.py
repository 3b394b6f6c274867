"""Triton kernels that decode GGML blocks (imported only when a GPU or interpreted path first runs: `@triton.jit`
reads TRITON_INTERPRET when a kernel is defined). The launch wrappers, the numerics and the eager references are
in `juno_py.kernels.dequant`.
"""

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@triton.jit
def _f16(ptr, mask):
    """The little-endian float16 at each byte address `ptr`, as fp32 (exact)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)

@triton.jit
def _k_scale_min(blk, sub, mask):
    """Q4_K/Q5_K: the 6-bit scale and minimum of sub-block `sub` (0..7) from the 12 bytes at block byte 4."""
    a = _byte(blk + 4 + sub, mask)
    b = _byte(blk + 8 + sub, mask)
    c = _byte(blk + 4 + tl.where(sub >= 4, sub - 4, sub), mask)
    low = sub < 4
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)

@triton.jit
def _dequant(raw_ptr, rows, cols, n_rows, n_cols, row_bytes, TYPE: tl.constexpr):
    """fp32 values of W[rows, cols] (`rows` [R], `cols` [C] absolute indices; out of range: 0)."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    row_base = raw_ptr + rows.to(tl.int64)[:, None] * row_bytes
    if TYPE == 0:  # F32
        p = row_base + (cols * 4)[None, :]
        bits = _byte(p, mask) | (_byte(p + 1, mask) << 8) | (_byte(p + 2, mask) << 16) | (_byte(p + 3, mask) << 24)
        v = bits.to(tl.float32, bitcast=True)
    elif TYPE == 1:  # F16
        v = _f16(row_base + (cols * 2)[None, :], mask)
    elif TYPE == 30:  # BF16
        p = row_base + (cols * 2)[None, :]
        v = ((_byte(p, mask) | (_byte(p + 1, mask) << 8)) << 16).to(tl.float32, bitcast=True)
    elif TYPE == 12 or TYPE == 13 or TYPE == 14:  # K-quants: 256 values a block
        j = (cols % 256)[None, :]
        if TYPE == 12:
            blk = row_base + (cols // 256 * 144)[None, :]
        elif TYPE == 13:
            blk = row_base + (cols // 256 * 176)[None, :]
        else:
            blk = row_base + (cols // 256 * 210)[None, :]
        if TYPE == 14:  # Q6_K: ql[128] qh[64] int8 scales[16] d
            within = j % 128
            low = (_byte(blk + (j // 128) * 64 + within % 64, mask) >> ((within // 64) * 4)) & 0xF
            high = (_byte(blk + 128 + (j // 128) * 32 + within % 32, mask) >> ((within // 32) * 2)) & 3
            sc = _byte(blk + 192 + j // 16, mask).to(tl.int8).to(tl.float32)
            scale = _f16(blk + 208, mask) * sc
            v = ((low | (high << 4)) - 32).to(tl.float32) * scale
        else:  # Q4_K: d dmin scales[12] qs[128]; Q5_K: d dmin scales[12] qh[32] qs[128]
            sc, mn = _k_scale_min(blk, j // 32, mask)
            qs = 16 if TYPE == 12 else 48
            q = (_byte(blk + qs + (j // 64) * 32 + j % 32, mask) >> (((j % 64) // 32) * 4)) & 0xF
            if TYPE == 13:
                q = q | (((_byte(blk + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
            scale = _f16(blk, mask) * sc
            bias = -_f16(blk + 2, mask) * mn
            v = q.to(tl.float32) * scale + bias
    else:  # 32-value blocks: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
        j = (cols % 32)[None, :]
        if TYPE == 8:  # d int8[32]
            blk = row_base + (cols // 32 * 34)[None, :]
            v = _byte(blk + 2 + j, mask).to(tl.int8).to(tl.float32) * _f16(blk, mask)
        else:
            if TYPE == 2:
                blk = row_base + (cols // 32 * 18)[None, :]
                qs = 2
            elif TYPE == 3:
                blk = row_base + (cols // 32 * 20)[None, :]
                qs = 4
            elif TYPE == 6:
                blk = row_base + (cols // 32 * 22)[None, :]
                qs = 6
            else:
                blk = row_base + (cols // 32 * 24)[None, :]
                qs = 8
            q = (_byte(blk + qs + j % 16, mask) >> ((j // 16) * 4)) & 0xF
            if TYPE == 6 or TYPE == 7:  # the fifth bit: bit j of the little-endian uint32 before qs
                q = q | (((_byte(blk + qs - 4 + j // 8, mask) >> (j % 8)) & 1) << 4)
            d = _f16(blk, mask)
            if TYPE == 2:
                v = (q - 8).to(tl.float32) * d
            elif TYPE == 6:
                v = (q - 16).to(tl.float32) * d
            else:  # Q4_1, Q5_1: d·q + m
                v = q.to(tl.float32) * d + _f16(blk + 2, mask)
    return v

@triton.jit
def _bf16_bits(v):
    """fp32 → bf16 bit pattern (int32 holding 16 bits), round to nearest even; NaN → 0x7FC0."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)

@triton.jit
def dequant_kernel(raw_ptr, out_ptr, n_rows, n_cols, row_bytes, row0, col0, n_out_rows, n_out_cols,
                    out_stride, TYPE: tl.constexpr, BF16: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    v = _dequant(raw_ptr, row0 + r, col0 + c, n_rows, n_cols, row_bytes, TYPE)
    mask = (r < n_out_rows)[:, None] & (c < n_out_cols)[None, :]
    dst = out_ptr + r.to(tl.int64)[:, None] * out_stride + c[None, :]
    if BF16:
        tl.store(dst, _bf16_bits(v).to(tl.int16), mask=mask)
    else:
        tl.store(dst, v, mask=mask)

@triton.jit
def matvec_kernel(raw_ptr, x_ptr, y_ptr, n_rows, n_cols, row_bytes, x_stride, y_stride,
                   TYPE: tl.constexpr, ROUND_BF16: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    t = tl.program_id(1)
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, n_cols, BK):
        cols = k0 + tl.arange(0, BK)
        w = _dequant(raw_ptr, rows, cols, n_rows, n_cols, row_bytes, TYPE)
        if ROUND_BF16:  # the weight as the bf16 tile path sees it
            w = (_bf16_bits(w) << 16).to(tl.float32, bitcast=True)
        x = tl.load(x_ptr + t.to(tl.int64) * x_stride + cols, mask=cols < n_cols, other=0.0)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + t.to(tl.int64) * y_stride + rows, acc, mask=rows < n_rows)
