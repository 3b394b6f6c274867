"""Tiny GGUF files of random but valid quantized blocks: random layers of every decodable type.

A block of any GGML type is valid for any integer bits: only its float16 scale fields can be Inf or NaN.
So a layer is random bytes with those fields overwritten by finite, moderate values: no quantizer needed,
and every code value the decoders can meet appears.
"""

from __future__ import annotations

import numpy as np
import torch

from juno_py.gguf import GGMLType, GGUFWriter
from juno_py.gguf.constants import GGML_BLOCK_SIZES

# byte offsets of the float16 scale fields (d, and dmin / m) inside one block, per block type
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
}
ELEMENT_TYPES = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: None}
ALL_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, *F16_FIELDS]


def random_rows(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """uint8 `[n_rows, bytes_per_row]` of valid random blocks (scales of magnitude 2^-8 .. 2^-3)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_BLOCK_SIZES[ggml_type]
    if ggml_type in ELEMENT_TYPES:
        values = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        if ggml_type == GGMLType.BF16:
            return torch.from_numpy(values).bfloat16().view(torch.uint8).numpy().reshape(n_rows, -1)
        return values.astype(ELEMENT_TYPES[ggml_type]).view(np.uint8).reshape(n_rows, -1)
    n_blocks = n_rows * n_cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        scale = rng.uniform(2.0**-8, 2.0**-3, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)
        blocks[:, offset : offset + 2] = scale.astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, n_cols // block * size)


# every type gets its own tensor in one file, so the tests read them back through the memory map
LAYER_SHAPE = (48, 512)  # (n_out, n_in): 512 is two 256-element super-blocks
FUSED = "blk.0.attn_qkv.weight"
FUSED_SHAPE = (96, 256)
FUSED_TYPE = GGMLType.Q4_K
FUSED_BIAS = "blk.0.attn_qkv.bias"


def layer_name(ggml_type: GGMLType) -> str:
    return f"layer.{ggml_type.name}.weight"


def write_layers_gguf(path) -> None:
    with GGUFWriter(path) as w:
        w.add_field("general.architecture", "llama")
        for i, t in enumerate(ALL_TYPES):
            w.add_tensor(layer_name(t), random_rows(t, *LAYER_SHAPE, seed=i), t, LAYER_SHAPE)
        w.add_tensor(FUSED, random_rows(FUSED_TYPE, *FUSED_SHAPE, seed=99), FUSED_TYPE, FUSED_SHAPE)
        bias = np.random.default_rng(7).standard_normal(FUSED_SHAPE[0]).astype(np.float32)
        w.add_tensor(FUSED_BIAS, bias, GGMLType.F32, (FUSED_SHAPE[0],))
