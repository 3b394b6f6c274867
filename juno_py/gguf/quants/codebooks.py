"""Decoders of the codebook types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S: 256 values per block,
in groups of 8 (IQ1, IQ2) or 4 (IQ3) consecutive values that one index picks from a fixed grid of points, with a
sign byte per group of 8 (IQ2, IQ3) or one offset per group (IQ1), under a sub-block scale.

The grids, the sign table of the 7-bit sign indices (`ksigns`) and IQ1's offset have one source: the `gguf`
package, whose classes hold them (`grid_hex`, unpacked by `init_grid`); they are read from there at import.

Every value is one float32 product of a sub-block scale (an f16 times a small integer or half-integer, exact)
and a grid point times ±1 (or a grid point plus IQ1's ±1/8, exact): products of at most 22 significant bits, so
each value is exact in float32 and equals the `gguf` package's bit for bit whatever the order of the factors.
"""

from __future__ import annotations

from typing import Callable

import gguf.quants as _gq
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.registry import register
from juno_py.gguf.quants.simple import F16_SCALE_OFFSETS, decode_in_chunks, f16_field

QK_K = 256


def _grid(cls) -> torch.Tensor:
    """The float32 grid `[points, values per point]` of a `gguf.quants` class."""
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())


# the grid points of each type, float32 [points, 8 or 4]
GRIDS: dict[GGMLType, torch.Tensor] = {
    GGMLType.IQ2_XXS: _grid(_gq.IQ2_XXS),
    GGMLType.IQ2_XS: _grid(_gq.IQ2_XS),
    GGMLType.IQ2_S: _grid(_gq.IQ2_S),
    GGMLType.IQ3_XXS: _grid(_gq.IQ3_XXS),
    GGMLType.IQ3_S: _grid(_gq.IQ3_S),
    GGMLType.IQ1_S: _grid(_gq.IQ1_S),
    GGMLType.IQ1_M: _grid(_gq.IQ1_M),
}

# 7-bit sign index -> sign byte (bit j set: value j is negated; the eighth bit makes the count of negatives even)
KSIGNS = torch.frombuffer(bytearray(_gq.IQ2_XXS.ksigns), dtype=torch.uint8)
IQ1_DELTA = float(_gq.IQ1_S.delta)


def _sign_table(sign_bytes: torch.Tensor) -> torch.Tensor:
    """float32 `[len, 8]`: ±1 per bit of each sign byte (bit j set: −1 for value j)."""
    bits = (sign_bytes.int().view(-1, 1) >> torch.arange(8, dtype=torch.int32)) & 1
    return (1 - 2 * bits).float()


SIGNS_OF_INDEX = _sign_table(KSIGNS)  # [128, 8]: a 7-bit sign index
SIGNS_OF_BYTE = _sign_table(torch.arange(256, dtype=torch.uint8))  # [256, 8]: a sign byte


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for integer `index` of any shape: `[*index.shape, table.shape[1]]`."""
    return table.index_select(0, index.reshape(-1).long()).view(*index.shape, table.shape[1])


def _u16(blocks: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The little-endian uint16s in bytes `start:start + length`, as int32 `[n, length // 2]`."""
    b = blocks[:, start : start + length].int()
    return b[:, 0::2] | (b[:, 1::2] << 8)


def _u32(blocks: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The little-endian uint32s in bytes `start:start + length`, as int64 `[n, length // 4]`."""
    b = blocks[:, start : start + length].long()
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)


def _nibbles(blocks: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The 4-bit fields of bytes `start:start + length`, low nibble first, int32 `[n, 2 * length]`."""
    b = blocks[:, start : start + length].int()
    return torch.stack([b & 0x0F, b >> 4], dim=2).view(b.shape[0], -1)


def _half_scale(d: torch.Tensor, s: torch.Tensor, factor: float) -> torch.Tensor:
    """d · (0.5 + s) · factor per sub-block (IQ2, IQ3_XXS), float32 `[n, sub-blocks]`."""
    return d * (s.float() + 0.5) * factor


def _signed_points(scale: torch.Tensor, points: torch.Tensor, signs: torch.Tensor, out: torch.Tensor) -> None:
    """out `[n, S·G·K]` = scale `[n, S]` · points · signs (`[n, S, G, K]` each)."""
    scaled = scale.view(points.shape[0], -1, 1, 1) * points
    torch.mul(scaled, signs, out=out.view(scaled.shape))


# ---- IQ2 ---------------------------------------------------------------------------------------------------------


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, then 8 pairs of uint32: 4 grid indices (bytes), then 4 × 7 sign bits and a 4-bit scale
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    words = _u32(blocks, 2, 64).view(n, 8, 2)
    index = blocks[:, 2:66].reshape(n, 8, 8)[:, :, 0:4]
    aux = words[:, :, 1]
    scale = _half_scale(d, aux >> 28, 0.25)
    sign_index = (aux.unsqueeze(2) >> torch.tensor([0, 7, 14, 21])) & 0x7F
    _signed_points(scale, _rows(GRIDS[GGMLType.IQ2_XXS], index), _rows(SIGNS_OF_INDEX, sign_index), out)


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, 32 uint16s (9-bit grid index, 7-bit sign index), 16 4-bit scales
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = _u16(blocks, 2, 64).view(n, 16, 2)
    scale = _half_scale(d, _nibbles(blocks, 66, 8), 0.25)
    _signed_points(scale, _rows(GRIDS[GGMLType.IQ2_XS], qs & 511), _rows(SIGNS_OF_INDEX, qs >> 9), out)


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, 32 low index bytes, 32 sign bytes, 8 bytes of 2-bit high index parts, 16 4-bit scales
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = blocks[:, 66:74].int().unsqueeze(2) >> torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    index = (blocks[:, 2:34].int() | ((qh & 3).view(n, 32) << 8)).view(n, 16, 2)
    scale = _half_scale(d, _nibbles(blocks, 74, 8), 0.25)
    signs = _rows(SIGNS_OF_BYTE, blocks[:, 34:66]).view(n, 16, 2, 8)
    _signed_points(scale, _rows(GRIDS[GGMLType.IQ2_S], index), signs, out)


# ---- IQ3 ---------------------------------------------------------------------------------------------------------


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, 64 grid index bytes (4 values each), 8 uint32s of 4 × 7 sign bits and a 4-bit scale
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    aux = _u32(blocks, 66, 32)
    scale = _half_scale(d, aux >> 28, 0.5)
    sign_index = (aux.unsqueeze(2) >> torch.tensor([0, 7, 14, 21])) & 0x7F
    points = _rows(GRIDS[GGMLType.IQ3_XXS], blocks[:, 2:66]).view(n, 8, 4, 8)
    _signed_points(scale, points, _rows(SIGNS_OF_INDEX, sign_index), out)


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, 64 low index bytes, 8 bytes of high index bits, 32 sign bytes, 8 4-bit scales: d · (1 + 2s)
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = (blocks[:, 66:74].int().unsqueeze(2) >> torch.arange(8, dtype=torch.int32)) & 1
    index = blocks[:, 2:66].int() | (qh.view(n, 64) << 8)
    scale = d * (1 + 2 * _nibbles(blocks, 106, 4)).float()
    points = _rows(GRIDS[GGMLType.IQ3_S], index).view(n, 8, 4, 8)
    signs = _rows(SIGNS_OF_BYTE, blocks[:, 74:106]).view(n, 8, 4, 8)
    _signed_points(scale, points, signs, out)


# ---- IQ1 ---------------------------------------------------------------------------------------------------------


def _iq1_values(scale: torch.Tensor, points: torch.Tensor, negative_delta: torch.Tensor, out: torch.Tensor) -> None:
    """out `[n, S·G·8]` = scale `[n, S]` · (points + ±delta): points `[n, S, G, 8]`, the offset's sign per group
    `[n, S, G]`."""
    shifted = points + torch.where(negative_delta, -IQ1_DELTA, IQ1_DELTA).unsqueeze(3)
    torch.mul(scale.view(points.shape[0], -1, 1, 1), shifted, out=out.view(shifted.shape))


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # d, 32 low index bytes, 8 uint16s: 4 × 3 high index bits, a 3-bit scale, the offset's sign
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = _u16(blocks, 34, 16)
    scale = d * (2 * ((qh >> 12) & 7) + 1).float()
    high = (qh.unsqueeze(2) >> torch.tensor([0, 3, 6, 9], dtype=torch.int32)) & 7
    index = (blocks[:, 2:34].int() | (high.view(n, 32) << 8)).view(n, 8, 4)
    negative = (qh & 0x8000 != 0).view(n, 8, 1).expand(n, 8, 4)
    _iq1_values(scale, _rows(GRIDS[GGMLType.IQ1_S], index), negative, out)


# every float16 bit pattern as float32, converted by torch's vectorized path (the native decoder's table too): a
# conversion of a few values may take torch's scalar path, which writes every NaN as 0x7FFFFFFF
F16_VALUES = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()


def iq1_m_scale(blocks: torch.Tensor) -> torch.Tensor:
    """IQ1_M's float16 block scale, assembled from the top nibbles of the four uint16s at byte 48 (the first one's
    at the low end), as float32 `[n, 1]`."""
    top = _u16(blocks, 48, 8) & 0xF000
    bits = (top[:, 0] >> 12) | (top[:, 1] >> 8) | (top[:, 2] >> 4) | top[:, 3]
    return F16_VALUES.index_select(0, bits).view(-1, 1)


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # 32 low index bytes, 16 bytes of two nibbles (3 high index bits, the offset's sign), 4 uint16s of 4 × 3-bit
    # scales (and the block scale's nibbles)
    n = blocks.shape[0]
    d = iq1_m_scale(blocks)
    sc = (_u16(blocks, 48, 8).unsqueeze(2) >> torch.tensor([0, 3, 6, 9], dtype=torch.int32)) & 7
    scale = d * (2 * sc.view(n, 16) + 1).float()
    qh = _nibbles(blocks, 32, 16)
    index = (blocks[:, 0:32].int() | ((qh & 7) << 8)).view(n, 16, 2)
    negative = (qh & 8 != 0).view(n, 16, 2)
    _iq1_values(scale, _rows(GRIDS[GGMLType.IQ1_M], index), negative, out)


def _chunked(decode: Callable[[torch.Tensor, torch.Tensor], None]):
    # a bfloat16 `out` is written by the last product: the exact float32 value rounded once, to nearest even
    return lambda raw, out_dtype=torch.float32: decode_in_chunks(raw, QK_K, decode, out_dtype)


CODEBOOK_DECODERS = {
    GGMLType.IQ2_XXS: _iq2_xxs,
    GGMLType.IQ2_XS: _iq2_xs,
    GGMLType.IQ2_S: _iq2_s,
    GGMLType.IQ3_XXS: _iq3_xxs,
    GGMLType.IQ3_S: _iq3_s,
    GGMLType.IQ1_S: _iq1_s,
    GGMLType.IQ1_M: _iq1_m,
}

for _type, _decode in CODEBOOK_DECODERS.items():
    # IQ1_M has no float16 field of its own: its scale is spread over the top nibbles of bytes 49, 51, 53, 55
    F16_SCALE_OFFSETS[_type] = () if _type == GGMLType.IQ1_M else (0,)
    register(_type, _chunked(_decode))
