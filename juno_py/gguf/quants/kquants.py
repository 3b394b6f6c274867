"""Decoders of the k-quant super-block types Q2_K, Q3_K, Q4_K, Q5_K and Q6_K: 256 values per block in 8 or 16
sub-blocks, each with its own quantized scale (and minimum) under the block's float16 scales.

The codes are described by the shared `BlockLayout` table; each type here only says where its fields lie and
how its sub-block scales are packed.
"""

from __future__ import annotations

import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.simple import BlockLayout, PackedCodes

QK_K = 256

# value = scale · code − minimum: the scale functions return the minimum negated, as the bias to add
# (x − y and x + (−y) are the same IEEE operation, and (−dmin)·m is exactly −(dmin·m))


def _q2_k_scales(blocks: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # 16 bytes: the sub-block scale in the low nibble, its minimum in the high nibble
    packed = blocks[:, 0:16].contiguous()
    return d * (packed & 0x0F).float(), dmin.neg() * (packed >> 4).float()


# Scale bytes are untangled four at a time, as int32 words: whole-word masks and shifts keep each step one
# contiguous pass instead of a loop over short rows.
_NIBBLES = 0x0F0F0F0F
_PAIRS = 0x03030303


def _words(blocks: torch.Tensor, start: int, length: int) -> torch.Tensor:
    # a fresh copy: a view may start at any byte, and a single block counts as contiguous whatever its stride
    return blocks[:, start : start + length].clone(memory_format=torch.contiguous_format).view(torch.int32)


def signed_6bit_scales(d: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, None]:
    """d · (code − 32) for scales stored as a low nibble and 2 high bits (already at bit 4) with an offset of 32;
    low and high are uint8 codes or int32 words of four."""
    codes = (low | high).view(torch.uint8)
    return d * codes.sub_(32).view(torch.int8).float(), None


def _q3_k_scales(blocks: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, None]:
    # 16 scales: low nibbles of 8 bytes (scales 0-7 low, 8-15 high), then 2-bit high parts in 4 bytes (scale
    # 4f + l in bits 2f of byte l)
    words = _words(blocks, 96, 12)
    low = torch.cat([words[:, 0:2] & _NIBBLES, (words[:, 0:2] >> 4) & _NIBBLES], dim=1)
    high = (words[:, 2:3] >> _PAIR_SHIFTS).bitwise_and_(_PAIRS).bitwise_left_shift_(4)
    return signed_6bit_scales(d, low, high)


_PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.int32)


def k_scale_min(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The eight 6-bit scales and eight minimums packed into 12 bytes at `start` (Q4_K, Q5_K), as uint8
    `[n, 2, 8]` (scales, then minimums).

    Bytes 0-3 hold scales 0-3 and bytes 4-7 minimums 0-3 in their low 6 bits; scales and minimums 4-7 take their
    low 4 bits from the nibbles of bytes 8-11 and their high 2 bits from the top of bytes 0-3 and 4-7.
    """
    words = _words(blocks, start, 12)
    low6 = words[:, 0:2] & 0x3F3F3F3F
    top2 = (words[:, 0:2] >> 2).bitwise_and_(0x30303030)
    tail = words[:, 2]
    high = torch.stack([(tail & _NIBBLES) | top2[:, 0], ((tail >> 4) & _NIBBLES) | top2[:, 1]], dim=1)
    return torch.stack([low6, high], dim=2).view(torch.uint8).view(-1, 2, 8)


def _q4_k_scales(blocks: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    both = k_scale_min(blocks, 4).float() * torch.cat([d, dmin.neg()], dim=1).unsqueeze(2)
    return both[:, 0], both[:, 1]


def _q6_k_scales(blocks: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, None]:
    return d * blocks[:, 192:208].contiguous().view(torch.int8).float(), None


K_LAYOUTS = (
    BlockLayout(GGMLType.Q2_K, QK_K, PackedCodes(16, 64, 32, 2), (80, 82), _q2_k_scales, sub_blocks=16),
    BlockLayout(
        GGMLType.Q3_K,
        QK_K,
        PackedCodes(32, 64, 32, 2),
        (108,),
        _q3_k_scales,
        sub_blocks=16,
        high=PackedCodes(0, 32, 32, 1),
        code_offset=4,
    ),
    BlockLayout(GGMLType.Q4_K, QK_K, PackedCodes(16, 128, 32, 4), (0, 2), _q4_k_scales, sub_blocks=8),
    BlockLayout(
        GGMLType.Q5_K,
        QK_K,
        PackedCodes(48, 128, 32, 4),
        (0, 2),
        _q4_k_scales,
        sub_blocks=8,
        high=PackedCodes(16, 32, 32, 1),
    ),
    BlockLayout(
        GGMLType.Q6_K,
        QK_K,
        PackedCodes(0, 128, 64, 4),
        (208,),
        _q6_k_scales,
        sub_blocks=16,
        high=PackedCodes(128, 64, 32, 2),
        code_offset=32,
    ),
)

for _layout in K_LAYOUTS:
    _layout.register()
