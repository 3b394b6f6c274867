"""Decoders of the non-linear 4-bit types IQ4_NL (32-element blocks) and IQ4_XS (256-element super-blocks with
6-bit sub-block scales): each 4-bit code indexes a fixed table of int8 levels."""

from __future__ import annotations

import gguf.quants as _gq
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants.kquants import signed_6bit_scales
from juno_py.gguf.quants.simple import BlockLayout, PackedCodes, scale_only, unpack_fields

# llama.cpp's kvalues_iq4nl, from the gguf package (one source of truth, as the codebook grids)
IQ4_LEVELS = torch.tensor(_gq.IQ4_NL.kvalues, dtype=torch.int8)


def _iq4_xs_scales(blocks: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, None]:
    # 8 scales: low nibbles in bytes 4-7, high 2-bit pairs in the uint16 at byte 2
    return signed_6bit_scales(d, unpack_fields(blocks, 4, 4, 1, 4), unpack_fields(blocks, 2, 2, 1, 2, at=4))


I_LAYOUTS = (
    BlockLayout(GGMLType.IQ4_NL, 32, PackedCodes(2, 16, 16, 4), (0,), scale_only, lookup=IQ4_LEVELS),
    BlockLayout(
        GGMLType.IQ4_XS, 256, PackedCodes(8, 128, 16, 4), (0,), _iq4_xs_scales, sub_blocks=8, lookup=IQ4_LEVELS
    ),
)

for _layout in I_LAYOUTS:
    _layout.register()
