"""Frozen quantized linears: the base model's weights, kept in their GGUF encoding and used by streaming."""

from juno_py.weights.frozen import (
    BF16_MIN_TOKENS,
    DEFAULT_SCRATCH_BYTES,
    FrozenQuantLinear,
    StreamingLinearFn,
    default_chunk_rows,
    scratch_bytes_for,
)

__all__ = ["FrozenQuantLinear", "StreamingLinearFn", "DEFAULT_SCRATCH_BYTES", "BF16_MIN_TOKENS",
           "default_chunk_rows", "scratch_bytes_for"]
