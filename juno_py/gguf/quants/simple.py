"""Codecs of the element types (F32, F16, BF16) and of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
and the pieces every block codec is built from: bit-field unpacking, the block layout table, chunked decoding.

Results equal the `gguf` package's bit for bit (decode) and byte for byte (encode): every float32 operation
happens in the same order as there, and float-to-integer casts truncate the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import numpy as np
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.registry import register

# Blocks are processed in chunks of about this many elements: the temporaries of a chunk (a few MB) stay in
# cache, so that only the result travels to memory, and each torch call covers enough data that its fixed cost
# (several µs) stays small. Measured on a 2-core EPYC: 2^18 to 2^20 are within 10 %, 2^16 is much slower.
CHUNK_ELEMENTS = 1 << 19

ScaleFn = Callable[..., "tuple[torch.Tensor, Optional[torch.Tensor]]"]


# ---- chunking ----------------------------------------------------------------------------------------------------


def for_each_chunk(n_blocks: int, block_size: int, step: Callable[[slice], None]) -> None:
    """Call `step(blocks)` on consecutive slices of blocks covering `n_blocks`, each about CHUNK_ELEMENTS long."""
    per_chunk = max(1, CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, per_chunk):
        step(slice(start, min(start + per_chunk, n_blocks)))


def new_result(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for a codec's result, allocated by numpy: numpy asks the kernel for huge pages for
    large arrays, which makes the first touch of a fresh multi-MB result about 4× cheaper than through torch's
    allocator (on a 2-core EPYC VM, page faults otherwise cost as much as decoding). bfloat16 is allocated as
    numpy int16 and viewed."""
    if dtype == torch.bfloat16:  # numpy has no bfloat16: the same bytes as int16
        return torch.from_numpy(np.empty(shape, dtype=np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))


_NUMPY_DTYPES = {torch.float32: np.float32, torch.uint8: np.uint8}


def aligned_blocks(raw: torch.Tensor) -> torch.Tensor:
    """raw as a contiguous tensor whose bytes can be viewed as float16/float32 fields (GGUF data always can;
    a buffer sliced at an odd offset is copied)."""
    raw = raw.contiguous()
    return raw if raw.storage_offset() % 4 == 0 else raw.clone()


def decode_in_chunks(
    raw: torch.Tensor,
    block_size: int,
    decode_chunk: Callable[[torch.Tensor, torch.Tensor], None],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Allocate the result `[n_blocks, block_size]` and fill it chunk by chunk: `decode_chunk(raw, out)`. A
    narrower `out_dtype` (bf16) is written by the chunk's last float32 operation (`torch.mul(..., out=)`), one
    rounding to nearest even of the float32 value."""
    raw = aligned_blocks(raw)
    if out_dtype != torch.float32:
        out = torch.empty(raw.shape[0], block_size, dtype=out_dtype)
        for_each_chunk(raw.shape[0], block_size, lambda s: decode_chunk(raw[s], out[s]))
        return out
    out = new_result((raw.shape[0], block_size), torch.float32)
    for_each_chunk(raw.shape[0], block_size, lambda s: decode_chunk(raw[s], out[s]))
    return out


def encode_in_chunks(
    x: torch.Tensor, type_size: int, encode_chunk: Callable[[torch.Tensor, torch.Tensor], None]
) -> torch.Tensor:
    """Allocate the uint8 result `[n_blocks, type_size]` and fill it chunk by chunk: `encode_chunk(x, out)`."""
    x = x.contiguous()
    out = new_result((x.shape[0], type_size), torch.uint8)
    for_each_chunk(x.shape[0], x.shape[1], lambda s: encode_chunk(x[s], out[s]))
    return out


# ---- bit fields --------------------------------------------------------------------------------------------------


def _byte_field_table(bits: int, at: int) -> torch.Tensor:
    """For every byte value, its 8/bits fields (low bits first) moved to bit `at`, packed into one integer whose
    little-endian bytes are the fields: indexing it expands a byte into its fields in one gather."""
    n_fields = 8 // bits
    values = torch.arange(256, dtype=torch.int32).view(256, 1)
    fields = ((values >> torch.arange(0, 8, bits, dtype=torch.int32)) & ((1 << bits) - 1)) << at
    wide = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[n_fields]
    return fields.to(torch.uint8).contiguous().view(wide).view(256)


_BYTE_FIELD_TABLES: dict[tuple[int, int], torch.Tensor] = {}


_FIELD_SHIFTS = {bits: torch.arange(0, 8, bits, dtype=torch.uint8).view(-1, 1, 1) for bits in (1, 2, 4)}

# Rows of codes are moved in units of 16 bytes viewed as complex128: one 1-D gather of such units costs about a
# third of a copy of the same rows through torch.stack (bit patterns are only moved, never interpreted).
_UNIT = 16


@lru_cache(maxsize=64)
def _unit_order(
    n_fields: int, n_rows: int, row_units: int, first_unit: int, n_groups: int, group_units: int
) -> torch.Tensor:
    """Index of the 16-byte units of field planes `[n_fields, n_rows, row_units]` in the order
    `[row, group, field, unit of the group]`, starting at unit `first_unit` of each row."""
    field = torch.arange(n_fields, dtype=torch.int32).view(1, 1, -1, 1) * (n_rows * row_units)
    row = torch.arange(n_rows, dtype=torch.int32).view(-1, 1, 1, 1) * row_units
    unit = first_unit + torch.arange(n_groups * group_units, dtype=torch.int32).view(1, n_groups, 1, group_units)
    return (field + row + unit).view(-1)


def unpack_fields(rows: torch.Tensor, start: int, length: int, group: int, bits: int, at: int = 0) -> torch.Tensor:
    """Expand the packed codes in bytes `start:start + length` of every row of `rows` (uint8 `[n, m]`; each byte
    holds 8/bits fields of `bits` bits, low bits first) into one uint8 per field, `[n, length * 8 // bits]`,
    each field moved to bit `at`.

    Element order is planar per group of `group` bytes, which covers every GGML packing: a group yields field 0
    of its bytes, then field 1 of its bytes, and so on. With `group == 1` a byte's fields are consecutive.
    """
    n, m = rows.shape
    n_fields = 8 // bits
    if group == 1:
        table = _BYTE_FIELD_TABLES.get((bits, at))
        if table is None:
            table = _BYTE_FIELD_TABLES[(bits, at)] = _byte_field_table(bits, at)
        region = rows[:, start : start + length].reshape(-1).int()
        return table.index_select(0, region).view(torch.uint8).view(n, length * n_fields)
    if m % _UNIT or start % _UNIT or (m > 2 * length and length % _UNIT == 0):
        # cut the region out first: the planes of whole rows could not be moved in units, or would be mostly waste
        rows, start, m = rows[:, start : start + length].contiguous(), 0, length
    # one shift for all fields runs as a single contiguous pass: planes [field, row, byte]
    planes = rows.contiguous() >> _FIELD_SHIFTS[bits]
    planes[:-1].bitwise_and_((1 << bits) - 1)  # the top field has nothing above it
    if m % _UNIT == 0 and group % _UNIT == 0:
        order = _unit_order(n_fields, n, m // _UNIT, start // _UNIT, length // group, group // _UNIT)
        codes = planes.view(torch.complex128).view(-1).index_select(0, order).view(torch.uint8)
    else:
        regions = planes[:, :, start : start + length].unflatten(2, (length // group, group))
        codes = torch.stack(regions.unbind(0), dim=2)
    codes = codes.view(n, length * n_fields)
    return codes.mul_(1 << at) if at else codes


# multiplying 8 bytes that are each 0 or 1 by this gathers them, bit k from byte k, into the top byte
_GATHER_BITS = 0x0102040810204080


def pack_fields(codes: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Inverse of `unpack_fields` with `at == 0`: uint8 `[n, k * 8 // bits]` (bits above `bits` are dropped) to
    packed uint8 `[n, k]`."""
    n = codes.shape[0]
    n_fields = 8 // bits
    codes = codes & ((1 << bits) - 1)
    if group == 1 and bits == 1:
        words = codes.view(torch.int64)
        return (words * _GATHER_BITS).bitwise_right_shift_(56).to(torch.uint8)
    planes = codes.view(n, -1, n_fields, group)
    # fields occupy disjoint bits, so adding them shifted is or-ing them
    packed = planes[:, :, 0].clone()
    for f in range(1, n_fields):
        packed.add_(planes[:, :, f], alpha=1 << (bits * f))
    return packed.view(n, -1)


@dataclass(frozen=True)
class PackedCodes:
    """`length` bytes at byte `offset` of a block holding codes of `bits` bits, planar over groups of `group`
    bytes (see `unpack_fields`)."""

    offset: int
    length: int
    group: int
    bits: int

    def unpack(self, blocks: torch.Tensor, at: int = 0) -> torch.Tensor:
        return unpack_fields(blocks, self.offset, self.length, self.group, self.bits, at)


# ---- scales ------------------------------------------------------------------------------------------------------


def f16_field(blocks: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """The float16 at `byte_offset` of every block, as float32 `[n, 1]`."""
    column = byte_offset // 2
    return blocks.view(torch.float16)[:, column : column + 1].float()


def may_hold_nan(x: torch.Tensor) -> bool:
    """False only if x holds no NaN: a NaN makes the sum NaN (as, rarely, +inf meeting −inf does). One summing
    pass is far cheaper than torch's isnan().any()."""
    return bool(torch.isnan(x.sum()))


def float32_to_f16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 rounded as numpy's `astype(np.float16)`, NaN payloads included, viewed as uint8 pairs."""
    half = x.to(torch.float16)
    if may_hold_nan(x):
        # torch quiets signalling NaNs; numpy keeps the top 10 payload bits as they are (never producing inf)
        bits = x.view(torch.int32)
        payload = (bits >> 13) & 0x3FF
        nan_half = ((bits >> 16) & 0x8000) | 0x7C00 | payload | (payload == 0).to(torch.int32)
        half = torch.where(torch.isnan(x), nan_half.to(torch.int16).view(torch.float16), half)
    return half.view(torch.uint8)


def float32_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 as gguf (ggml_compute_fp32_to_bf16) rounds it, viewed as uint8 pairs: to nearest even,
    subnormals kept, which torch's cast also does; NaNs keep sign and payload top bits and become quiet."""
    brain = x.to(torch.bfloat16)
    if may_hold_nan(x):
        bits = x.view(torch.int32)
        nan_brain = ((bits >> 16) | 0x40).to(torch.int16).view(torch.bfloat16)
        brain = torch.where(torch.isnan(x), nan_brain, brain)
    return brain.view(torch.uint8)


def safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1/d, and 0 where d is 0 (the inverse scale of an all-zero block)."""
    return torch.where(d == 0, 0.0, d.reciprocal())


# ---- block layouts -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockLayout:
    """How a block type stores its codes and how a code becomes a value.

    code = low | high << low.bits, then either code − `code_offset` or `lookup[code]`; value = scale · code
    (+ bias). `scales(blocks, *f16s)` receives the block's float16 fields at byte offsets `f16_scales` (float32
    `[n, 1]` each) and returns float32 scale and bias (or None) per sub-block, `[n, sub_blocks]`.
    """

    ggml_type: GGMLType
    block_size: int
    low: PackedCodes
    f16_scales: tuple[int, ...]
    scales: ScaleFn
    sub_blocks: int = 1
    high: Optional[PackedCodes] = None
    code_offset: int = 0
    lookup: Optional[torch.Tensor] = None  # int8 values indexed by code

    def codes(self, blocks: torch.Tensor) -> torch.Tensor:
        """Integer codes of the blocks, `[n, block_size]`, int8 where the format is signed."""
        codes = self.low.unpack(blocks)
        if self.high is not None:
            # the high bits land above the low ones: adding them shifted is or-ing them
            codes.add_(self.high.unpack(blocks), alpha=1 << self.low.bits)
        if self.lookup is not None:
            return self.lookup.index_select(0, codes.view(-1).int()).view(codes.shape)
        if self.code_offset:
            # exact in int8: wrapping uint8 arithmetic, reinterpreted
            return codes.sub_(self.code_offset).view(torch.int8)
        return codes

    def dequantize_blocks(self, raw: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """float32 values `[n, block_size]`; `out_dtype=torch.bfloat16`: the float32 values rounded to nearest
        even, written by the last pass of each chunk (its float32 values stay in cache, never in memory)."""
        raw = aligned_blocks(raw)
        n = raw.shape[0]
        # scales for all blocks at once: they are small, and per chunk their many little steps would cost more
        # in call overhead than in arithmetic
        scale, bias = self.scales(raw, *(f16_field(raw, offset) for offset in self.f16_scales))
        # contiguous, so that the per-element passes can treat (block, sub-block) as one dimension
        scale = scale.contiguous().view(n, self.sub_blocks, 1)
        bias = None if bias is None else bias.contiguous().view(n, self.sub_blocks, 1)
        narrow = out_dtype != torch.float32
        out = (
            torch.empty(n, self.block_size, dtype=out_dtype)
            if narrow
            else new_result((n, self.block_size), torch.float32)
        )
        sub_shape = (self.sub_blocks, self.block_size // self.sub_blocks)
        tmp = torch.empty(min(n, max(1, CHUNK_ELEMENTS // self.block_size)), self.block_size) if narrow else None

        nibbles = self._nibble_planes()

        def decode_chunk(chunk: slice) -> None:
            if nibbles:
                self._decode_nibbles(raw[chunk], scale[chunk], None if bias is None else bias[chunk], out[chunk], tmp)
                return
            codes = self.codes(raw[chunk])
            dest = out[chunk].view(-1, *sub_shape)
            scale_codes(codes.view(-1, *sub_shape), scale[chunk], dest, None if bias is None else bias[chunk], tmp)

        for_each_chunk(n, self.block_size, decode_chunk)
        return out

    def _nibble_planes(self) -> bool:
        """Whether the codes are plain 4-bit nibbles, planar per group (low nibbles of a group's bytes, then their
        high nibbles: Q4_0, Q4_1, Q4_K), with one scale per block or per half-group: then `_decode_nibbles`."""
        low = self.low
        return (
            low.bits == 4
            and self.high is None
            and self.lookup is None
            and 2 * low.length == self.block_size
            and low.length % low.group == 0
            and (self.sub_blocks == 1 or self.block_size // self.sub_blocks == low.group)
        )

    def _decode_nibbles(
        self,
        blocks: torch.Tensor,
        scale: torch.Tensor,
        bias: Optional[torch.Tensor],
        out: torch.Tensor,
        tmp: Optional[torch.Tensor],
    ) -> None:
        """Nibble layouts without the general unpacking: per half, mask or shift the code bytes in place of a
        gather; `scale_codes` then writes each half of `out` `[n, block_size]` in place."""
        low = self.low
        n, groups = blocks.shape[0], low.length // low.group
        # the code bytes as the widest words their offsets allow: masking 4 or 2 bytes at once (an arithmetic
        # shift's sign bits land in nibbles the mask clears)
        for width, dtype, mask in ((4, torch.int32, 0x0F0F0F0F), (2, torch.int16, 0x0F0F), (1, torch.uint8, 0x0F)):
            if low.offset % width == 0 and blocks.shape[1] % width == 0 and blocks.storage_offset() % width == 0:
                break
        words = blocks.view(dtype)[:, low.offset // width : (low.offset + low.length) // width]
        halves = out.view(n, groups, 2, low.group)
        per_half = self.sub_blocks != 1  # one scale per half-group (Q4_K) or one per block
        for h in (0, 1):
            codes = (words & mask if h == 0 else (words >> 4).bitwise_and_(mask)).view(torch.uint8)
            codes = codes.view(n, groups, low.group)
            if self.code_offset:  # exact in int8: wrapping uint8 arithmetic, reinterpreted
                codes = codes.sub_(self.code_offset).view(torch.int8)
            sc = scale.view(n, groups, 2, 1)[:, :, h] if per_half else scale.view(n, 1, 1)
            b = None if bias is None else (bias.view(n, groups, 2, 1)[:, :, h] if per_half else bias.view(n, 1, 1))
            scale_codes(codes, sc, halves[:, :, h], b, tmp)

    def register(self, quantize_blocks=None) -> None:
        F16_SCALE_OFFSETS[self.ggml_type] = self.f16_scales
        register(self.ggml_type, self.dequantize_blocks, quantize_blocks)


# byte offsets of the float16 scales inside a block, per block type (tests and benchmarks make valid blocks)
F16_SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {}


def scale_codes(
    codes: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    tmp: Optional[torch.Tensor] = None,
) -> None:
    """out = scale · codes (+ bias): codes `[n, S, L]` of an integer type, scale and bias `[n, S, 1]` float32.

    scale · code is exact in float32 for every GGML type (an f16, 11 significant bits, times integers whose
    product stays below 2^12), so only the addition rounds, as in gguf's `d * q + m`, and the order of the
    factors cannot matter. (Two passes: addcmul with two broadcast operands runs several times slower.)

    The multiply reads the integer codes and writes `out` (any strides) directly. A narrower `out` (bf16) with a
    bias: the product goes to `tmp` (float32, at least as many values as codes) and the addition rounds once,
    writing `out`; without a bias the product itself is rounded once.
    """
    if bias is None:
        torch.mul(codes, scale, out=out)
        return
    work = out if out.dtype == torch.float32 else tmp.reshape(-1)[: codes.numel()].view(codes.shape)
    torch.mul(codes, scale, out=work)
    torch.add(work, bias, out=out)


# ---- element types -----------------------------------------------------------------------------------------------


def _element_decoder(dtype: torch.dtype):
    # F32 too is copied: callers own the result and may write into it, while raw often lies in a read-only mapping
    def decode(raw: torch.Tensor) -> torch.Tensor:
        values = aligned_blocks(raw).view(dtype)
        return new_result(tuple(values.shape), torch.float32).copy_(values)

    return decode


def _encode_f32(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return new_result((x.shape[0], 4), torch.uint8).copy_(x.view(torch.uint8))


def _encode_f16(x: torch.Tensor) -> torch.Tensor:
    return float32_to_f16_bits(x.contiguous())


def _encode_bf16(x: torch.Tensor) -> torch.Tensor:
    return float32_to_bf16_bits(x.contiguous())


# ---- 32-element block types --------------------------------------------------------------------------------------


def scale_only(blocks: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, None]:
    return d, None


def _scale_and_minimum(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return d, m


def _legacy_layout(ggml_type: GGMLType, bits: int, affine: bool) -> BlockLayout:
    """Q4_0/Q5_0 (value = d·(q − 2^(bits−1))) and Q4_1/Q5_1 (value = d·q + m): scale(s), then for 5 bits the
    32 high bits as a little-endian uint32, then 16 bytes of nibbles (codes 0..15 low, 16..31 high)."""
    offset = 4 if affine else 2
    high = None
    if bits == 5:
        high = PackedCodes(offset, 4, 1, 1)
        offset += 4
    return BlockLayout(
        ggml_type,
        32,
        PackedCodes(offset, 16, 16, 4),
        (0, 2) if affine else (0,),
        _scale_and_minimum if affine else scale_only,
        high=high,
        code_offset=0 if affine else 1 << (bits - 1),
    )


LEGACY_LAYOUTS = {
    GGMLType.Q4_0: _legacy_layout(GGMLType.Q4_0, 4, affine=False),
    GGMLType.Q4_1: _legacy_layout(GGMLType.Q4_1, 4, affine=True),
    GGMLType.Q5_0: _legacy_layout(GGMLType.Q5_0, 5, affine=False),
    GGMLType.Q5_1: _legacy_layout(GGMLType.Q5_1, 5, affine=True),
}


def float_codes_to_uint8(y: torch.Tensor, max_code: int) -> torch.Tensor:
    """numpy's `trunc(y).astype(np.uint8).clip(0, max_code)`: the cast truncates through int32 and keeps the low
    byte (NaN and out-of-range values become 0), the clip then caps the byte. (The cast to int8 is the same
    truncation, and torch vectorizes it where its cast to uint8 is not.)"""
    return y.to(torch.int8).view(torch.uint8).clamp_(max=max_code)


def signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per row, the element of largest magnitude, the first one on a tie: numpy's `x[argmax(|x|)]`, `[n, 1]`.

    The row maximum or minimum decides unless their magnitudes tie (or NaN is present, or the row is zero):
    only those rows pay for torch's argmax, which is slow along short rows.
    """
    hi = x.amax(dim=1, keepdim=True)
    lo = x.amin(dim=1, keepdim=True)
    neg = -lo
    lo_wins = neg > hi
    picked = torch.where(lo_wins, lo, hi)
    ambiguous = ~(lo_wins | (hi > neg))
    if bool(ambiguous.any()):
        rows = ambiguous.view(-1).nonzero().view(-1)
        tied = x.index_select(0, rows)
        picked.index_copy_(0, rows, tied.gather(1, tied.abs().argmax(dim=1, keepdim=True)))
    return picked


def row_min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, numpy's `x.min(axis=1)` and `x.max(axis=1)`, `[n, 1]` each.

    Where the extreme is zero and both signs of zero are present, which one numpy returns depends on the order
    of its SIMD reduction tree: those rows (few: zero extremes are rare outside all-zero blocks) ask numpy.
    """
    lo = x.amin(dim=1, keepdim=True)
    hi = x.amax(dim=1, keepdim=True)
    zero = ((lo == 0) | (hi == 0)).view(-1)
    if bool(zero.any()):
        rows = zero.nonzero().view(-1)
        tied = x.index_select(0, rows).numpy()
        lo.index_copy_(0, rows, torch.from_numpy(tied.min(axis=1, keepdims=True)))
        hi.index_copy_(0, rows, torch.from_numpy(tied.max(axis=1, keepdims=True)))
    return lo, hi


def _legacy_encoder(layout: BlockLayout):
    bits = layout.low.bits + (layout.high.bits if layout.high else 0)
    max_code = (1 << bits) - 1
    type_size = layout.low.offset + layout.low.length

    def encode_chunk(x: torch.Tensor, out: torch.Tensor) -> None:
        if layout.code_offset:
            # the scale carries the sign of the largest-magnitude value, so that value maps to code 0
            d = signed_absmax(x) / -layout.code_offset
            y = (x * safe_reciprocal(d)).add_(layout.code_offset + 0.5)
        else:
            lo, hi = row_min_max(x)
            d = (hi - lo) / max_code
            y = (x - lo).mul_(safe_reciprocal(d)).add_(0.5)
            out[:, 2:4] = float32_to_f16_bits(lo)
        codes = float_codes_to_uint8(y, max_code)
        out[:, 0:2] = float32_to_f16_bits(d)
        low = layout.low
        out[:, low.offset : low.offset + low.length] = pack_fields(codes, low.group, low.bits)
        if layout.high is not None:
            high = layout.high
            out[:, high.offset : high.offset + high.length] = pack_fields(codes >> low.bits, high.group, high.bits)

    return lambda x: encode_in_chunks(x, type_size, encode_chunk)


# ---- Q8_0 --------------------------------------------------------------------------------------------------------


def _decode_q8_0_chunk(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # converting whole blocks (scale bytes included, then ignored) runs vectorized, unlike a cast of the
    # strided code bytes alone
    values = blocks.view(torch.int8).float()
    torch.mul(values[:, 2:], f16_field(blocks, 0), out=out)


_JUST_BELOW_HALF = 0.4999999701976776  # the float32 before 0.5


def round_half_away(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero, as int32, equal to gguf's `np_roundf` (floor(|y|) plus
    floor(2·fraction), with y's sign) for |y| < 256, NaN and ±inf (checked on every float32 below 256).

    Adding the float below one half before truncating never carries an inexact sum across an integer.
    """
    return y.sign().mul_(_JUST_BELOW_HALF).add_(y).to(torch.int32)


def _encode_q8_0_chunk(x: torch.Tensor, out: torch.Tensor) -> None:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    codes = round_half_away(x * safe_reciprocal(d))
    out[:, 0:2] = float32_to_f16_bits(d)
    out[:, 2:] = codes.to(torch.int8).view(torch.uint8)


def _register() -> None:
    register(GGMLType.F32, _element_decoder(torch.float32), _encode_f32)
    register(GGMLType.F16, _element_decoder(torch.float16), _encode_f16)
    register(GGMLType.BF16, _element_decoder(torch.bfloat16), _encode_bf16)
    for layout in LEGACY_LAYOUTS.values():
        layout.register(_legacy_encoder(layout))
    F16_SCALE_OFFSETS[GGMLType.Q8_0] = (0,)
    register(
        GGMLType.Q8_0,
        lambda raw, out_dtype=torch.float32: decode_in_chunks(raw, 32, _decode_q8_0_chunk, out_dtype),
        lambda x: encode_in_chunks(x, 34, _encode_q8_0_chunk),
    )


_register()
