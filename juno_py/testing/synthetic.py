"""Llama-architecture GGUF models of real shapes (Llama-7B, SmolLM2-135M) made of random valid blocks.

Random bytes whose float16 scale fields are set to small finite values, so every block is valid, decoded weights
are about 1/sqrt(fan-in) in size and activations stay finite. Decode and matmul time do not depend on the values,
so these stand in for real models where only speed and memory are measured.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from juno_py.gguf import GGMLType, GGUFWriter, ValueType
from juno_py.gguf.constants import GGML_BLOCK_SIZES

SHAPE_7B = dict(
    n_layer=32,
    n_embd=4096,
    n_ff=11008,
    n_head=32,
    n_head_kv=32,
    n_vocab=32000,
    rope_base=10000.0,
    matrix_type=GGMLType.Q4_K,
    embd_type=GGMLType.Q4_K,
    output_type=GGMLType.Q6_K,
)
# SmolLM2-135M as the store's file has it: Q4_1 blocks, Q8_0 embedding, tied output
SHAPE_SMOLLM2 = dict(
    n_layer=30,
    n_embd=576,
    n_ff=1536,
    n_head=9,
    n_head_kv=3,
    n_vocab=49152,
    rope_base=100000.0,
    matrix_type=GGMLType.Q4_1,
    embd_type=GGMLType.Q8_0,
    output_type=None,
)

# float16 scale fields of a block: (byte offset, low, high) of |value|, chosen so that decoded weights are about
# 1/sqrt(fan-in) in size and every activation stays finite; a negative `low` marks a field that holds a (negative)
# minimum, set to about -8 times the block's scale so the weights centre on zero (Q4_1: w = d·q + m, q in 0..15)
SCALE_FIELDS = {
    GGMLType.Q4_K: ((0, 1e-5, 3e-5), (2, 1e-5, 3e-5)),  # d·sc·q − dmin·m, 6-bit sc and m, 4-bit q
    GGMLType.Q6_K: ((208, 4e-5, 1.2e-4),),  # signed scales, centred codes
    GGMLType.Q5_K: ((0, 1e-5, 3e-5), (2, 1e-5, 3e-5)),  # as Q4_K, 5-bit q
    GGMLType.Q4_0: ((0, 2e-3, 6e-3),),  # centred codes -8..7
    GGMLType.Q4_1: ((0, 1e-3, 3e-3), (2, -8.0, None)),
    GGMLType.Q5_0: ((0, 2e-3, 6e-3),),  # centred codes -16..15
    GGMLType.Q5_1: ((0, 1e-3, 3e-3), (2, -16.0, None)),
    GGMLType.Q8_0: ((0, 5e-5, 2e-4),),  # signed codes
    GGMLType.Q2_K: ((80, 1e-4, 3e-4), (82, 1e-4, 3e-4)),  # d·sc·q − dmin·m, 4-bit sc and m, 2-bit q
    GGMLType.Q3_K: ((108, 2e-5, 6e-5),),  # d·(sc − 32)·(q − 4), signed 6-bit scales
    # the i-quants and ternary types: one float16 super-block scale (IQ1_M packs its scale into the sub-block
    # scales' high bits and has no such field: its blocks stay random bytes, valid for timing only)
    **{t: ((0, 1e-4, 3e-4),) for t in (GGMLType.IQ1_S, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S)},
    **{t: ((0, 1e-4, 3e-4),) for t in (GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ4_NL, GGMLType.IQ4_XS)},
    GGMLType.IQ1_M: (),
    GGMLType.MXFP4: (),  # its scale is an exponent byte: EXPONENT_FIELDS
    GGMLType.TQ1_0: ((52, 1e-2, 3e-2),),  # d after the packed trits
    GGMLType.TQ2_0: ((64, 1e-2, 3e-2),),
}
# MXFP4: an E8M0 exponent byte per 32 weights (2^(e-127) times a 4-bit float): set it near 2^-7
EXPONENT_FIELDS = {GGMLType.MXFP4: (0, 118, 122)}


def random_blocks(ggml_type: GGMLType, n_rows: int, n_cols: int, rng, embedding: bool = False, device=None):
    """Valid random blocks: random bytes with the float16 scale fields set to small finite values.

    rng: a numpy Generator (the result is a numpy array), or, with `device`, a torch.Generator on that device
    (the result is a torch uint8 tensor built there: a GPU makes a 70B-shaped model's 40 GB in seconds, with no
    host memory and no file)."""
    block, size = GGML_BLOCK_SIZES[ggml_type]
    n_blocks = n_rows * n_cols // block
    if device is None:
        blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

        def uniform(low, high):
            return rng.uniform(low, high, n_blocks)

        def put(offset, value):
            blocks[:, offset : offset + 2] = value.astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    else:
        import torch

        blocks = torch.randint(0, 256, (n_blocks, size), dtype=torch.uint8, device=device, generator=rng)

        def uniform(low, high):
            return torch.empty(n_blocks, dtype=torch.float64, device=device).uniform_(low, high, generator=rng)

        def put(offset, value):
            blocks[:, offset : offset + 2] = value.to(torch.float16).view(torch.uint8).view(n_blocks, 2)

    scale = None
    for offset, low, high in SCALE_FIELDS[ggml_type]:
        if high is None:  # a minimum: `low` times the block's scale
            value = low * scale * uniform(0.9, 1.1)
        else:
            value = uniform(low, high) * (5.0 if embedding else 1.0)
            scale = value
        put(offset, value)
    if ggml_type in EXPONENT_FIELDS:
        offset, low, high = EXPONENT_FIELDS[ggml_type]
        if device is None:
            blocks[:, offset] = rng.integers(low, high + 1, n_blocks, dtype=np.uint8)
        else:
            blocks[:, offset] = torch.randint(
                low, high + 1, (n_blocks,), dtype=torch.uint8, device=device, generator=rng
            )
    return blocks


def llama_metadata(shape: dict) -> list:
    """(key, value, ValueType) of a model of `shape` (see SHAPE_7B): llama architecture unless `shape["arch"]` names
    another of the same layout (`qwen3`: per-head q/k norms, `shape["head_dim"]` wide)."""
    s, u32, f32 = shape, ValueType.UINT32, ValueType.FLOAT32
    arch = s.get("arch", "llama")
    head_dim = s.get("head_dim", s["n_embd"] // s["n_head"])
    meta = [
        ("general.architecture", arch, ValueType.STRING),
        ("general.name", "synthetic", ValueType.STRING),
        (f"{arch}.context_length", 4096, u32),
        (f"{arch}.embedding_length", s["n_embd"], u32),
        (f"{arch}.block_count", s["n_layer"], u32),
        (f"{arch}.feed_forward_length", s["n_ff"], u32),
        (f"{arch}.attention.head_count", s["n_head"], u32),
        (f"{arch}.attention.head_count_kv", s["n_head_kv"], u32),
        (f"{arch}.attention.layer_norm_rms_epsilon", s.get("rms_eps", 1e-5), f32),
        (f"{arch}.rope.freq_base", s["rope_base"], f32),
        (f"{arch}.rope.dimension_count", head_dim, u32),
        (f"{arch}.vocab_size", s["n_vocab"], u32),
    ]
    if "head_dim" in s:
        meta += [(f"{arch}.attention.key_length", head_dim, u32), (f"{arch}.attention.value_length", head_dim, u32)]
    return meta


def use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's rule for the layers a Q4_K_M or Q5_K_M file gives more bits (Q6_K) in attn_v and ffn_down: the
    first and last eighth of the layers, and every third layer between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def llama_tensors(shape: dict) -> list:
    """(name, GGML type, shape, is the embedding) of every tensor, in file order; F32 tensors are norms (ones).
    `shape["q4_k_m"]`: attn_v and ffn_down in Q6_K on the layers `use_more_bits` picks, as llama.cpp's Q4_K_M."""
    s = shape
    head_dim = s.get("head_dim", s["n_embd"] // s["n_head"])
    d, ff, q, kv = s["n_embd"], s["n_ff"], head_dim * s["n_head"], head_dim * s["n_head_kv"]
    t = s["matrix_type"]
    out = [("token_embd.weight", s["embd_type"], (s["n_vocab"], d), True)]
    for il in range(s["n_layer"]):
        p = f"blk.{il}."
        more = GGMLType.Q6_K if s.get("q4_k_m") and use_more_bits(il, s["n_layer"]) else t
        out += [(p + "attn_norm.weight", GGMLType.F32, (d,), False)]
        if s.get("arch") == "qwen3":
            out += [
                (p + "attn_q_norm.weight", GGMLType.F32, (head_dim,), False),
                (p + "attn_k_norm.weight", GGMLType.F32, (head_dim,), False),
            ]
        out += [
            (p + "attn_q.weight", t, (q, d), False),
            (p + "attn_k.weight", t, (kv, d), False),
            (p + "attn_v.weight", more, (kv, d), False),
            (p + "attn_output.weight", t, (d, q), False),
            (p + "ffn_norm.weight", GGMLType.F32, (d,), False),
            (p + "ffn_gate.weight", t, (ff, d), False),
            (p + "ffn_up.weight", t, (ff, d), False),
            (p + "ffn_down.weight", more, (d, ff), False),
        ]
    out.append(("output_norm.weight", GGMLType.F32, (d,), False))
    if s["output_type"] is not None:
        out.append(("output.weight", s["output_type"], (s["n_vocab"], d), False))
    return out


def write_synthetic_llama(path: Path, shape: dict, seed: int = 0) -> Path:
    """A llama-architecture GGUF of `shape` (see SHAPE_7B) with random valid blocks, written tensor by tensor."""
    rng = np.random.default_rng(seed)
    with GGUFWriter(path) as w:
        for key, value, vtype in llama_metadata(shape):
            w.add_field(key, value, vtype)
        for name, t, dims, embedding in llama_tensors(shape):
            if t == GGMLType.F32:
                w.add_tensor(name, np.ones(dims[0], dtype=np.float32), GGMLType.F32, dims)
            else:
                w.add_tensor(name, random_blocks(t, dims[0], dims[1], rng, embedding), t, dims)
    return path
