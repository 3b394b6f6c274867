"""The GEMV of playback decode: `y[t] = x[t] · Wᵀ` for 1 to 4 tokens straight from the GGML blocks (Triton; imported
only when a GPU or interpreted path first runs). The launch wrapper, its per-type configurations and the eager
reference are in `juno_py.kernels.dequant` (`dequant_matvec`, `MATVEC_CONFIG`, `matvec_reference`).

Types: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (`GEMV_TYPES`); the others keep `dequant_triton.matvec_kernel`.

A program takes BR consecutive rows and, split-K, one of SPLIT equal ranges of their blocks, KB blocks of each row a
step. The bytes are read as words: int32 for the types whose blocks are 4-byte multiples (Q4_1 20, Q4_K 144,
Q5_K 176 bytes: the row's bytes are passed as an int32 view, and a block's code words are one contiguous run, 16
bytes a load where the alignment allows), int16 for the others (Q4_0 18, Q8_0 34, Q6_K 210 bytes). A step's values
are a tensor `[BR, KB, G, M, I]`: G × M words of each block (the same word tensor for every value the word holds),
I the bytes (or halfword bytes) of a word, one tensor per nibble or bit-plane part (`PART`); the float16 scales and
the K-quants' 6-bit sub-block scales are decoded once per block or sub-block (`[BR, KB, G, 1, 1]`) and broadcast.
Each value is `code · scale (+ bias)` with the torch codec's fp32 operations (the product exact, so a fused
multiply-add changes nothing; the code made a float without an integer-to-float conversion when MAGIC), rounded to
bf16 when ROUND_BF16 (as the tile path multiplies it: the hardware's conversion when HW_ROUND, else integer
operations, which the interpreter needs), times x, accumulated in fp32 per token in a tensor of the step's shape,
and reduced once at the end. Every token's product comes from one read of the weight bytes. bf16 x (playback's) is read as words of the I values one
weight word multiplies (int64 for 4, int32 for 2) and taken apart with integer operations, so that x arrives in
the weight words' layout: read element by element, Triton gave x its own layout and exchanged every step's values
through shared memory (`benchmarks/gemv_compile.py` shows the conversions and the shared memory of a build). Other
x dtypes are read element by element, widened to fp32 exactly.

SPLIT = 1 writes y (fp32, or bf16 rounded to nearest even with integer operations) directly; SPLIT > 1 writes fp32
partial sums `[SPLIT, T, n_rows]` that `gemv_finish_kernel` adds in split order (deterministic: the same bits every
run, so a replayed CUDA graph equals the eager step). Either may add a LoRA term alpha · xa · Bᵀ (xa = x · Aᵀ
computed before, `[T, rank]`; B `[n_rows, rank]`) to the fp32 sums before they are rounded and stored: a played
adapter then costs its x · Aᵀ product and nothing more. Unsplit, the term is summed in rank order with elementwise
operations (`_lora`), so its bits do not depend on the layout the compiler picks for it.

`gemv_group_kernel` runs the unsplit GEMV of 2 or 3 matrices of one type and width that read one x (a block's q, k
and v; its gate and up) in one launch, each part with its own row count and LoRA term, the parts addressed as word
offsets from the first part's words; or, for gate and up, stores act(gate)·up (silu or gelu_tanh) instead, the
activation of `elementwise_triton._gated_fwd_kernel` applied to the two products as the GEMV would have stored
them. Both kernels share the step loop (`_accumulate`) and epilogue helpers, so each part's bits are
`gemv_kernel`'s.
"""

import triton
import triton.language as tl

from juno_py.kernels.elementwise_triton import _gate_sigmoid

# GGML type numbers: Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14
GEMV_TYPES = (2, 3, 8, 12, 13, 14)
# the word each type's bytes are read as (bytes), the block's size in those words, and the value parts
WORD_BYTES = {2: 2, 3: 4, 8: 2, 12: 4, 13: 4, 14: 2}
BLOCK_WORDS = {2: 9, 3: 5, 8: 17, 12: 36, 13: 44, 14: 105}
BLOCK_VALUES = {2: 32, 3: 32, 8: 32, 12: 256, 13: 256, 14: 256}
# the value tensors `_values` makes of a step's words: 2 (the nibbles; Q6_K's bit planes) or 1 (Q8_0's bytes)
PARTS = {2: 2, 3: 2, 8: 1, 12: 2, 13: 2, 14: 2}


@triton.jit
def _half(bits):
    """The float16 whose bits are the low 16 bits of the int32 `bits`, as fp32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _round_bf16(v):
    """fp32 rounded to bf16 (nearest even, with integer operations: the interpreter truncates a float cast), kept as
    fp32; NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def _code_f32(q, offset: tl.constexpr, MAGIC: tl.constexpr):
    """The integer code `q − offset` (q in [0, 2²³)) as fp32, exactly. MAGIC: without an integer-to-float
    conversion (a quarter-rate instruction on the GPU, where a GEMV's decode is bound by its instructions, not its
    bytes): q's bits under the exponent of 2²³ make the float 2²³ + q, and subtracting 2²³ + offset leaves q −
    offset, both operands and the result being integers that fp32 holds exactly."""
    if MAGIC:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)
    else:
        return (q - offset).to(tl.float32)


@triton.jit
def _k_scale_min(b8, sub):
    """(scale, minimum) codes of the 6-bit pairs of a Q4_K/Q5_K block: `b8` its first byte's address, `sub` the
    sub-block (0..7), as fp32."""
    low = sub < 4
    s_a = tl.load(b8 + 4 + sub).to(tl.int32)
    s_b = tl.load(b8 + 8 + sub).to(tl.int32)
    s_c = tl.load(b8 + 4 + tl.where(low, sub, sub - 4)).to(tl.int32)
    sc = tl.where(low, s_a & 63, (s_b & 0xF) | ((s_c >> 6) << 4)).to(tl.float32)
    mn = tl.where(low, s_b & 63, (s_b >> 4) | ((s_a >> 6) << 4)).to(tl.float32)
    return sc, mn


@triton.jit
def _values(raw8_ptr, rw_ptr, wb, TYPE: tl.constexpr, PART: tl.constexpr, MAGIC: tl.constexpr):
    """(values, x offsets inside the block) of part PART of the blocks whose first word is at word offsets `wb`
    `[BR, KB, 1, 1, 1]` (int64) of `rw_ptr` (the bytes as int32 or int16 words; `raw8_ptr`: as bytes). Shapes
    `[BR, KB, G, M, I]`; the offsets `[1, 1, G, M, 1]` are those of each word's first value (byte i of a word is the
    value i after it)."""
    if TYPE == 12 or TYPE == 13:  # Q4_K: d dmin sc[12] qs[128]; Q5_K: d dmin sc[12] qh[32] qs[128] (int32 words)
        c = tl.arange(0, 4)[None, None, :, None, None]  # 64 values: qs bytes 32c .. 32c + 31
        m = tl.arange(0, 8)[None, None, None, :, None]  # word m of them
        i = tl.arange(0, 4)[None, None, None, None, :]  # byte i of the word: l = 4m + i
        w0 = tl.load(rw_ptr + wb)  # d | dmin << 16
        q_off = 4 if TYPE == 12 else 12
        qw = tl.load(rw_ptr + wb + q_off + 8 * c + m)  # [BR, KB, 4, 8, 1]
        q = (qw >> (8 * i + 4 * PART)) & 0xF  # value 64c + 32·PART + l
        if TYPE == 13:
            hw = tl.load(rw_ptr + wb + 4 + m)  # qh bytes 4m .. 4m + 3: bit 2c + PART of byte l
            q = q | (((hw >> (8 * i + 2 * c + PART)) & 1) << 4)
        sc, mn = _k_scale_min(raw8_ptr + 4 * wb, 2 * c + PART)  # [BR, KB, 4, 1, 1]
        scale = _half(w0) * sc
        bias = -_half(w0 >> 16) * mn
        return _code_f32(q, 0, MAGIC) * scale + bias, 64 * c + 32 * PART + 4 * m
    elif TYPE == 14:  # Q6_K: ql[128] qh[64] int8 sc[16] d (int16 words)
        g = tl.arange(0, 8)[None, None, :, None, None]  # (n, b, mh) = (g // 4, g // 2 % 2, g % 2)
        m = tl.arange(0, 8)[None, None, None, :, None]
        i = tl.arange(0, 2)[None, None, None, None, :]  # l = 16mh + 2m + i
        n = g // 4
        b = (g // 2) % 2
        mh = g % 2
        ql = tl.load(rw_ptr + wb + 8 * g + m).to(tl.int32)  # ql byte 64n + 32b + l
        qh = tl.load(rw_ptr + wb + 64 + 16 * n + 8 * mh + m).to(tl.int32)  # qh byte 32n + l
        lo4 = (ql >> (8 * i + 4 * PART)) & 0xF
        hi2 = (qh >> (8 * i + 2 * (2 * PART + b))) & 3
        sc = tl.load(raw8_ptr + 2 * wb + 192 + 8 * n + 4 * PART + 2 * b + mh).to(tl.int8, bitcast=True)
        scale = _half(tl.load(rw_ptr + wb + 104).to(tl.int32)) * sc.to(tl.float32)
        return _code_f32(lo4 | (hi2 << 4), 32, MAGIC) * scale, 128 * n + 64 * PART + 32 * b + 16 * mh + 2 * m
    elif TYPE == 8:  # Q8_0: d int8[32] (int16 words)
        m = tl.arange(0, 16)[None, None, None, :, None]
        i = tl.arange(0, 2)[None, None, None, None, :]
        hw = tl.load(rw_ptr + wb + 1 + m).to(tl.int32)
        q = ((hw >> (8 * i)) & 0xFF) ^ 0x80  # the signed byte i of the halfword, plus 128
        d = _half(tl.load(rw_ptr + wb).to(tl.int32))
        return _code_f32(q, 128, MAGIC) * d, 2 * m
    elif TYPE == 2:  # Q4_0: d qs[16] (int16 words): value 16h + l = (qs[l] >> 4h) − 8
        m = tl.arange(0, 8)[None, None, None, :, None]
        i = tl.arange(0, 2)[None, None, None, None, :]
        hw = tl.load(rw_ptr + wb + 1 + m).to(tl.int32)
        q = (hw >> (8 * i + 4 * PART)) & 0xF
        d = _half(tl.load(rw_ptr + wb).to(tl.int32))
        return _code_f32(q, 8, MAGIC) * d, 16 * PART + 2 * m
    else:  # Q4_1: d m qs[16] (int32 words): value 16h + l = d·(qs[l] >> 4h) + m
        m = tl.arange(0, 4)[None, None, None, :, None]
        i = tl.arange(0, 4)[None, None, None, None, :]
        w0 = tl.load(rw_ptr + wb)
        qw = tl.load(rw_ptr + wb + 1 + m)
        q = (qw >> (8 * i + 4 * PART)) & 0xF
        return _code_f32(q, 0, MAGIC) * _half(w0) + _half(w0 >> 16), 16 * PART + 4 * m


@triton.jit
def _dot(w, x_ptr, xo, ok, EVEN: tl.constexpr, XI: tl.constexpr, XPACK: tl.constexpr):
    """w · x over the step's values, elementwise; outside the blocks (`ok` false) x is 0. XPACK: x is bf16 read as
    words of XI values (int64 for 4, int32 for 2) at word offsets `xo` `[1, KB, G, M, 1]`, each word's values taken
    apart with integer operations, so x arrives in the weight words' own layout (no exchange through shared memory
    a step); else x (any float dtype) at element offsets `xo` + i."""
    i = tl.arange(0, XI)[None, None, None, None, :]
    if XPACK:
        if EVEN:
            xw = tl.load(x_ptr + xo)
        else:
            xw = tl.load(x_ptr + xo, mask=ok, other=0)
        x = (((xw >> (16 * i)) & 0xFFFF).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif EVEN:
        x = tl.load(x_ptr + (xo + i)).to(tl.float32)
    else:
        x = tl.load(x_ptr + (xo + i), mask=ok, other=0.0).to(tl.float32)
    if EVEN:
        return w * x
    else:
        return tl.where(ok, w * x, 0.0)


@triton.jit
def _zeros(TYPE: tl.constexpr, BR: tl.constexpr, KB: tl.constexpr):
    """An fp32 accumulator of the step's value shape."""
    if TYPE == 12 or TYPE == 13:
        return tl.zeros((BR, KB, 4, 8, 4), dtype=tl.float32)
    elif TYPE == 14:
        return tl.zeros((BR, KB, 8, 8, 2), dtype=tl.float32)
    elif TYPE == 8:
        return tl.zeros((BR, KB, 1, 16, 2), dtype=tl.float32)
    elif TYPE == 2:
        return tl.zeros((BR, KB, 1, 8, 2), dtype=tl.float32)
    else:
        return tl.zeros((BR, KB, 1, 4, 4), dtype=tl.float32)


@triton.jit
def _reduce(acc):
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2), axis=1)


@triton.jit
def _store(out_ptr, y, rows, keep, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        bits = y.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + rows, tl.where(y != y, 0x7FC0, r).to(tl.int16), mask=keep)
    else:
        tl.store(out_ptr + rows, y, mask=keep)


@triton.jit
def _accumulate(
    raw8_ptr,
    rw_ptr,
    x_ptr,
    x_stride,
    row_w,
    k_lo,
    k_hi,
    TYPE: tl.constexpr,
    B: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    T: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    EVEN: tl.constexpr,
    MAGIC: tl.constexpr,
    HW_ROUND: tl.constexpr,
    NPART: tl.constexpr,
    XI: tl.constexpr,
    XPACK: tl.constexpr,
    BR: tl.constexpr,
    KB: tl.constexpr,
):
    """The fp32 products of blocks [k_lo, k_hi) of BR rows with each of T tokens, unreduced: one accumulator of the
    step's value shape per token (`_zeros`; tokens past T keep zeros). The rows' first words are at word offsets
    `row_w` `[BR, 1, 1, 1, 1]` (int64) of `rw_ptr`."""
    kk = tl.arange(0, KB)[None, :, None, None, None]
    acc0 = _zeros(TYPE, BR, KB)
    acc1 = _zeros(TYPE, BR, KB)
    acc2 = _zeros(TYPE, BR, KB)
    acc3 = _zeros(TYPE, BR, KB)
    for k0 in range(k_lo, k_hi, KB):
        bc = k0 + kk  # [1, KB, 1, 1, 1]
        ok = bc < k_hi
        if EVEN:
            bcc = bc.to(tl.int64)
        else:
            bcc = tl.minimum(bc, k_hi - 1).to(tl.int64)
        wb = row_w + bcc * BLOCK_WORDS
        xb = bcc * B
        for p in tl.static_range(NPART):
            w, xo = _values(raw8_ptr, rw_ptr, wb, TYPE, p, MAGIC)
            if ROUND_BF16:
                if HW_ROUND:
                    w = w.to(tl.bfloat16).to(tl.float32)
                else:
                    w = _round_bf16(w)
            xo = xb + xo
            if XPACK:
                xo = xo // XI
            acc0 += _dot(w, x_ptr, xo, ok, EVEN, XI, XPACK)
            if T > 1:
                acc1 += _dot(w, x_ptr + x_stride, xo, ok, EVEN, XI, XPACK)
            if T > 2:
                acc2 += _dot(w, x_ptr + 2 * x_stride, xo, ok, EVEN, XI, XPACK)
            if T > 3:
                acc3 += _dot(w, x_ptr + 3 * x_stride, xo, ok, EVEN, XI, XPACK)
    return acc0, acc1, acc2, acc3


@triton.jit
def gemv_kernel(
    raw8_ptr,
    rw_ptr,
    x_ptr,
    y_ptr,
    n_rows,
    n_blk,
    split_blk,
    row_units,
    x_stride,
    y_stride,
    xa_ptr,
    lb_ptr,
    alpha,
    rank,
    xa_stride,
    lb_stride,
    TYPE: tl.constexpr,
    B: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    RA: tl.constexpr,
    T: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN: tl.constexpr,
    MAGIC: tl.constexpr,
    HW_ROUND: tl.constexpr,
    NPART: tl.constexpr,
    XI: tl.constexpr,
    XPACK: tl.constexpr,
    RP: tl.constexpr,
    BR: tl.constexpr,
    KB: tl.constexpr,
):
    """y[t, rows] = Σ over blocks [s·split_blk, (s + 1)·split_blk) of x[t] · W[rows]ᵀ for the program's BR rows and
    split s = program_id(1), all T tokens. A row is row_units · RA words (RA: a power of two dividing it, so the
    compiler knows the rows' alignment). PARTIAL: store fp32 partial sums at y + (s·T + t)·n_rows (y_stride
    unused); else y[t] at y + t·y_stride (bf16 bits when OUT_BF16). EVEN: every step's KB blocks are inside the
    split and the row (no masks). NPART: the value parts of a word (`PARTS`); XI: the values of a part a word holds
    (its bytes: `WORD_BYTES`); XPACK: x is bf16 passed as words of XI values (x_stride in those words). RP > 0 (a
    power of two ≥ rank): a LoRA term is added to y before it is stored (`_lora`; by `gemv_finish_kernel` when
    PARTIAL)."""
    s = tl.program_id(1)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    keep = rows < n_rows
    rows_c = tl.minimum(rows, n_rows - 1).to(tl.int64)
    row_w = (rows_c * (row_units * RA))[:, None, None, None, None]  # [BR, 1, 1, 1, 1]
    k_lo = s * split_blk
    k_hi = tl.minimum(k_lo + split_blk, n_blk)
    acc0, acc1, acc2, acc3 = _accumulate(
        raw8_ptr,
        rw_ptr,
        x_ptr,
        x_stride,
        row_w,
        k_lo,
        k_hi,
        TYPE,
        B,
        BLOCK_WORDS,
        T,
        ROUND_BF16,
        EVEN,
        MAGIC,
        HW_ROUND,
        NPART,
        XI,
        XPACK,
        BR,
        KB,
    )
    if PARTIAL:
        base = y_ptr + s.to(tl.int64) * T * n_rows
        _store(base, _reduce(acc0), rows, keep, False)
        if T > 1:
            _store(base + n_rows, _reduce(acc1), rows, keep, False)
        if T > 2:
            _store(base + 2 * n_rows, _reduce(acc2), rows, keep, False)
        if T > 3:
            _store(base + 3 * n_rows, _reduce(acc3), rows, keep, False)
    else:
        y0 = _reduce(acc0)
        if RP > 0:
            y0 += _lora(rows_c, 0, xa_ptr, lb_ptr, alpha, rank, xa_stride, lb_stride, RP)
        _store(y_ptr, y0, rows, keep, OUT_BF16)
        if T > 1:
            y1 = _reduce(acc1)
            if RP > 0:
                y1 += _lora(rows_c, 1, xa_ptr, lb_ptr, alpha, rank, xa_stride, lb_stride, RP)
            _store(y_ptr + y_stride, y1, rows, keep, OUT_BF16)
        if T > 2:
            y2 = _reduce(acc2)
            if RP > 0:
                y2 += _lora(rows_c, 2, xa_ptr, lb_ptr, alpha, rank, xa_stride, lb_stride, RP)
            _store(y_ptr + 2 * y_stride, y2, rows, keep, OUT_BF16)
        if T > 3:
            y3 = _reduce(acc3)
            if RP > 0:
                y3 += _lora(rows_c, 3, xa_ptr, lb_ptr, alpha, rank, xa_stride, lb_stride, RP)
            _store(y_ptr + 3 * y_stride, y3, rows, keep, OUT_BF16)


@triton.jit
def _lora(rows, t, xa_ptr, lb_ptr, alpha, rank, xa_stride, lb_stride, RP: tl.constexpr):
    """alpha · Σ_j B[rows, j] · xa[t, j] over the adapter's rank (fp32; B `[n_rows, rank]` and xa `[T, rank]` in
    their own dtypes): a LoRA term, added to the frozen product before it is rounded and stored. Summed in the order
    of j, a column of B a step: elementwise operations only, whose bits do not depend on the layout the compiler
    gives the rows (a reduction's order does, and the layout follows the code around it), so every kernel that adds
    the term (`gemv_kernel`, `gemv_group_kernel`) adds the same bits. The loads of all RP steps are independent."""
    b_row = lb_ptr + rows.to(tl.int64) * lb_stride
    xa_row = xa_ptr + t * xa_stride
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for j in tl.static_range(RP):
        # the row mask as a tensor of the rows' shape (the interpreter broadcasts a scalar mask as int32)
        b = tl.load(b_row + j, mask=tl.full(rows.shape, j, tl.int32) < rank, other=0.0).to(tl.float32)
        acc += b * tl.load(xa_row + j, mask=rank > j, other=0.0).to(tl.float32)
    return alpha * acc


@triton.jit
def gemv_finish_kernel(
    part_ptr,
    y_ptr,
    n_rows,
    n,
    y_stride,
    xa_ptr,
    lb_ptr,
    alpha,
    rank,
    xa_stride,
    lb_stride,
    SPLIT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    RP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y[t, r] = Σ_s part[s, t, r] added in split order (n = T · n_rows entries), plus the LoRA term when RP > 0,
    fp32 or bf16 bits."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < n
    acc = tl.load(part_ptr + e, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * n + e, mask=ok, other=0.0)
    ec = tl.minimum(e, n - 1)
    t = ec // n_rows
    r = ec - t * n_rows
    if RP > 0:
        j = tl.arange(0, RP)[None, :]
        jok = j < rank
        b = tl.load(lb_ptr + r.to(tl.int64)[:, None] * lb_stride + j, mask=jok, other=0.0).to(tl.float32)
        xa = tl.load(xa_ptr + t[:, None] * xa_stride + j, mask=jok, other=0.0).to(tl.float32)
        acc += alpha * tl.sum(b * xa, axis=1)
    _store(y_ptr + t * y_stride, acc, r, ok, OUT_BF16)


@triton.jit
def _pick(part, v0, v1, v2):
    """v0, v1 or v2 for part 0, 1 or 2 (scalars or pointers; an argument equal to 1 arrives as a constant, and the
    selection makes it a tensor)."""
    return tl.where(part == 2, v2, tl.where(part == 1, v1, v0))


@triton.jit
def _group_out(
    acc,
    acc_up,
    t,
    y_ptr,
    y_stride,
    col,
    part,
    rows,
    rows_c,
    keep,
    xa0_ptr,
    lb0_ptr,
    alpha0,
    rank0,
    xa0_stride,
    lb0_stride,
    xa1_ptr,
    lb1_ptr,
    alpha1,
    rank1,
    xa1_stride,
    lb1_stride,
    xa2_ptr,
    lb2_ptr,
    alpha2,
    rank2,
    xa2_stride,
    lb2_stride,
    RP: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ACT: tl.constexpr,
):
    """Token t's results of a `gemv_group_kernel` program from its accumulators: `gemv_kernel`'s epilogue (the sum,
    its part's LoRA term, the rounded store at column `col`), or with ACT the gated activation of gate (`acc`, part
    0) and up (`acc_up`, part 1): each first rounded as `_store` would store it, then act(gate)·up as
    `elementwise_triton._gated_fwd_kernel` computes and stores it. The LoRA term is added without a branch, the
    part's arguments selected: `y + alpha · Σ` then compiles as in `gemv_kernel` (one fused multiply-add), while
    with a branch a part LLVM moves the addition after the branches' join, apart from the product it rounds."""
    y = _reduce(acc)
    if ACT > 0:
        if RP > 0:
            y += _lora(rows_c, t, xa0_ptr, lb0_ptr, alpha0, rank0, xa0_stride, lb0_stride, RP)
        u = _reduce(acc_up)
        if RP > 0:
            u += _lora(rows_c, t, xa1_ptr, lb1_ptr, alpha1, rank1, xa1_stride, lb1_stride, RP)
        if OUT_BF16:
            y = _round_bf16(y)
            u = _round_bf16(u)
        sig, _ = _gate_sigmoid(y, ACT == 2)
        _store(y_ptr + t * y_stride, (y * sig) * u, rows, keep, OUT_BF16)
    else:
        if RP > 0:
            y += _lora(
                rows_c,
                t,
                _pick(part, xa0_ptr, xa1_ptr, xa2_ptr),
                _pick(part, lb0_ptr, lb1_ptr, lb2_ptr),
                _pick(part, alpha0, alpha1, alpha2),
                _pick(part, rank0, rank1, rank2),
                _pick(part, xa0_stride, xa1_stride, xa2_stride),
                _pick(part, lb0_stride, lb1_stride, lb2_stride),
                RP,
            )
        _store(y_ptr + t * y_stride + col, y, rows, keep, OUT_BF16)


@triton.jit
def gemv_group_kernel(
    raw8_ptr,
    rw_ptr,
    x_ptr,
    y_ptr,
    rows0,
    rows1,
    rows2,
    off1,
    off2,
    n_blk,
    row_units,
    x_stride,
    y_stride,
    xa0_ptr,
    lb0_ptr,
    alpha0,
    rank0,
    xa0_stride,
    lb0_stride,
    xa1_ptr,
    lb1_ptr,
    alpha1,
    rank1,
    xa1_stride,
    lb1_stride,
    xa2_ptr,
    lb2_ptr,
    alpha2,
    rank2,
    xa2_stride,
    lb2_stride,
    TYPE: tl.constexpr,
    B: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    RA: tl.constexpr,
    OA: tl.constexpr,
    T: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    EVEN: tl.constexpr,
    MAGIC: tl.constexpr,
    HW_ROUND: tl.constexpr,
    NPART: tl.constexpr,
    XI: tl.constexpr,
    XPACK: tl.constexpr,
    NG: tl.constexpr,
    ACT: tl.constexpr,
    RP: tl.constexpr,
    BR: tl.constexpr,
    KB: tl.constexpr,
):
    """`gemv_kernel` (unsplit) over NG = 2 or 3 matrices of one type and width that read the same x, in one
    launch. Part i has rows_i rows; its words start off_i · OA words after rw_ptr's (part 0's; OA a power of two
    dividing every offset, so the compiler keeps the rows' alignment), so the parts may be separate tensors. Without
    ACT, programs 0 .. g0 − 1 take part 0's rows (g_i = cdiv(rows_i, BR)), the next g1 part 1's, then part 2's, and
    y[t] (at y + t·y_stride) holds part i's columns from rows_0 + … + rows_{i−1} on. ACT (1 silu, 2 gelu_tanh;
    NG = 2, rows1 = rows0): a program takes BR rows of gate (part 0) and the same rows of up (part 1) and stores
    act(gate)·up `[T, rows0]` (`_group_out`). RP > 0 (a power of two ≥ every rank_i): each part adds its LoRA term
    (xa_i `[T, rank_i]`, B_i `[rows_i, rank_i]`, alpha_i; rank_i = 0 for a part without one, whose term is then +0,
    which leaves the sum's bits as they are). Each part's sums are `gemv_kernel`'s, bit for bit: the same steps,
    accumulator shapes and reductions (each part's rows in a loop of their own) and the same epilogue."""
    pid = tl.program_id(0)
    if ACT > 0:
        part = 0
        col = 0
        rows = pid * BR + tl.arange(0, BR)
        keep = rows < rows0
        rows_c = tl.minimum(rows, rows0 - 1).to(tl.int64)
        row_w = (rows_c * (row_units * RA))[:, None, None, None, None]
    else:
        g0 = tl.cdiv(rows0, BR)
        g1 = tl.cdiv(rows1, BR)
        part = tl.where(pid >= g0, 1, 0)
        if NG > 2:
            part += tl.where(pid >= g0 + g1, 1, 0)
        first = tl.where(part > 0, g0, 0) + tl.where(part > 1, g1, 0)
        n = _pick(part, rows0, rows1, rows2)
        col = tl.where(part > 0, rows0, 0) + tl.where(part > 1, rows1, 0)
        rows = (pid - first) * BR + tl.arange(0, BR)
        keep = rows < n
        rows_c = tl.minimum(rows, n - 1).to(tl.int64)
        off = _pick(part, 0, off1, off2).to(tl.int64) * OA
        row_w = (off + rows_c * (row_units * RA))[:, None, None, None, None]
    acc0, acc1, acc2, acc3 = _accumulate(
        raw8_ptr,
        rw_ptr,
        x_ptr,
        x_stride,
        row_w,
        0,
        n_blk,
        TYPE,
        B,
        BLOCK_WORDS,
        T,
        ROUND_BF16,
        EVEN,
        MAGIC,
        HW_ROUND,
        NPART,
        XI,
        XPACK,
        BR,
        KB,
    )
    if ACT > 0:
        # up's rows in a loop of their own, as gate's: in one loop over both, the compiler may give one of the two
        # accumulators another layout than `gemv_kernel`'s (sm_90: Q8_0, Q6_K), and so another order of its sum
        up0, up1, up2, up3 = _accumulate(
            raw8_ptr,
            rw_ptr,
            x_ptr,
            x_stride,
            row_w + _pick(1, 0, off1, off2).to(tl.int64) * OA,
            0,
            n_blk,
            TYPE,
            B,
            BLOCK_WORDS,
            T,
            ROUND_BF16,
            EVEN,
            MAGIC,
            HW_ROUND,
            NPART,
            XI,
            XPACK,
            BR,
            KB,
        )
    else:
        up0, up1, up2, up3 = acc0, acc1, acc2, acc3
    for t in tl.static_range(T):
        if t == 0:
            acc, up = acc0, up0
        elif t == 1:
            acc, up = acc1, up1
        elif t == 2:
            acc, up = acc2, up2
        else:
            acc, up = acc3, up3
        _group_out(
            acc,
            up,
            t,
            y_ptr,
            y_stride,
            col,
            part,
            rows,
            rows_c,
            keep,
            xa0_ptr,
            lb0_ptr,
            alpha0,
            rank0,
            xa0_stride,
            lb0_stride,
            xa1_ptr,
            lb1_ptr,
            alpha1,
            rank1,
            xa1_stride,
            lb1_stride,
            xa2_ptr,
            lb2_ptr,
            alpha2,
            rank2,
            xa2_stride,
            lb2_stride,
            RP,
            OUT_BF16,
            ACT,
        )


@triton.jit
def lora_xa_kernel(
    x_ptr, a_ptr, out_ptr, n_rows, d, a_stride, OUT_BF16: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr
):
    """xa[j] = Σ_k x[k] · A[j, k] for one token: RB rows of A a program, fp32 sums of the operands' values (bf16 or
    fp32, widened exactly), stored as fp32 or bf16 rounded to nearest even. The x·Aᵀ of a played LoRA (or of the
    concatenated A's of the linears that read one input) without cuBLAS's split-K GEMM and its reduction: two
    launches of a few microseconds each, for a product of a few thousand multiply-adds."""
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    keep = rows < n_rows
    rows_c = tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None]
    acc = tl.zeros((RB, BLOCK), dtype=tl.float32)
    for k0 in range(0, d, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        ok = cols < d
        a = tl.load(a_ptr + rows_c * a_stride + cols[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        acc += a * xv[None, :]
    _store(out_ptr, tl.sum(acc, axis=1), rows, keep, OUT_BF16)
