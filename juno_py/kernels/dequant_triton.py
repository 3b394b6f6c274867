"""Triton kernels that decode GGML blocks (imported only when a GPU or interpreted path first runs: `@triton.jit`
reads TRITON_INTERPRET when a kernel is defined). The launch wrappers, the numerics and the eager references are
in `juno_py.kernels.dequant`.

Block-wise decoding: a program takes `NB` whole blocks (32 values for Q4_0..Q8_0, 256 for the K-quants, 256
columns for F32/F16/BF16) of the flattened (row, block) grid of the rectangle it decodes. Each block's values are
laid out in a small tensor whose last axis is a run of consecutive code bytes (16 or 32), so the code bytes of a
block are one contiguous vector load per run (as wide as the block's alignment allows: 16 bytes for Q4_K/Q5_K),
shared by the 2 or 4 values each byte holds through broadcasting; the float16 scales, minima and the K-quants'
sub-block scales are read once per block or sub-block, never per value. Every value is then `code · scale
(+ bias)` with the same fp32 operations as the torch codecs, rounded to bf16 with integer operations
(`_bf16_bits`), and the output is written in runs of 16 or 32 contiguous values. The split variant
(`dequant_kernel` with SPLIT) writes both bf16 halves of each value in the same pass: w_hi = bf16(w) and
w_lo = bf16(w − w_hi), for products that need fp32 accuracy on bf16 tensor cores (DoRA's U = W·Aᵀ).

Axes of a block's value tensor (`v` is the value's index inside its block):
- Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: [NB, 2 (h), 16 (l)], v = 16h + l; a nibble code is byte qs[l] shifted by 4h;
- Q4_K/Q5_K: [NB, 4 (c), 2 (h), 32 (l)], v = 64c + 32h + l; byte qs[32c + l] shifted by 4h, sub-block 2c + h;
- Q6_K: [NB, 2 (n), 2 (a), 2 (b), 32 (l)], v = 128n + 64a + 32b + l; low bits ql[64n + 32b + l] >> 4a, high bits
  qh[32n + l] >> 2(2a + b), scale sc[v // 16];
- F32/F16/BF16: [NB, 8, 32], v = 32s + l (256 columns a block, the last one masked at the row's end).
"""

import triton
import triton.language as tl

from juno_py.kernels.launch import interpreting

INTERPRETED = interpreting()

# TYPE is the GGML type number: F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30


@triton.jit
def _u8(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):
    """The little-endian float16 at each byte address `ptr`, as fp32 (exact)."""
    return (_u8(ptr) | (_u8(ptr + 1) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_bits(v):
    """fp32 → bf16 bit pattern (int32 holding 16 bits), round to nearest even; NaN → 0x7FC0."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def _emit(val, idx, base, lo, hi, ok, out_ptr, lo_out_ptr, MODE: tl.constexpr, BF16: tl.constexpr,
          EDGES: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """MODE 0: store `val` at `out_ptr + base + idx` where `ok` (and lo <= idx < hi when EDGES), as bf16 bits or fp32;
    returns nothing useful. MODE 2 (split): store both bf16 halves of `val`, w_hi = bf16(val) at `out_ptr` and
    w_lo = bf16(val − w_hi) at `lo_out_ptr` (same offsets); val − w_hi is exact in fp32 (the rounding error of a
    rounding to fewer bits), so each half is rounded once, to nearest even, with integer operations. MODE 1 (matvec):
    Σ over each block of val · x[base + idx] (x at `out_ptr`, fp32; the weight rounded to bf16 first when BF16), one
    fp32 partial sum per block `[NB]`."""
    keep = ok
    if EDGES:
        keep = keep & (idx >= lo) & (idx < hi)
    if MODE == 0:
        if BF16:
            tl.store(out_ptr + (base + idx), _bf16_bits(val).to(tl.int16), mask=keep)
        else:
            tl.store(out_ptr + (base + idx), val, mask=keep)
        return tl.zeros([NB], dtype=tl.float32)
    elif MODE == 2:
        top = _bf16_bits(val)
        rest = val - (top << 16).to(tl.float32, bitcast=True)
        tl.store(out_ptr + (base + idx), top.to(tl.int16), mask=keep)
        tl.store(lo_out_ptr + (base + idx), _bf16_bits(rest).to(tl.int16), mask=keep)
        return tl.zeros([NB], dtype=tl.float32)
    else:
        if BF16:  # the weight as the bf16 tile path sees it
            val = (_bf16_bits(val) << 16).to(tl.float32, bitcast=True)
        x = tl.load(out_ptr + (base + idx), mask=keep, other=0.0)
        return tl.sum(tl.reshape(tl.where(keep, val * x, 0.0), [NB, B]), axis=1)


@triton.jit
def _blocks(raw_ptr, blk, base, lo, hi, ok, out_ptr, lo_out_ptr, TYPE: tl.constexpr, MODE: tl.constexpr,
            BF16: tl.constexpr, EDGES: tl.constexpr, NB: tl.constexpr):
    """Decode the NB blocks at byte offsets `blk` [NB] (int64, always inside the bytes) and hand their values to
    `_emit` with the block's output offset `base`, its kept value range [lo, hi) and `ok` (the block is real)."""
    b = raw_ptr + blk
    if TYPE == 12 or TYPE == 13:  # Q4_K: d dmin scales[12] qs[128]; Q5_K: d dmin scales[12] qh[32] qs[128]
        c = tl.arange(0, 4)[None, :, None, None]
        h = tl.arange(0, 2)[None, None, :, None]
        l = tl.arange(0, 32)[None, None, None, :]
        b4 = b[:, None, None, None]
        if TYPE == 12:
            q = (tl.load(b4 + 16 + 32 * c + l).to(tl.int32) >> (4 * h)) & 0xF  # [NB,4,2,32] from [NB,4,1,32] bytes
        else:
            q = (tl.load(b4 + 48 + 32 * c + l).to(tl.int32) >> (4 * h)) & 0xF
            q = q | (((tl.load(b4 + 16 + l).to(tl.int32) >> (2 * c + h)) & 1) << 4)
        sub = 2 * c + h  # [1,4,2,1]: the 6-bit scale/minimum pair of each 32-value sub-block
        low = sub < 4
        s_a = _u8(b4 + 4 + sub)
        s_b = _u8(b4 + 8 + sub)
        s_c = _u8(b4 + 4 + tl.where(low, sub, sub - 4))
        sc = tl.where(low, s_a & 63, (s_b & 0xF) | ((s_c >> 6) << 4)).to(tl.float32)
        mn = tl.where(low, s_b & 63, (s_b >> 4) | ((s_a >> 6) << 4)).to(tl.float32)
        scale = _f16(b4) * sc
        bias = -_f16(b4 + 2) * mn
        val = q.to(tl.float32) * scale + bias
        idx = 64 * c + 32 * h + l
        return _emit(val, idx, base[:, None, None, None], lo[:, None, None, None], hi[:, None, None, None],
                     ok[:, None, None, None], out_ptr, lo_out_ptr, MODE, BF16, EDGES, NB, 256)
    elif TYPE == 14:  # Q6_K: ql[128] qh[64] int8 scales[16] d
        n = tl.arange(0, 2)[None, :, None, None, None]
        a = tl.arange(0, 2)[None, None, :, None, None]
        bb = tl.arange(0, 2)[None, None, None, :, None]
        l = tl.arange(0, 32)[None, None, None, None, :]
        b5 = b[:, None, None, None, None]
        lo4 = (tl.load(b5 + 64 * n + 32 * bb + l).to(tl.int32) >> (4 * a)) & 0xF  # [NB,2,2,2,32]
        hi2 = (tl.load(b5 + 128 + 32 * n + l).to(tl.int32) >> (2 * (2 * a + bb))) & 3
        idx = 128 * n + 64 * a + 32 * bb + l
        s16 = 8 * n + 4 * a + 2 * bb  # scale of values idx // 16: s16 for l < 16, s16 + 1 above
        sc = tl.where(l < 16, tl.load(b5 + 192 + s16).to(tl.int8, bitcast=True),
                      tl.load(b5 + 193 + s16).to(tl.int8, bitcast=True)).to(tl.float32)
        scale = _f16(b5 + 208) * sc
        val = ((lo4 | (hi2 << 4)) - 32).to(tl.float32) * scale
        return _emit(val, idx, base[:, None, None, None, None], lo[:, None, None, None, None],
                     hi[:, None, None, None, None], ok[:, None, None, None, None], out_ptr, lo_out_ptr, MODE, BF16,
                     EDGES, NB, 256)
    elif TYPE == 0 or TYPE == 1 or TYPE == 30:  # F32, F16, BF16: 256 columns a block, the row's end masked
        s = tl.arange(0, 8)[None, :, None]
        l = tl.arange(0, 32)[None, None, :]
        idx = 32 * s + l
        b3 = b[:, None, None]
        inside = ok[:, None, None] & (idx < hi[:, None, None])
        if TYPE == 0:
            val = tl.load(b3.to(tl.pointer_type(tl.float32)) + idx, mask=inside, other=0.0)
        elif TYPE == 1:
            val = tl.load(b3.to(tl.pointer_type(tl.float16)) + idx, mask=inside, other=0.0).to(tl.float32)
        else:
            bits = tl.load(b3.to(tl.pointer_type(tl.int16)) + idx, mask=inside, other=0).to(tl.int32)
            val = (bits << 16).to(tl.float32, bitcast=True)
        return _emit(val, idx, base[:, None, None], lo[:, None, None], hi[:, None, None], ok[:, None, None],
                     out_ptr, lo_out_ptr, MODE, BF16, EDGES, NB, 256)
    else:  # 32-value blocks: Q4_0 (d qs[16]), Q4_1 (d m qs[16]), Q5_0 (d qh[4] qs[16]), Q5_1 (d m qh[4] qs[16]), Q8_0
        h = tl.arange(0, 2)[None, :, None]
        l = tl.arange(0, 16)[None, None, :]
        idx = 16 * h + l
        b3 = b[:, None, None]
        d = _f16(b3)
        if TYPE == 8:  # d int8[32]
            val = tl.load(b3 + 2 + idx).to(tl.int8, bitcast=True).to(tl.float32) * d
        else:
            if TYPE == 2:
                qs = b3 + 2
            elif TYPE == 3:
                qs = b3 + 4
            elif TYPE == 6:
                qs = b3 + 6
            else:
                qs = b3 + 8
            q = (tl.load(qs + l).to(tl.int32) >> (4 * h)) & 0xF  # [NB,2,16] from [NB,1,16] bytes
            if TYPE == 6 or TYPE == 7:  # the fifth bit: bit idx of the little-endian uint32 before qs
                qh = _u8(qs - 4) | (_u8(qs - 3) << 8) | (_u8(qs - 2) << 16) | (_u8(qs - 1) << 24)  # [NB,1,1]
                q = q | (((qh >> idx) & 1) << 4)
            if TYPE == 2:
                val = (q - 8).to(tl.float32) * d
            elif TYPE == 6:
                val = (q - 16).to(tl.float32) * d
            else:  # Q4_1, Q5_1: d·q + m
                val = q.to(tl.float32) * d + _f16(b3 + 2)
        return _emit(val, idx, base[:, None, None], lo[:, None, None], hi[:, None, None], ok[:, None, None],
                     out_ptr, lo_out_ptr, MODE, BF16, EDGES, NB, 32)


@triton.jit
def dequant_kernel(raw_ptr, out_ptr, lo_out_ptr, row_units, row0, blk0, n_blk, n_out_rows, col0, col1, out_stride,
                   TYPE: tl.constexpr, B: tl.constexpr, BLOCK_BYTES: tl.constexpr, RA: tl.constexpr,
                   BF16: tl.constexpr, EDGES: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr):
    """Write W[row0 : row0 + n_out_rows, col0:col1] into out (row stride `out_stride`, column col0 at 0); SPLIT: its
    bf16 halves w_hi into out and w_lo into lo_out (the same row stride; unused otherwise). The
    program takes NB consecutive blocks of the flattened (output row, block column) grid; block columns run from
    blk0 for n_blk blocks. Bytes of a row: row_units · RA (RA: a power of two dividing it, so the compiler knows the
    rows' alignment). EDGES: col0 or col1 cut a block (values outside [col0, col1) are decoded but not stored)."""
    g = tl.program_id(0) * NB + tl.arange(0, NB)  # int32: a weight has fewer than 2^31 blocks
    total = n_out_rows * n_blk
    ok = g < total
    g = tl.minimum(g, total - 1)  # past the end: decode the last block again (never stored), loads need no mask
    r = g // n_blk
    bc = blk0 + (g - r * n_blk)
    blk = (row0 + r).to(tl.int64) * (row_units * RA) + bc * BLOCK_BYTES
    first = bc * B  # absolute column of the block's first value
    base = r.to(tl.int64) * out_stride + (first - col0)
    lo = col0 - first
    hi = col1 - first
    if SPLIT:
        _blocks(raw_ptr, blk, base, lo, hi, ok, out_ptr, lo_out_ptr, TYPE, 2, True, EDGES, NB)
    else:
        _blocks(raw_ptr, blk, base, lo, hi, ok, out_ptr, out_ptr, TYPE, 0, BF16, EDGES, NB)


@triton.jit
def matvec_kernel(raw_ptr, x_ptr, y_ptr, n_rows, n_cols, n_blk, row_units, x_stride, y_stride,
                  TYPE: tl.constexpr, B: tl.constexpr, BLOCK_BYTES: tl.constexpr, RA: tl.constexpr,
                  ROUND_BF16: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr):
    """y[t, rows] = x[t] · W[rows]ᵀ for BN rows and one token t a program, KB blocks of each row a step, fp32."""
    t = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BN * KB)
    rows = tl.program_id(0).to(tl.int64) * BN + i // KB
    row_ok = rows < n_rows
    rows_c = tl.minimum(rows, n_rows - 1)
    acc = tl.zeros([BN * KB], dtype=tl.float32)
    for k0 in range(0, n_blk, KB):
        bc = k0 + (i % KB)
        ok = row_ok & (bc < n_blk)
        bcc = tl.minimum(bc, n_blk - 1).to(tl.int64)
        blk = rows_c * (row_units * RA) + bcc * BLOCK_BYTES
        first = bcc * B
        hi = (n_cols - first).to(tl.int32)
        acc += _blocks(raw_ptr, blk, t * x_stride + first, hi * 0, hi, ok, x_ptr, x_ptr, TYPE, 1, ROUND_BF16, True,
                       BN * KB)
    y = tl.sum(tl.reshape(acc, [BN, KB]), axis=1)
    r = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    tl.store(y_ptr + t * y_stride + r, y, mask=r < n_rows)
