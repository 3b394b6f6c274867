"""Triton kernels that decode GGML blocks (imported only when a GPU or interpreted path first runs: `@triton.jit`
reads TRITON_INTERPRET when a kernel is defined). The launch wrappers, the numerics and the eager references are
in `juno_py.kernels.dequant`.

Block-wise decoding: a program takes `NB` whole blocks (32 values for Q4_0..Q8_0, IQ4_NL, MXFP4, 256 for the K-quants
and the other i-quants and ternary types, 256 columns for F32/F16/BF16) of the flattened (row, block) grid of the
rectangle it decodes. Each block's values are laid out in a small tensor whose axes follow the block's fields, so a
field is read once, with the shape of the values that share it, and broadcast over them: the code bytes of a block
as contiguous vector loads (as wide as the block's alignment allows: 16 bytes for Q4_K/Q5_K), shared by the 2 or 4
values each byte holds; the float16 scales, minima and sub-block scales once per block or sub-block. Every value is
then `code · scale (+ bias)` with the same fp32 operations as the torch codecs, rounded to bf16 with integer
operations (`_bf16_bits`) or, in the cast variants on the GPU, by the GPU's cast (to nearest even as well), and the
output is written in runs of contiguous values. The split mode (`dequant_kernel` with SPLIT) writes both bf16 halves
of each value in the same pass: w_hi = bf16(w) and w_lo = bf16(w − w_hi), for products that need fp32 accuracy on
bf16 tensor cores (DoRA's U = W·Aᵀ); the matvec mode (`matvec_kernel`) sums value · x per block instead.

VARIANT (a compile-time argument of both kernels; `dequant.variants`, all decoding the same bits): bit 0 picks the
layouts below marked (1) for the types that have one and 16-bit loads of the float16 fields (and Q5's qh) for the
other quantized types, codes made fp32 without conversion instructions (`_exact_f32`, `_i8_f32`, `_flip`) and, in
`dequant_kernel`, one division a program to find its blocks' rows instead of one a block; bit 1 rounds to bf16
with the cast (`_emit`); bits 2 and 3 (codebook types, with bit 0) pick how a grid point is read
(`_grid_points`: its row as one word, or from an fp32 copy of the grid). Axes of a block's value tensor (`v` is the
value's index inside its block):
- Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: [NB, 2 (h), 16 (l)], v = 16h + l; a nibble code is byte qs[l] shifted by 4h;
- Q4_K/Q5_K: [NB, 4 (c), 2 (h), 32 (l)], v = 64c + 32h + l; byte qs[32c + l] shifted by 4h, sub-block 2c + h;
- Q6_K: [NB, 2 (n), 2 (a), 2 (b), 32 (l)], v = 128n + 64a + 32b + l; low bits ql[64n + 32b + l] >> 4a, high bits
  qh[32n + l] >> 2(2a + b), scale sc[v // 16];
- F32/F16/BF16: [NB, 8, 32], v = 32s + l (256 columns a block, the last one masked at the row's end);
- (0) IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0, Q2_K, Q3_K, IQ4_XS: [NB, 256], and MXFP4,
  IQ4_NL: [NB, 32], v the value itself: each value reads the bytes of its own fields (its grid index, sign bits,
  sub-block scale, d; `_codebook_values`);
- (1) IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M: [NB, 32 (g), 8 (j)], v = 8g + j: grid index, sign byte and scale per
  group g, the grid row as one 8-byte load; IQ3_XXS, IQ3_S: [NB, 32 (g), 2 (p), 4 (e)], v = 8g + 4p + e, the grid
  index per (g, p), a 4-byte grid row; TQ2_0: [NB, 2 (n), 4 (s), 32 (l)], v = 128n + 32s + l, byte 32n + l
  shifted by 2s; Q2_K, Q3_K: [NB, 2 (n), 4 (s), 2 (h), 16 (l)], v = 128n + 32s + 16h + l, code byte 32n + 16h + l
  shifted by 2s (Q3_K's high bit: byte 16h + l, bit 4n + s), sub-block scale 8n + 2s + h; IQ4_XS: [NB, 8 (sb),
  2 (h), 16 (l)], v = 32sb + 16h + l, byte 16sb + l shifted by 4h; IQ4_NL, MXFP4: [NB, 2 (h), 16 (l)] as Q4_0;
  TQ1_0: five tensors [NB, K digits, L bytes] over its runs of bytes, each byte shared by its base-3 digits
  (`_grouped`).
The codebook types read their grid points from `grid_ptr` (the int8 grid `[points, 8 or 4]` of
`gguf.quants.codebooks.GRIDS`, or its fp32 copy in the variants with bit 3; for IQ4_NL/IQ4_XS the 16 int8 levels;
any pointer for the other types).
IQ2_XXS/IQ2_XS/IQ3_XXS's 7-bit sign indices become sign bytes by their parity (llama.cpp's ksigns: bit 7 makes
the count of negatives even), MXFP4's e2m1 levels are computed.
"""

import triton
import triton.language as tl

from juno_py.kernels.launch import interpreting

INTERPRETED = interpreting()
# whether a float cast to bf16 rounds to nearest even (on the GPU; the interpreter truncates)
CAST_ROUNDS = tl.constexpr(not INTERPRETED)

# TYPE is the GGML type number: F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11, Q4_K 12,
# Q5_K 13, Q6_K 14, BF16 30; IQ2_XXS 16, IQ2_XS 17, IQ3_XXS 18, IQ1_S 19, IQ4_NL 20, IQ3_S 21, IQ2_S 22, IQ4_XS 23,
# IQ1_M 29, TQ1_0 34, TQ2_0 35, MXFP4 39


@triton.jit
def _u8(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):
    """The little-endian float16 at each byte address `ptr`, as fp32 (exact)."""
    return (_u8(ptr) | (_u8(ptr + 1) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u16(ptr):
    """The little-endian uint16 at each byte address `ptr`, as int32."""
    return _u8(ptr) | (_u8(ptr + 1) << 8)


@triton.jit
def _h16(ptr):
    """The little-endian uint16 at each even byte address `ptr`, as int32: one 16-bit load (the grouped layouts;
    the launch makes sure the bytes start at an even address)."""
    return tl.load(ptr.to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF


@triton.jit
def _hf16(ptr):
    """The float16 at each even byte address `ptr`, as fp32 (exact): one 16-bit load."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _h32(ptr):
    """The little-endian uint32 at each even byte address `ptr` (bits as an int32): two 16-bit loads."""
    return _h16(ptr) | (_h16(ptr + 2) << 16)


@triton.jit
def _ksign_byte(index):
    """llama.cpp's ksigns[index] for 7-bit sign indices: the index, and as bit 7 the parity of its bits."""
    p = index ^ (index >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return index | ((p & 1) << 7)


@triton.jit
def _f16w(ptr, WIDE: tl.constexpr):
    """`_hf16(ptr)` when WIDE (an even address), else `_f16(ptr)`."""
    if WIDE:
        return _hf16(ptr)
    else:
        return _f16(ptr)


@triton.jit
def _u32w(ptr, WIDE: tl.constexpr):
    """The little-endian uint32 at each byte address `ptr` (bits as an int32): `_h32` when WIDE (an even
    address), else four byte loads."""
    if WIDE:
        return _h32(ptr)
    else:
        return _u8(ptr) | (_u8(ptr + 1) << 8) | (_u8(ptr + 2) << 16) | (_u8(ptr + 3) << 24)


@triton.jit
def _exact_f32(u, BIAS: tl.constexpr):
    """float(u − BIAS) for int32 0 ≤ u < 2^23, exactly (as `(u − BIAS).to(tl.float32)`, +0 for u = BIAS), with an OR
    and a float subtraction instead of a conversion, a quarter-rate instruction on the GPU."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)


@triton.jit
def _i8_f32(ptr):
    """The int8 at each address `ptr` (an int8 pointer), as fp32 (exact), without a conversion instruction."""
    return _exact_f32(tl.load(ptr.to(tl.pointer_type(tl.uint8))).to(tl.int32) ^ 0x80, 128.0)


@triton.jit
def _grid_points(grid_ptr, index, j, WIDTH: tl.constexpr, GRID: tl.constexpr):
    """Value j of grid row `index` (rows of WIDTH = 8 or 4 values) as fp32, exact. GRID 0: one byte load a value
    from the int8 grid; 1: the row as one 8- or 4-byte word load, shared by its values, and its bytes by shifts;
    2: one load a value from the fp32 copy of the grid (`grid_ptr` points at it). `index` has size 1 along j's
    axis, the last one."""
    if GRID == 0:
        return _i8_f32(grid_ptr + WIDTH * index + j)
    if GRID == 2:
        return tl.load(grid_ptr.to(tl.pointer_type(tl.float32)) + WIDTH * index + j)
    if WIDTH == 8:
        row = tl.load(grid_ptr.to(tl.pointer_type(tl.int64)) + index)
        byte = ((row >> (8 * j).to(tl.int64)) & 0xFF).to(tl.int32)
    else:
        byte = (tl.load(grid_ptr.to(tl.pointer_type(tl.int32)) + index) >> (8 * j)) & 0xFF
    return _exact_f32(byte ^ 0x80, 128.0)


@triton.jit
def _flip(x, sign):
    """−x where `sign` (0 or 1) is 1, else x: bit for bit x · (1 − 2·sign) (signed zeros included), one XOR."""
    return (x.to(tl.int32, bitcast=True) ^ (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _ksign_bit(index, j):
    """Bit j of llama.cpp's ksigns[index] for 7-bit sign indices: the index's own bits, and as bit 7 their parity."""
    p = index ^ (index >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return tl.where(j < 7, (index >> j) & 1, p & 1)


@triton.jit
def _codebook_values(b2, grid_ptr, TYPE: tl.constexpr):
    """The 256 values of each block at byte addresses `b2` [NB, 1] of a codebook or ternary type, fp32 [NB, 256]
    (v = the value's index), with the torch codec's float operations (every one exact)."""
    v = tl.arange(0, 256)[None, :]
    j = v % 8
    grp = v // 8  # group of 8 values (one grid point of the IQ1/IQ2 types)
    if TYPE == 16:  # IQ2_XXS: d, then per 32 values 4 grid index bytes and a uint32 of 4 × 7 sign bits and a scale
        w = b2 + 2 + 8 * (v // 32)
        aux = _u8(w + 4) | (_u8(w + 5) << 8) | (_u8(w + 6) << 16) | (_u8(w + 7) << 24)
        sign = _ksign_bit((aux >> (7 * ((v % 32) // 8))) & 0x7F, j)
        point = tl.load(grid_ptr + 8 * _u8(w + (v % 32) // 8) + j).to(tl.float32)
        scale = _f16(b2) * ((_u8(w + 7) >> 4).to(tl.float32) + 0.5) * 0.25
        val = scale * point * (1 - 2 * sign).to(tl.float32)
    elif TYPE == 17:  # IQ2_XS: d, 32 uint16s (9-bit grid index, 7-bit sign index), 16 scales of 4 bits
        q = _u16(b2 + 2 + 2 * grp)
        sb = v // 16
        s = (_u8(b2 + 66 + sb // 2) >> (4 * (sb % 2))) & 0xF
        point = tl.load(grid_ptr + 8 * (q & 511) + j).to(tl.float32)
        scale = _f16(b2) * (s.to(tl.float32) + 0.5) * 0.25
        val = scale * point * (1 - 2 * _ksign_bit(q >> 9, j)).to(tl.float32)
    elif TYPE == 22:  # IQ2_S: d, 32 index bytes, 32 sign bytes, 2-bit high index parts, 16 scales of 4 bits
        index = _u8(b2 + 2 + grp) | (((_u8(b2 + 66 + grp // 4) >> (2 * (grp % 4))) & 3) << 8)
        sign = (_u8(b2 + 34 + grp) >> j) & 1
        sb = v // 16
        s = (_u8(b2 + 74 + sb // 2) >> (4 * (sb % 2))) & 0xF
        point = tl.load(grid_ptr + 8 * index + j).to(tl.float32)
        scale = _f16(b2) * (s.to(tl.float32) + 0.5) * 0.25
        val = scale * point * (1 - 2 * sign).to(tl.float32)
    elif TYPE == 18:  # IQ3_XXS: d, 64 index bytes (4 values each), per 32 values a uint32 of signs and a scale
        w = b2 + 66 + 4 * (v // 32)
        aux = _u8(w) | (_u8(w + 1) << 8) | (_u8(w + 2) << 16) | (_u8(w + 3) << 24)
        sign = _ksign_bit((aux >> (7 * ((v % 32) // 8))) & 0x7F, j)
        point = tl.load(grid_ptr + 4 * _u8(b2 + 2 + v // 4) + v % 4).to(tl.float32)
        scale = _f16(b2) * ((_u8(w + 3) >> 4).to(tl.float32) + 0.5) * 0.5
        val = scale * point * (1 - 2 * sign).to(tl.float32)
    elif TYPE == 21:  # IQ3_S: d, 64 index bytes, 8 bytes of high index bits, 32 sign bytes, 8 scales: d · (1 + 2s)
        g4 = v // 4
        index = _u8(b2 + 2 + g4) | (((_u8(b2 + 66 + g4 // 8) >> (g4 % 8)) & 1) << 8)
        sign = (_u8(b2 + 74 + grp) >> j) & 1
        sb = v // 32
        s = (_u8(b2 + 106 + sb // 2) >> (4 * (sb % 2))) & 0xF
        point = tl.load(grid_ptr + 4 * index + v % 4).to(tl.float32)
        val = _f16(b2) * (1 + 2 * s).to(tl.float32) * point * (1 - 2 * sign).to(tl.float32)
    elif TYPE == 19:  # IQ1_S: d, 32 index bytes, per 32 values a uint16: 4 × 3 high index bits, scale, offset sign
        qh = _u16(b2 + 34 + 2 * (v // 32))
        index = _u8(b2 + 2 + grp) | (((qh >> (3 * (grp % 4))) & 7) << 8)
        point = tl.load(grid_ptr + 8 * index + j).to(tl.float32)
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
        val = _f16(b2) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * (point + delta)
    elif TYPE == 29:  # IQ1_M: 32 index bytes, 32 nibbles (3 high index bits, offset sign), 16 scales of 3 bits;
        # the float16 scale is the top nibbles of the four uint16s at byte 48
        d = (
            (_u16(b2 + 48) >> 12)
            | ((_u16(b2 + 50) >> 12) << 4)
            | ((_u16(b2 + 52) >> 12) << 8)
            | ((_u16(b2 + 54) >> 12) << 12)
        )
        d = d.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sb = v // 16
        sc = (_u16(b2 + 48 + 2 * (sb // 4)) >> (3 * (sb % 4))) & 7
        nib = (_u8(b2 + 32 + grp // 2) >> (4 * (grp % 2))) & 0xF
        point = tl.load(grid_ptr + 8 * (_u8(b2 + grp) | ((nib & 7) << 8)) + j).to(tl.float32)
        delta = tl.where((nib & 8) != 0, -0.125, 0.125)
        val = d * (2 * sc + 1).to(tl.float32) * (point + delta)
    elif TYPE == 34:  # TQ1_0: 48 bytes of 5 base-3 digits (32 bytes, then 16), 4 bytes of 4, d
        first = v < 160
        second = v < 240
        off = tl.where(first, v % 32, tl.where(second, 32 + (v - 160) % 16, 48 + (v - 240) % 4))
        k = tl.where(first, v // 32, tl.where(second, (v - 160) // 16, (v - 240) // 4))
        power = tl.where(k == 0, 1, tl.where(k == 1, 3, tl.where(k == 2, 9, tl.where(k == 3, 27, 81))))
        q = ((((_u8(b2 + off) * power) & 0xFF) * 3) >> 8) - 1
        val = q.to(tl.float32) * _f16(b2 + 52)
    elif TYPE == 35:  # TQ2_0: 64 bytes of 2-bit codes (code − 1), planar per 32 bytes, d
        q = ((_u8(b2 + 32 * (v // 128) + v % 32) >> (2 * ((v % 128) // 32))) & 3) - 1
        val = q.to(tl.float32) * _f16(b2 + 64)
    elif TYPE == 10:  # Q2_K: 16 bytes of (scale, minimum) nibbles, 64 bytes of 2-bit codes planar per 32, d, dmin
        q = (_u8(b2 + 16 + 32 * (v // 128) + v % 32) >> (2 * ((v % 128) // 32))) & 3
        sc = _u8(b2 + v // 16)
        scale = _f16(b2 + 80) * (sc & 0xF).to(tl.float32)
        bias = -_f16(b2 + 82) * (sc >> 4).to(tl.float32)
        val = q.to(tl.float32) * scale + bias
    elif TYPE == 11:  # Q3_K: 32 bytes of high bits (plane v // 32), 64 bytes of 2-bit codes, 12 of 6-bit scales, d
        q = (_u8(b2 + 32 + 32 * (v // 128) + v % 32) >> (2 * ((v % 128) // 32))) & 3
        q = q | (((_u8(b2 + v % 32) >> (v // 32)) & 1) << 2)
        k = v // 16  # scale k: low nibble of byte k % 8 (k // 8 picks it), 2 high bits of byte 8 + k % 4
        low = (_u8(b2 + 96 + k % 8) >> (4 * (k // 8))) & 0xF
        high = (_u8(b2 + 104 + k % 4) >> (2 * (k // 4))) & 3
        scale = _f16(b2 + 108) * ((low | (high << 4)) - 32).to(tl.float32)
        val = (q - 4).to(tl.float32) * scale
    else:  # IQ4_XS: d, 2-bit high scale parts (uint16), 4 bytes of low scale nibbles, 128 bytes of level nibbles
        sb = v // 32
        ls = ((_u8(b2 + 4 + sb // 2) >> (4 * (sb % 2))) & 0xF) | (((_u16(b2 + 2) >> (2 * sb)) & 3) << 4)
        c = (_u8(b2 + 8 + 16 * sb + v % 16) >> (4 * ((v % 32) // 16))) & 0xF
        scale = _f16(b2) * (ls - 32).to(tl.float32)
        val = scale * tl.load(grid_ptr + c).to(tl.float32)
    return val


@triton.jit
def _bf16_bits(v):
    """fp32 → bf16 bit pattern (int32 holding 16 bits), round to nearest even; NaN → 0x7FC0."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def _emit(
    val,
    idx,
    base,
    lo,
    hi,
    ok,
    out_ptr,
    lo_out_ptr,
    MODE: tl.constexpr,
    BF16: tl.constexpr,
    EDGES: tl.constexpr,
    NB: tl.constexpr,
    B: tl.constexpr,
    CAST: tl.constexpr = False,
):
    """MODE 0: store `val` at `out_ptr + base + idx` where `ok` (and lo <= idx < hi when EDGES), as bf16 bits or fp32;
    returns nothing useful. MODE 2 (split): store both bf16 halves of `val`, w_hi = bf16(val) at `out_ptr` and
    w_lo = bf16(val − w_hi) at `lo_out_ptr` (same offsets); val − w_hi is exact in fp32 (the rounding error of a
    rounding to fewer bits), so each half is rounded once, to nearest even, with integer operations. MODE 1 (matvec):
    Σ over each block of val · x[base + idx] (x at `out_ptr`, fp32; the weight rounded to bf16 first when BF16), one
    fp32 partial sum per block `[NB]`. CAST: round to bf16 with the GPU's float cast (cvt.rn.bf16x2.f32: to nearest
    even, two values an instruction; NaN → 0x7FFF) instead of `_bf16_bits`'s integer operations (under the
    interpreter, whose cast truncates, always `_bf16_bits`)."""
    CAST_NOW: tl.constexpr = CAST and CAST_ROUNDS
    keep = ok
    if EDGES:
        keep = keep & (idx >= lo) & (idx < hi)
    if MODE == 0:
        if BF16 and CAST_NOW:
            tl.store(out_ptr + (base + idx), val.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=keep)
        elif BF16:
            tl.store(out_ptr + (base + idx), _bf16_bits(val).to(tl.int16), mask=keep)
        else:
            tl.store(out_ptr + (base + idx), val, mask=keep)
        return tl.zeros([NB], dtype=tl.float32)
    elif MODE == 2 and CAST_NOW:
        top = val.to(tl.bfloat16)
        rest = tl.where(tl.abs(val) < float("inf"), val - top.to(tl.float32), float("nan"))
        tl.store(out_ptr + (base + idx), top.to(tl.int16, bitcast=True), mask=keep)
        tl.store(lo_out_ptr + (base + idx), rest.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=keep)
        return tl.zeros([NB], dtype=tl.float32)
    elif MODE == 2:
        top = _bf16_bits(val)
        # an infinite val's low half is inf − inf = NaN, as torch has it; said outright, since the compiler may fuse
        # the product that overflowed into the subtraction (an FMA of MXFP4's largest scales gives ∓inf there)
        rest = tl.where(tl.abs(val) < float("inf"), val - (top << 16).to(tl.float32, bitcast=True), float("nan"))
        tl.store(out_ptr + (base + idx), top.to(tl.int16), mask=keep)
        tl.store(lo_out_ptr + (base + idx), _bf16_bits(rest).to(tl.int16), mask=keep)
        return tl.zeros([NB], dtype=tl.float32)
    else:
        if BF16 and CAST_NOW:  # the weight as the bf16 tile path sees it
            val = val.to(tl.bfloat16).to(tl.float32)
        elif BF16:
            val = (_bf16_bits(val) << 16).to(tl.float32, bitcast=True)
        x = tl.load(out_ptr + (base + idx), mask=keep, other=0.0)
        return tl.sum(tl.reshape(tl.where(keep, val * x, 0.0), [NB, B]), axis=1)


@triton.jit
def _tq1_part(
    b3,
    base,
    lo,
    hi,
    ok,
    d,
    out_ptr,
    lo_out_ptr,
    OFF: tl.constexpr,
    K: tl.constexpr,
    L: tl.constexpr,
    K0: tl.constexpr,
    V0: tl.constexpr,
    MODE: tl.constexpr,
    BF16: tl.constexpr,
    EDGES: tl.constexpr,
    NB: tl.constexpr,
    CAST: tl.constexpr,
):
    """TQ1_0's base-3 digits K0 .. K0 + K − 1 of the L bytes at OFF: [NB, K, L], value V0 + L·k + l."""
    k = tl.arange(0, K)[None, :, None] + K0
    l = tl.arange(0, L)[None, None, :]
    power = tl.where(k == 0, 1, tl.where(k == 1, 3, tl.where(k == 2, 9, tl.where(k == 3, 27, 81))))
    q = (((_u8(b3 + OFF + l) * power) & 0xFF) * 3) >> 8
    val = _exact_f32(q, 1.0) * d
    idx = V0 + L * (k - K0) + l
    return _emit(val, idx, base, lo, hi, ok, out_ptr, lo_out_ptr, MODE, BF16, EDGES, NB, K * L, CAST)


@triton.jit
def _grouped(
    b,
    grid_ptr,
    base,
    lo,
    hi,
    ok,
    out_ptr,
    lo_out_ptr,
    TYPE: tl.constexpr,
    MODE: tl.constexpr,
    BF16: tl.constexpr,
    EDGES: tl.constexpr,
    NB: tl.constexpr,
    CAST: tl.constexpr,
    GRID: tl.constexpr,
):
    """VARIANT 1 of the codebook, ternary, Q2_K, Q3_K and IQ4 types: the block's values in a tensor whose axes
    follow its fields, each field read once with its own shape and broadcast (see the module docstring), the same
    float operations as `_codebook_values`. `b`: byte addresses of the NB blocks [NB]."""
    if TYPE == 16 or TYPE == 17 or TYPE == 22 or TYPE == 19 or TYPE == 29:  # [NB, 32 (g), 8 (j)], v = 8g + j
        g = tl.arange(0, 32)[None, :, None]
        j = tl.arange(0, 8)[None, None, :]
        b3 = b[:, None, None]
        if TYPE == 16:  # IQ2_XXS: per 32 values 4 index bytes, then a uint32 of 4 × 7 sign bits and the scale
            w = b3 + 2 + 8 * (g // 4)
            aux = _h32(w + 4)
            sign = (_ksign_byte((aux >> (7 * (g % 4))) & 0x7F) >> j) & 1
            point = _grid_points(grid_ptr, _u8(w + g % 4), j, 8, GRID)
            scale = _hf16(b3) * (((aux >> 28) & 0xF).to(tl.float32) + 0.5) * 0.25
            val = _flip(scale * point, sign)
        elif TYPE == 17:  # IQ2_XS: a uint16 per group (9-bit grid index, 7-bit sign index), 4-bit scales
            q = _h16(b3 + 2 + 2 * g)
            s = (_u8(b3 + 66 + g // 4) >> (4 * ((g // 2) % 2))) & 0xF
            point = _grid_points(grid_ptr, q & 511, j, 8, GRID)
            scale = _hf16(b3) * (s.to(tl.float32) + 0.5) * 0.25
            sign = (_ksign_byte(q >> 9) >> j) & 1
            val = _flip(scale * point, sign)
        elif TYPE == 22:  # IQ2_S: index byte, sign byte, 2 high index bits per group; 4-bit scales
            index = _u8(b3 + 2 + g) | (((_u8(b3 + 66 + g // 4) >> (2 * (g % 4))) & 3) << 8)
            sign = (_u8(b3 + 34 + g) >> j) & 1
            s = (_u8(b3 + 74 + g // 4) >> (4 * ((g // 2) % 2))) & 0xF
            point = _grid_points(grid_ptr, index, j, 8, GRID)
            scale = _hf16(b3) * (s.to(tl.float32) + 0.5) * 0.25
            val = _flip(scale * point, sign)
        elif TYPE == 19:  # IQ1_S: index byte per group; per 4 groups a uint16 (3 high index bits each, scale, sign)
            qh = _h16(b3 + 34 + 2 * (g // 4))
            index = _u8(b3 + 2 + g) | (((qh >> (3 * (g % 4))) & 7) << 8)
            point = _grid_points(grid_ptr, index, j, 8, GRID)
            delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
            val = _hf16(b3) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * (point + delta)
        else:  # IQ1_M: index byte and nibble per group, 3-bit scales per 2 groups, d in the scales' top nibbles
            d = (
                (_h16(b3 + 48) >> 12)
                | ((_h16(b3 + 50) >> 12) << 4)
                | ((_h16(b3 + 52) >> 12) << 8)
                | ((_h16(b3 + 54) >> 12) << 12)
            )
            d = d.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            sb = g // 2
            sc = (_h16(b3 + 48 + 2 * (sb // 4)) >> (3 * (sb % 4))) & 7
            nib = (_u8(b3 + 32 + g // 2) >> (4 * (g % 2))) & 0xF
            point = _grid_points(grid_ptr, _u8(b3 + g) | ((nib & 7) << 8), j, 8, GRID)
            delta = tl.where((nib & 8) != 0, -0.125, 0.125)
            val = d * (2 * sc + 1).to(tl.float32) * (point + delta)
        return _emit(
            val,
            8 * g + j,
            base[:, None, None],
            lo[:, None, None],
            hi[:, None, None],
            ok[:, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    elif TYPE == 18 or TYPE == 21:  # IQ3_XXS, IQ3_S: [NB, 32 (g), 2 (p), 4 (e)], v = 8g + 4p + e
        g = tl.arange(0, 32)[None, :, None, None]
        p = tl.arange(0, 2)[None, None, :, None]
        e = tl.arange(0, 4)[None, None, None, :]
        b4 = b[:, None, None, None]
        if TYPE == 18:  # index byte per 4 values; per 32 values a uint32 of 4 × 7 sign bits and the scale
            aux = _h32(b4 + 66 + 4 * (g // 4))
            sign = (_ksign_byte((aux >> (7 * (g % 4))) & 0x7F) >> (4 * p + e)) & 1
            point = _grid_points(grid_ptr, _u8(b4 + 2 + 2 * g + p), e, 4, GRID)
            scale = _hf16(b4) * (((aux >> 28) & 0xF).to(tl.float32) + 0.5) * 0.5
            val = _flip(scale * point, sign)
        else:  # index byte and high bit per 4 values, sign byte per group, 4-bit scales per 4 groups
            g4 = 2 * g + p
            index = _u8(b4 + 2 + g4) | (((_u8(b4 + 66 + g4 // 8) >> (g4 % 8)) & 1) << 8)
            sign = (_u8(b4 + 74 + g) >> (4 * p + e)) & 1
            sb = g // 4
            s = (_u8(b4 + 106 + sb // 2) >> (4 * (sb % 2))) & 0xF
            point = _grid_points(grid_ptr, index, e, 4, GRID)
            val = _flip(_hf16(b4) * (1 + 2 * s).to(tl.float32) * point, sign)
        return _emit(
            val,
            8 * g + 4 * p + e,
            base[:, None, None, None],
            lo[:, None, None, None],
            hi[:, None, None, None],
            ok[:, None, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    elif TYPE == 35:  # TQ2_0: [NB, 2 (n), 4 (s), 32 (l)], v = 128n + 32s + l: bits 2s of byte 32n + l
        n = tl.arange(0, 2)[None, :, None, None]
        s = tl.arange(0, 4)[None, None, :, None]
        l = tl.arange(0, 32)[None, None, None, :]
        b4 = b[:, None, None, None]
        q = (_u8(b4 + 32 * n + l) >> (2 * s)) & 3
        val = _exact_f32(q, 1.0) * _hf16(b4 + 64)
        return _emit(
            val,
            128 * n + 32 * s + l,
            base[:, None, None, None],
            lo[:, None, None, None],
            hi[:, None, None, None],
            ok[:, None, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    elif TYPE == 10 or TYPE == 11:  # Q2_K, Q3_K: [NB, 2 (n), 4 (s), 2 (h), 16 (l)], v = 128n + 32s + 16h + l
        n = tl.arange(0, 2)[None, :, None, None, None]
        s = tl.arange(0, 4)[None, None, :, None, None]
        h = tl.arange(0, 2)[None, None, None, :, None]
        l = tl.arange(0, 16)[None, None, None, None, :]
        b5 = b[:, None, None, None, None]
        k = 8 * n + 2 * s + h  # the 16-value sub-block
        if TYPE == 10:  # bits 2s of code byte 32n + 16h + l; (scale, minimum) nibbles of byte k
            q = (_u8(b5 + 16 + 32 * n + 16 * h + l) >> (2 * s)) & 3
            sc = _u8(b5 + k)
            scale = _hf16(b5 + 80) * (sc & 0xF).to(tl.float32)
            bias = -_hf16(b5 + 82) * (sc >> 4).to(tl.float32)
            val = _exact_f32(q, 0.0) * scale + bias
        else:  # 2 low bits as Q2_K's (after 32 bytes of high bits: bit 4n + s of byte 16h + l), 6-bit scales
            q = (_u8(b5 + 32 + 32 * n + 16 * h + l) >> (2 * s)) & 3
            q = q | (((_u8(b5 + 16 * h + l) >> (4 * n + s)) & 1) << 2)
            low = (_u8(b5 + 96 + k % 8) >> (4 * (k // 8))) & 0xF
            high = (_u8(b5 + 104 + k % 4) >> (2 * (k // 4))) & 3
            scale = _hf16(b5 + 108) * ((low | (high << 4)) - 32).to(tl.float32)
            val = _exact_f32(q, 4.0) * scale
        return _emit(
            val,
            128 * n + 32 * s + 16 * h + l,
            base[:, None, None, None, None],
            lo[:, None, None, None, None],
            hi[:, None, None, None, None],
            ok[:, None, None, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    elif TYPE == 23:  # IQ4_XS: [NB, 8 (sb), 2 (h), 16 (l)], v = 32sb + 16h + l: nibble h of byte 16sb + l
        sb = tl.arange(0, 8)[None, :, None, None]
        h = tl.arange(0, 2)[None, None, :, None]
        l = tl.arange(0, 16)[None, None, None, :]
        b4 = b[:, None, None, None]
        c = (_u8(b4 + 8 + 16 * sb + l) >> (4 * h)) & 0xF
        ls = ((_u8(b4 + 4 + sb // 2) >> (4 * (sb % 2))) & 0xF) | (((_h16(b4 + 2) >> (2 * sb)) & 3) << 4)
        scale = _hf16(b4) * (ls - 32).to(tl.float32)
        val = scale * _i8_f32(grid_ptr + c)
        return _emit(
            val,
            32 * sb + 16 * h + l,
            base[:, None, None, None],
            lo[:, None, None, None],
            hi[:, None, None, None],
            ok[:, None, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    elif TYPE == 20 or TYPE == 39:  # IQ4_NL, MXFP4: [NB, 2 (h), 16 (l)], v = 16h + l: nibble h of code byte l
        h = tl.arange(0, 2)[None, :, None]
        l = tl.arange(0, 16)[None, None, :]
        b3 = b[:, None, None]
        if TYPE == 20:
            c = (_u8(b3 + 2 + l) >> (4 * h)) & 0xF
            val = _hf16(b3) * _i8_f32(grid_ptr + c)
        else:
            c = (_u8(b3 + 1 + l) >> (4 * h)) & 0xF
            # the doubled e2m1 magnitudes 0, 1, 2, 3, 4, 6, 8, 12: the nibbles of 0xC8643210 (as an int32)
            mag = (-932957680 >> (4 * (c & 7))) & 0xF
            ex = _u8(b3)
            d = tl.where(ex < 2, 0x00200000 << ex, (ex - 1) << 23).to(tl.float32, bitcast=True)
            val = _exact_f32(tl.where(c >= 8, -mag, mag) + 12, 12.0) * d
        return _emit(
            val,
            16 * h + l,
            base[:, None, None],
            lo[:, None, None],
            hi[:, None, None],
            ok[:, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            32,
            CAST,
        )
    else:  # TQ1_0: 5 base-3 digits of bytes 0-31 (values 32k + l) and 32-47 (160 + 16k + l), 4 of 48-51
        b3 = b[:, None, None]
        base3 = base[:, None, None]
        lo3 = lo[:, None, None]
        hi3 = hi[:, None, None]
        ok3 = ok[:, None, None]
        d = _hf16(b3 + 52)
        acc = _tq1_part(b3, base3, lo3, hi3, ok3, d, out_ptr, lo_out_ptr, 0, 4, 32, 0, 0, MODE, BF16, EDGES, NB, CAST)
        acc += _tq1_part(
            b3, base3, lo3, hi3, ok3, d, out_ptr, lo_out_ptr, 0, 1, 32, 4, 128, MODE, BF16, EDGES, NB, CAST
        )
        acc += _tq1_part(
            b3, base3, lo3, hi3, ok3, d, out_ptr, lo_out_ptr, 32, 4, 16, 0, 160, MODE, BF16, EDGES, NB, CAST
        )
        acc += _tq1_part(
            b3, base3, lo3, hi3, ok3, d, out_ptr, lo_out_ptr, 32, 1, 16, 4, 224, MODE, BF16, EDGES, NB, CAST
        )
        acc += _tq1_part(
            b3, base3, lo3, hi3, ok3, d, out_ptr, lo_out_ptr, 48, 4, 4, 0, 240, MODE, BF16, EDGES, NB, CAST
        )
        return acc


@triton.jit
def _blocks(
    raw_ptr,
    grid_ptr,
    blk,
    base,
    lo,
    hi,
    ok,
    out_ptr,
    lo_out_ptr,
    TYPE: tl.constexpr,
    MODE: tl.constexpr,
    BF16: tl.constexpr,
    EDGES: tl.constexpr,
    NB: tl.constexpr,
    VARIANT: tl.constexpr,
):
    """Decode the NB blocks at byte offsets `blk` [NB] (int64, always inside the bytes) and hand their values to
    `_emit` with the block's output offset `base`, its kept value range [lo, hi) and `ok` (the block is real).
    VARIANT 0: the layouts below; 1: `_grouped`'s for the types it has (`dequant.GROUPED_TYPES`), and for the
    other quantized types the layouts below with 16-bit loads of the float16 fields and Q5's fifth bits (every
    block there has an even size; the launch makes the bytes start at an even address)."""
    b = raw_ptr + blk
    CAST: tl.constexpr = VARIANT % 4 >= 2
    if VARIANT % 2 == 1 and (
        TYPE == 16
        or TYPE == 17
        or TYPE == 18
        or TYPE == 19
        or TYPE == 21
        or TYPE == 22
        or TYPE == 29
        or TYPE == 34
        or TYPE == 35
        or TYPE == 10
        or TYPE == 11
        or TYPE == 23
        or TYPE == 20
        or TYPE == 39
    ):
        return _grouped(
            b, grid_ptr, base, lo, hi, ok, out_ptr, lo_out_ptr, TYPE, MODE, BF16, EDGES, NB, CAST, VARIANT // 4
        )
    if (
        TYPE == 16
        or TYPE == 17
        or TYPE == 18
        or TYPE == 19
        or TYPE == 21
        or TYPE == 22
        or TYPE == 29
        or TYPE == 34
        or TYPE == 35
        or TYPE == 10
        or TYPE == 11
        or TYPE == 23
    ):
        val = _codebook_values(b[:, None], grid_ptr, TYPE)
        return _emit(
            val,
            tl.arange(0, 256)[None, :],
            base[:, None],
            lo[:, None],
            hi[:, None],
            ok[:, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    elif TYPE == 20:  # IQ4_NL: d, 16 bytes of level nibbles (values 0-15 low nibbles, 16-31 high)
        b2 = b[:, None]
        v = tl.arange(0, 32)[None, :]
        c = (_u8(b2 + 2 + v % 16) >> (4 * (v // 16))) & 0xF
        val = _f16(b2) * tl.load(grid_ptr + c).to(tl.float32)
        return _emit(
            val,
            v,
            base[:, None],
            lo[:, None],
            hi[:, None],
            ok[:, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            32,
            CAST,
        )
    elif TYPE == 39:  # MXFP4: an e8m0 scale byte, 16 bytes of e2m1 codes (values 0-15 low nibbles, 16-31 high)
        b2 = b[:, None]
        v = tl.arange(0, 32)[None, :]
        c = (_u8(b2 + 1 + v % 16) >> (4 * (v // 16))) & 0xF
        m = c & 7  # the doubled e2m1 magnitudes 0, 1, 2, 3, 4, 6, 8, 12
        mag = tl.where(m < 4, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        e = _u8(b2)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)  # 2^(e − 128)
        val = tl.where(c >= 8, -mag, mag).to(tl.float32) * d
        return _emit(
            val,
            v,
            base[:, None],
            lo[:, None],
            hi[:, None],
            ok[:, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            32,
            CAST,
        )
    elif TYPE == 12 or TYPE == 13:  # Q4_K: d dmin scales[12] qs[128]; Q5_K: d dmin scales[12] qh[32] qs[128]
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
        scale = _f16w(b4, VARIANT % 2 == 1) * sc
        bias = -_f16w(b4 + 2, VARIANT % 2 == 1) * mn
        if VARIANT % 2 == 1:
            val = _exact_f32(q, 0.0) * scale + bias
        else:
            val = q.to(tl.float32) * scale + bias
        idx = 64 * c + 32 * h + l
        return _emit(
            val,
            idx,
            base[:, None, None, None],
            lo[:, None, None, None],
            hi[:, None, None, None],
            ok[:, None, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
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
        sc = tl.where(
            l < 16, tl.load(b5 + 192 + s16).to(tl.int8, bitcast=True), tl.load(b5 + 193 + s16).to(tl.int8, bitcast=True)
        ).to(tl.float32)
        scale = _f16w(b5 + 208, VARIANT % 2 == 1) * sc
        if VARIANT % 2 == 1:
            val = _exact_f32(lo4 | (hi2 << 4), 32.0) * scale
        else:
            val = ((lo4 | (hi2 << 4)) - 32).to(tl.float32) * scale
        return _emit(
            val,
            idx,
            base[:, None, None, None, None],
            lo[:, None, None, None, None],
            hi[:, None, None, None, None],
            ok[:, None, None, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
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
        return _emit(
            val,
            idx,
            base[:, None, None],
            lo[:, None, None],
            hi[:, None, None],
            ok[:, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            256,
            CAST,
        )
    else:  # 32-value blocks: Q4_0 (d qs[16]), Q4_1 (d m qs[16]), Q5_0 (d qh[4] qs[16]), Q5_1 (d m qh[4] qs[16]), Q8_0
        h = tl.arange(0, 2)[None, :, None]
        l = tl.arange(0, 16)[None, None, :]
        idx = 16 * h + l
        b3 = b[:, None, None]
        d = _f16w(b3, VARIANT % 2 == 1)
        if TYPE == 8:  # d int8[32]
            if VARIANT % 2 == 1:
                val = _i8_f32(b3 + 2 + idx) * d
            else:
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
                qh = _u32w(qs - 4, VARIANT % 2 == 1)  # [NB,1,1]
                q = q | (((qh >> idx) & 1) << 4)
            if TYPE == 2:
                val = _exact_f32(q, 8.0) * d if VARIANT % 2 == 1 else (q - 8).to(tl.float32) * d
            elif TYPE == 6:
                val = _exact_f32(q, 16.0) * d if VARIANT % 2 == 1 else (q - 16).to(tl.float32) * d
            else:  # Q4_1, Q5_1: d·q + m
                qf = _exact_f32(q, 0.0) if VARIANT % 2 == 1 else q.to(tl.float32)
                val = qf * d + _f16w(b3 + 2, VARIANT % 2 == 1)
        return _emit(
            val,
            idx,
            base[:, None, None],
            lo[:, None, None],
            hi[:, None, None],
            ok[:, None, None],
            out_ptr,
            lo_out_ptr,
            MODE,
            BF16,
            EDGES,
            NB,
            32,
            CAST,
        )


@triton.jit
def dequant_kernel(
    raw_ptr,
    grid_ptr,
    out_ptr,
    lo_out_ptr,
    row_units,
    row0,
    blk0,
    n_blk,
    n_out_rows,
    col0,
    col1,
    out_stride,
    TYPE: tl.constexpr,
    B: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    RA: tl.constexpr,
    BF16: tl.constexpr,
    EDGES: tl.constexpr,
    NB: tl.constexpr,
    SPLIT: tl.constexpr,
    VARIANT: tl.constexpr,
):
    """Write W[row0 : row0 + n_out_rows, col0:col1] into out (row stride `out_stride`, column col0 at 0); SPLIT: its
    bf16 halves w_hi into out and w_lo into lo_out (the same row stride; unused otherwise). The
    program takes NB consecutive blocks of the flattened (output row, block column) grid; block columns run from
    blk0 for n_blk blocks. Bytes of a row: row_units · RA (RA: a power of two dividing it, so the compiler knows the
    rows' alignment). EDGES: col0 or col1 cut a block (values outside [col0, col1) are decoded but not stored)."""
    g = tl.program_id(0) * NB + tl.arange(0, NB)  # int32: a weight has fewer than 2^31 blocks
    total = n_out_rows * n_blk
    ok = g < total
    if VARIANT == 0:
        g = tl.minimum(g, total - 1)  # past the end: decode the last block again (never stored), loads need no mask
        r = g // n_blk
        bc = blk0 + (g - r * n_blk)
    else:  # one division a program: its first block's row; the others are at most one row further when NB ≤ n_blk
        start = tl.program_id(0) * NB
        r_first = start // n_blk
        c = (start - r_first * n_blk) + tl.arange(0, NB)
        if n_blk >= NB:
            wrap = c >= n_blk
            r = r_first + wrap.to(tl.int32)
            c = c - tl.where(wrap, n_blk, 0)
        else:
            step = c // n_blk
            r = r_first + step
            c = c - step * n_blk
        r = tl.where(ok, r, n_out_rows - 1)  # past the end: the last block again (never stored)
        bc = blk0 + tl.where(ok, c, n_blk - 1)
    blk = (row0 + r).to(tl.int64) * (row_units * RA) + bc * BLOCK_BYTES
    first = bc * B  # absolute column of the block's first value
    base = r.to(tl.int64) * out_stride + (first - col0)
    lo = col0 - first
    hi = col1 - first
    if SPLIT:
        _blocks(raw_ptr, grid_ptr, blk, base, lo, hi, ok, out_ptr, lo_out_ptr, TYPE, 2, True, EDGES, NB, VARIANT)
    else:
        _blocks(raw_ptr, grid_ptr, blk, base, lo, hi, ok, out_ptr, out_ptr, TYPE, 0, BF16, EDGES, NB, VARIANT)


@triton.jit
def matvec_kernel(
    raw_ptr,
    grid_ptr,
    x_ptr,
    y_ptr,
    n_rows,
    n_cols,
    n_blk,
    row_units,
    x_stride,
    y_stride,
    TYPE: tl.constexpr,
    B: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    RA: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
    VARIANT: tl.constexpr,
):
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
        acc += _blocks(
            raw_ptr,
            grid_ptr,
            blk,
            t * x_stride + first,
            hi * 0,
            hi,
            ok,
            x_ptr,
            x_ptr,
            TYPE,
            1,
            ROUND_BF16,
            True,
            BN * KB,
            VARIANT,
        )
    y = tl.sum(tl.reshape(acc, [BN, KB]), axis=1)
    r = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    tl.store(y_ptr + t * y_stride + r, y, mask=r < n_rows)
