"""Random valid blocks of the codebook, ternary and MXFP4 types, and the codebook indices they hold.

Any bytes are a valid block of these types except the float16 scale fields, which must be finite: they are set
to random finite float16 patterns (any sign, zeros and subnormals included). IQ1_M has no float16 field of its
own: its scale is the top nibbles of the four uint16s at byte 48, and is set there.
"""

from __future__ import annotations

import gguf
import numpy as np

from juno_py.gguf import GGUFWriter
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType

NEW_TYPES = [
    GGMLType.IQ1_S,
    GGMLType.IQ1_M,
    GGMLType.IQ2_XXS,
    GGMLType.IQ2_XS,
    GGMLType.IQ2_S,
    GGMLType.IQ3_XXS,
    GGMLType.IQ3_S,
    GGMLType.TQ1_0,
    GGMLType.TQ2_0,
    GGMLType.MXFP4,
]

# byte offsets of the float16 fields per type (IQ1_M: none, see `random_blocks`)
F16_FIELDS = {
    GGMLType.IQ1_S: (0,),
    GGMLType.IQ1_M: (),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.IQ2_XS: (0,),
    GGMLType.IQ2_S: (0,),
    GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,),
    GGMLType.TQ1_0: (52,),
    GGMLType.TQ2_0: (64,),
    GGMLType.MXFP4: (),
}


def finite_f16_bits(rng: np.random.Generator, n: int, moderate: bool = False) -> np.ndarray:
    """n random finite float16 bit patterns (uint16); `moderate`: magnitudes 2^-8 .. 2^-3 of either sign."""
    if moderate:
        scale = rng.uniform(2.0**-8, 2.0**-3, n) * rng.choice([-1.0, 1.0], n)
        return scale.astype("<f2").view(np.uint16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # an all-ones exponent (inf, NaN) loses its top bit
    return bits


def random_blocks(ggml_type: GGMLType, n_blocks: int, seed: int = 0, moderate: bool = False) -> np.ndarray:
    """uint8 `[n_blocks, type_size]` of valid random blocks of `ggml_type`."""
    rng = np.random.default_rng(seed)
    size = GGML_BLOCK_SIZES[ggml_type][1]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        blocks[:, offset : offset + 2] = finite_f16_bits(rng, n_blocks, moderate).view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == GGMLType.IQ1_M:
        d = finite_f16_bits(rng, n_blocks, moderate).astype(np.uint16)
        words = blocks[:, 48:56].copy().view("<u2")
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    if ggml_type == GGMLType.MXFP4 and moderate:
        blocks[:, 0] = rng.integers(120, 127, n_blocks)  # scales 2^-8 .. 2^-2
    return blocks


def _u16(blocks: np.ndarray, start: int, length: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + length]).view("<u2").astype(np.int64)


def _u32(blocks: np.ndarray, start: int, length: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + length]).view("<u4").astype(np.int64)


def codebook_indices(ggml_type: GGMLType, blocks: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
    """The grid indices and sign indices (or sign bytes) the blocks hold, each with the size of its index space:
    {"grid": (indices, size), "signs": (indices, size)}, read from the layout as llama.cpp's decoders read it."""
    n = blocks.shape[0]
    if ggml_type == GGMLType.IQ2_XXS:
        aux = _u32(blocks, 2, 64).reshape(n, 8, 2)[:, :, 1]
        grid = blocks[:, 2:66].reshape(n, 8, 8)[:, :, 0:4]
        signs = (aux[:, :, None] >> np.array([0, 7, 14, 21])) & 0x7F
        return {"grid": (grid, 256), "signs": (signs, 128)}
    if ggml_type == GGMLType.IQ2_XS:
        qs = _u16(blocks, 2, 64)
        return {"grid": (qs & 511, 512), "signs": (qs >> 9, 128)}
    if ggml_type == GGMLType.IQ2_S:
        qh = (blocks[:, 66:74, None].astype(np.int64) >> np.array([0, 2, 4, 6])) & 3
        return {"grid": (blocks[:, 2:34] | (qh.reshape(n, 32) << 8), 1024), "signs": (blocks[:, 34:66], 256)}
    if ggml_type == GGMLType.IQ3_XXS:
        aux = _u32(blocks, 66, 32)
        return {"grid": (blocks[:, 2:66], 256), "signs": ((aux[:, :, None] >> np.array([0, 7, 14, 21])) & 0x7F, 128)}
    if ggml_type == GGMLType.IQ3_S:
        qh = (blocks[:, 66:74, None].astype(np.int64) >> np.arange(8)) & 1
        return {"grid": (blocks[:, 2:66] | (qh.reshape(n, 64) << 8), 512), "signs": (blocks[:, 74:106], 256)}
    if ggml_type == GGMLType.IQ1_S:
        qh = _u16(blocks, 34, 16)
        high = (qh[:, :, None] >> np.array([0, 3, 6, 9])) & 7
        return {"grid": (blocks[:, 2:34] | (high.reshape(n, 32) << 8), 2048)}
    if ggml_type == GGMLType.IQ1_M:
        qh = blocks[:, 32:48, None].astype(np.int64) >> np.array([0, 4])
        return {"grid": (blocks[:, 0:32] | ((qh.reshape(n, 32) & 7) << 8), 2048)}
    return {}


# a one-layer llama whose rows are 256 columns: every input width is a whole number of 256-value blocks
TINY_LLAMA = dict(
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def tiny_llama_parts():
    """(metadata, fp32 tensors under GGUF names) of the tiny llama `TINY_LLAMA`."""
    from juno_py.testing.tiny_models import gguf_metadata, gguf_tensors, hf_tiny_model

    model = hf_tiny_model("llama", 0, TINY_LLAMA)
    return gguf_metadata("llama", model), gguf_tensors("llama", model)


def write_model_pair(folder, metadata, tensors, ggml_type: GGMLType):
    """The model with every linear (2-D tensors but the embeddings) as random `ggml_type` blocks, and the same
    model with those weights decoded by the gguf package and stored as F32: their paths."""
    from juno_py.testing.tiny_models import _ITEM_TYPES

    paths = folder / f"{ggml_type.name}.gguf", folder / f"{ggml_type.name}-dense.gguf"
    gtype = gguf.GGMLQuantizationType(int(ggml_type))
    with GGUFWriter(paths[0]) as quant, GGUFWriter(paths[1]) as dense:
        for key, value, vtype in metadata:
            for w in (quant, dense):
                w.add_field(key, value, vtype, _ITEM_TYPES.get(key))
        for i, (name, t) in enumerate(tensors.items()):
            t = t.detach().float().contiguous()
            if t.dim() != 2 or name == "token_embd.weight":
                data = t.numpy().reshape(-1, t.shape[-1]) if t.dim() == 2 else t.numpy()
                for w in (quant, dense):
                    w.add_tensor(name, data, GGMLType.F32, tuple(t.shape))
                continue
            n_blocks = t.numel() // GGML_BLOCK_SIZES[ggml_type][0]
            raw = random_blocks(ggml_type, n_blocks, seed=i, moderate=True).reshape(t.shape[0], -1)
            values = gguf.quants.dequantize(raw, gtype).astype(np.float32)
            quant.add_tensor(name, raw, ggml_type, tuple(t.shape))
            dense.add_tensor(name, np.ascontiguousarray(values.reshape(t.shape)), GGMLType.F32, tuple(t.shape))
    return paths
