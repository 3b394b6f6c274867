"""The codecs: per GGML type, the block geometry and the functions that decode and encode blocks
(registered in `registry.py`), and `dequantize`/`quantize` over whole tensors.

Each codec works on many blocks at once: `dequantize_blocks(raw)` takes a uint8 tensor
`[n_blocks, type_size]` and returns float32 `[n_blocks, block_size]`; `quantize_blocks(x)` is the inverse
for float32 `[n_blocks, block_size]`. Modules in this package register their codecs on import.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from juno_py.errors import UnsupportedQuantType
from juno_py.gguf.quants.registry import BlockFn as BlockFn
from juno_py.gguf.quants.registry import Codec as Codec
from juno_py.gguf.quants.registry import bits_per_weight as bits_per_weight
from juno_py.gguf.quants.registry import get_codec as get_codec
from juno_py.gguf.quants.registry import quantizable_types as quantizable_types
from juno_py.gguf.quants.registry import register as register
from juno_py.gguf.quants.registry import register_quantizer as register_quantizer
from juno_py.gguf.quants.registry import supported_types as supported_types
from juno_py.gguf.quants.registry import type_table as type_table
from juno_py.gguf.quants.registry import type_table_markdown as type_table_markdown


def _as_uint8_tensor(raw) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw if raw.dtype == torch.uint8 else raw.view(torch.uint8)
    arr = np.asarray(raw)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    arr = np.ascontiguousarray(arr)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # read-only mappings (the usual source) are fine: codecs never write into their input
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


# decoders that write a bfloat16 result themselves (their last float32 pass rounds): `dequantize_blocks(raw,
# out_dtype=torch.bfloat16)`; others decode to float32, then convert
NARROW_OUTPUT = {
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ1_S",
    "IQ1_M",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
}


def dequantize(ggml_type: int, raw, n_cols: int, what: str = "", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode rows of raw bytes (uint8 `[rows, bytes_per_row]`, numpy or torch) into float32 `[rows, n_cols]`;
    `dtype=torch.bfloat16`: those float32 values rounded to nearest even (the same bits as `.to(torch.bfloat16)`
    of the float32 result, without that extra pass over memory where the codec can). The block types of
    `native.TYPES` decode through the native decoder where it is built (the same bits; `JUNO_PY_NATIVE=0` turns it
    off), everything else through the torch codecs."""
    codec = get_codec(ggml_type, what)
    if n_cols % codec.block_size:
        raise UnsupportedQuantType(
            f"{codec.name}{' tensor ' + what if what else ''}: row length {n_cols} is not a "
            f"multiple of the block size {codec.block_size}"
        )
    data = _as_uint8_tensor(raw)
    rows = data.numel() // codec.row_bytes(n_cols) if n_cols else 0
    blocks = data.reshape(-1, codec.type_size)
    if blocks.shape[0] == 0:  # an empty view may have any strides, which no byte reinterpretation accepts
        return torch.empty(rows, n_cols, dtype=dtype)
    out = native.decode(ggml_type, blocks, dtype)  # the same bits, from the C decoder where it is built
    if out is not None:
        return out.reshape(rows, n_cols)
    if dtype == torch.float32:
        out = codec.dequantize_blocks(blocks)
    elif dtype == torch.bfloat16 and codec.name in NARROW_OUTPUT:
        out = codec.dequantize_blocks(blocks, out_dtype=dtype)
    else:
        out = codec.dequantize_blocks(blocks).to(dtype)
    return out.reshape(rows, n_cols)


def quantize(ggml_type: int, x, what: str = "") -> np.ndarray:
    """Encode a 2-D float tensor `[rows, n_cols]` into uint8 `[rows, bytes_per_row]` (numpy)."""
    codec = get_codec(ggml_type, what, action="encode")
    if codec.quantize_blocks is None:
        raise UnsupportedQuantType(
            f"cannot encode GGML type {codec.name}{' (tensor ' + what + ')' if what else ''}: "
            f"encodable types are {', '.join(quantizable_types())}"
        )
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(t.shape)}")
    rows, n_cols = t.shape
    if n_cols % codec.block_size:
        raise UnsupportedQuantType(
            f"{codec.name}{' tensor ' + what if what else ''}: row length {n_cols} is not a "
            f"multiple of the block size {codec.block_size}"
        )
    blocks = t.detach().to("cpu", torch.float32).contiguous().reshape(-1, codec.block_size)
    out = codec.quantize_blocks(blocks)
    return out.reshape(rows, codec.row_bytes(n_cols)).numpy()


# codec modules register themselves on import
from juno_py.gguf.quants import codebooks as _codebooks  # noqa: E402,F401
from juno_py.gguf.quants import iq4_quantize as _iq4_quantize  # noqa: E402,F401
from juno_py.gguf.quants import iquants as _iquants  # noqa: E402,F401
from juno_py.gguf.quants import kquant_quantize as _kquant_quantize  # noqa: E402,F401
from juno_py.gguf.quants import kquants as _kquants  # noqa: E402,F401
from juno_py.gguf.quants import native  # noqa: E402
from juno_py.gguf.quants import simple as _simple  # noqa: E402,F401
from juno_py.gguf.quants import ternary as _ternary  # noqa: E402,F401
from juno_py.gguf.quants import ternary_quantize as _ternary_quantize  # noqa: E402,F401
