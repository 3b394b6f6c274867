"""Decoders of the ternary types TQ1_0 and TQ2_0 (256 values per block, each −1, 0 or +1 times the block's float16
scale) and of MXFP4 (32 e2m1 values per block under a shared power-of-two scale).

TQ2_0 stores a code of 2 bits per value (code − 1); TQ1_0 packs five values in a byte as the first base-3 digits of a
fraction (the digit k of byte b is `(uint8(b · 3^k) · 3) >> 8`), four in each of its last four bytes. MXFP4's e2m1
levels (doubled, as integers) and its scale come from the `gguf` package (`MXFP4.kvalues`; the e8m0 byte e is
2^(e − 128) as float32, the half that pairs with the doubled levels). Every value is one exact float32 product.
"""

from __future__ import annotations

import gguf.quants as _gq
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.registry import register
from juno_py.gguf.quants.simple import (
    F16_SCALE_OFFSETS,
    BlockLayout,
    PackedCodes,
    decode_in_chunks,
    f16_field,
    scale_only,
)

QK_K = 256


def _trit_table() -> torch.Tensor:
    """int8 `[256, 5]`: the five base-3 digits of each byte of TQ1_0, as values −1, 0, +1."""
    b = torch.arange(256, dtype=torch.int32).view(256, 1)
    powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)
    return ((((b * powers) & 0xFF) * 3 >> 8) - 1).to(torch.int8)


TRITS = _trit_table()


def _tq1_0_chunk(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # 48 bytes of five values (32 bytes, then 16; digit k of each byte after digit k − 1 of all of them), 4 bytes
    # of four values, the float16 scale
    n = blocks.shape[0]
    trits = TRITS.index_select(0, blocks[:, 0:52].reshape(-1).int()).view(n, 52, 5)
    codes = torch.cat(
        [
            trits[:, 0:32].transpose(1, 2).reshape(n, 160),
            trits[:, 32:48].transpose(1, 2).reshape(n, 80),
            trits[:, 48:52, 0:4].transpose(1, 2).reshape(n, 16),
        ],
        dim=1,
    )
    torch.mul(codes, f16_field(blocks, 52), out=out)


def _mxfp4_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, None]:
    # the e8m0 byte e as float32 bits: (e − 1) << 23, and below 2 the subnormals 2^-128 (e = 0), 2^-127 (e = 1)
    e = blocks[:, 0:1].int()
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000).bitwise_left_shift_(e), (e - 1).bitwise_left_shift_(23))
    return bits.view(torch.float32), None


MXFP4_LEVELS = torch.tensor(_gq.MXFP4.kvalues, dtype=torch.int8) if hasattr(_gq, "MXFP4") else None

TQ2_0_LAYOUT = BlockLayout(GGMLType.TQ2_0, QK_K, PackedCodes(0, 64, 32, 2), (64,), scale_only, code_offset=1)
TQ2_0_LAYOUT.register()

F16_SCALE_OFFSETS[GGMLType.TQ1_0] = (52,)
register(GGMLType.TQ1_0, lambda raw, out_dtype=torch.float32: decode_in_chunks(raw, QK_K, _tq1_0_chunk, out_dtype))

if MXFP4_LEVELS is not None:  # gguf packages before 0.18 do not know the type
    MXFP4_LAYOUT = BlockLayout(GGMLType.MXFP4, 32, PackedCodes(1, 16, 16, 4), (), _mxfp4_scales, lookup=MXFP4_LEVELS)
    MXFP4_LAYOUT.register()
