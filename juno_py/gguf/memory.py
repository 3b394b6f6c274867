"""A GGUF-shaped model held in memory: metadata and tensors given as bytes, on any device, with no file.

`MemoryGGUF` answers what a model reads from a `GGUFFile` (`architecture`, `metadata`, `tensors`, `tensor`,
`raw_rows`, `dequantize`), so `Transformer.from_gguf` builds a model from it unchanged. Its tensors' bytes may
already lie on a GPU (a synthetic model generated there, larger than host memory or a file would allow): the
frozen linears then view them where they are, still quantized.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from juno_py.errors import GGUFFormatError
from juno_py.gguf.constants import GGML_BLOCK_SIZES, type_name
from juno_py.gguf.reader import GGUFFile, TensorInfo


class MemoryGGUF(GGUFFile):
    """metadata: plain values by key (as `GGUFFile.metadata`); tensors: name → (ggml_type, shape, raw), raw a uint8
    torch tensor holding the tensor's bytes in GGUF order (any shape; it is viewed flat), shape row-major."""

    def __init__(
        self,
        metadata: Mapping[str, Any],
        tensors: Mapping[str, tuple[int, tuple[int, ...], torch.Tensor]],
        label: str = "<memory>",
    ):
        self.path = label
        self.shards = []
        self.fields = {}
        self.metadata = dict(metadata)
        self.alignment = 32
        self.version = 3
        self.tensors: dict[str, TensorInfo] = {}
        for name, (ggml_type, shape, raw) in tensors.items():
            shape = tuple(int(d) for d in shape)
            if ggml_type not in GGML_BLOCK_SIZES:
                raise GGUFFormatError(f"{label}: tensor {name!r} has unknown GGML type {ggml_type}")
            block, size = GGML_BLOCK_SIZES[ggml_type]
            n = 1
            for d in shape:
                n *= d
            if not shape or shape[-1] % block:
                raise GGUFFormatError(
                    f"{label}: tensor {name!r} shape {shape}: the last dimension is not a multiple "
                    f"of the {type_name(ggml_type)} block size {block}"
                )
            flat = raw.reshape(-1)
            if flat.dtype != torch.uint8 or flat.numel() != n // block * size:
                raise GGUFFormatError(
                    f"{label}: tensor {name!r} has {flat.numel()} {flat.dtype} values, expected "
                    f"{n // block * size} bytes of {type_name(ggml_type)} for shape {shape}"
                )
            self.tensors[name] = TensorInfo(name, int(ggml_type), shape, 0, flat.numel(), flat)

    def __repr__(self) -> str:
        return f"MemoryGGUF({self.path!r}, {len(self.tensors)} tensors, {len(self.metadata)} keys)"


__all__ = ["MemoryGGUF"]
