"""The codec registry: per GGML type, the block geometry and the functions that decode and encode blocks.

The codec modules of this package register here on import; `juno_py.gguf.quants` re-exports the look-ups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from juno_py.errors import UnsupportedQuantType
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType, type_name

BlockFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Codec:
    ggml_type: GGMLType
    block_size: int
    type_size: int
    dequantize_blocks: BlockFn
    quantize_blocks: Optional[BlockFn] = None

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def row_bytes(self, n_cols: int) -> int:
        return n_cols // self.block_size * self.type_size


_REGISTRY: dict[int, Codec] = {}


def register(ggml_type: GGMLType, dequantize_blocks: BlockFn, quantize_blocks: Optional[BlockFn] = None) -> None:
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    existing = _REGISTRY.get(ggml_type)
    if existing is not None and quantize_blocks is None:
        quantize_blocks = existing.quantize_blocks
    _REGISTRY[ggml_type] = Codec(GGMLType(ggml_type), block_size, type_size, dequantize_blocks, quantize_blocks)


def register_quantizer(ggml_type: GGMLType, quantize_blocks: BlockFn) -> None:
    """Add an encoder to a type whose decoder is already registered."""
    codec = _REGISTRY[ggml_type]
    _REGISTRY[ggml_type] = Codec(
        codec.ggml_type, codec.block_size, codec.type_size, codec.dequantize_blocks, quantize_blocks
    )


def get_codec(ggml_type: int, what: str = "", action: str = "decode") -> Codec:
    codec = _REGISTRY.get(int(ggml_type))
    if codec is None:
        where = f" (tensor {what})" if what else ""
        raise UnsupportedQuantType(
            f"cannot {action} GGML type {type_name(ggml_type)}{where}: "
            f"supported types are {', '.join(supported_types())}"
        )
    return codec


def supported_types() -> list[str]:
    return [c.name for c in sorted(_REGISTRY.values(), key=lambda c: c.ggml_type)]


def quantizable_types() -> list[str]:
    return [c.name for c in sorted(_REGISTRY.values(), key=lambda c: c.ggml_type) if c.quantize_blocks]


def bits_per_weight(ggml_type: int) -> float:
    """Bits a weight takes in `ggml_type`, from its block geometry: 8 · bytes per block / values per block."""
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    return 8.0 * type_size / block_size


def type_table() -> list[dict[str, object]]:
    """Every type juno-py decodes, in type-id order: name, values and bytes per block, bits per weight (from the
    block geometry), and whether juno-py can also encode it (what a merge can write)."""
    return [
        {
            "type": c.name,
            "block_size": c.block_size,
            "type_size": c.type_size,
            "bits_per_weight": bits_per_weight(c.ggml_type),
            "encode": c.quantize_blocks is not None,
        }
        for c in sorted(_REGISTRY.values(), key=lambda c: c.ggml_type)
    ]


def type_table_markdown() -> str:
    """`type_table()` as a Markdown table (what `juno-py inspect --types` prints and docs/quantization.md holds)."""
    lines = ["| type | values per block | bytes per block | bits per weight | encode (merge writes it) |"]
    lines.append("|---|---:|---:|---:|---|")
    for row in type_table():
        bpw = f"{row['bits_per_weight']:.4f}".rstrip("0").rstrip(".")
        lines.append(
            f"| {row['type']} | {row['block_size']} | {row['type_size']} | {bpw} | {'yes' if row['encode'] else 'no'} |"
        )
    return "\n".join(lines)
