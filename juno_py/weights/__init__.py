"""Frozen quantized linears: the base model's weights, kept in their GGUF encoding.

`FrozenQuantLinear` (`frozen`) is the entry point; it is a `StreamingQuantLinear` (`streaming`, bytes on the CPU) or
a `ResidentQuantLinear` (`resident`, bytes on a GPU), and both provide the Protocols of `base`.
"""

from juno_py.weights.base import ExactProducts, FrozenBase, has_exact_products
from juno_py.weights.frozen import (
    DEFAULT_SCRATCH_BYTES,
    FrozenQuantLinear,
    StreamingLinearFn,
    default_chunk_rows,
    scratch_bytes_for,
)
from juno_py.weights.resident import MATVEC_MAX_TOKENS, ResidentQuantLinear
from juno_py.weights.streaming import BF16_MIN_TOKENS, StreamingQuantLinear

__all__ = [
    "FrozenQuantLinear",
    "StreamingQuantLinear",
    "ResidentQuantLinear",
    "FrozenBase",
    "ExactProducts",
    "has_exact_products",
    "StreamingLinearFn",
    "DEFAULT_SCRATCH_BYTES",
    "BF16_MIN_TOKENS",
    "MATVEC_MAX_TOKENS",
    "default_chunk_rows",
    "scratch_bytes_for",
]
