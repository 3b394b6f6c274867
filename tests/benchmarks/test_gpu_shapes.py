"""The GPU training benchmark's real-shape models: per-tensor types as a Q4_K_M file holds them, a qwen3 variant
that juno-py loads and runs, and the step's counted FLOPs."""

from collections import Counter

import torch

from benchmarks.train_gpu import CONFIGS, SHAPE_QWEN3_8B, model_spec, step_flops
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.models.model import Transformer
from juno_py.testing.synthetic import llama_tensors, use_more_bits, write_synthetic_llama


def test_llama8b_types_are_those_of_a_q4_k_m_file():
    # llama.cpp loading Meta-Llama-3-8B-Instruct Q4_K_M reports 65 f32, 193 q4_K and 33 q6_K tensors
    _, spec = model_spec("llama8b")
    assert Counter(t.name for _, t, _, _ in spec) == {"F32": 65, "Q4_K": 193, "Q6_K": 33}
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_qwen3_shaped_synthetic_model_loads_and_runs(tmp_path):
    shape = {**SHAPE_QWEN3_8B, "n_layer": 2, "n_embd": 256, "n_ff": 512, "n_head": 4, "n_head_kv": 2, "n_vocab": 512}
    shape["head_dim"] = 64
    names = [n for n, *_ in llama_tensors(shape)]
    assert "blk.1.attn_q_norm.weight" in names and "blk.1.attn_k_norm.weight" in names
    path = write_synthetic_llama(tmp_path / "q.gguf", shape)
    f = GGUFFile(path)
    assert f.metadata["general.architecture"] == "qwen3"
    assert f.tensors["blk.0.attn_q.weight"].shape == (256, 256)
    assert f.tensors["blk.0.attn_v.weight"].ggml_type == GGMLType.Q4_K
    assert f.tensors["blk.1.attn_v.weight"].ggml_type == GGMLType.Q6_K  # the last eighth gets more bits
    model = Transformer.from_gguf(f)
    assert model.args.head_dim == 64
    logits = model.logits(torch.tensor([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


def test_step_flops_counts_linears_head_and_attention():
    meta, spec = model_spec("llama8b")
    tokens = 8 * 512
    linear = sum(d[0] * d[1] for n, _, d, _ in spec if n.startswith("blk.") and len(d) == 2) + 128256 * 4096
    flops = step_flops(meta, spec, CONFIGS["lora-qv-r8"], 8, 512)
    assert 4 * tokens * linear < flops < 1.1 * 4 * tokens * linear
    assert step_flops(meta, spec, CONFIGS["lora-all-r16"], 8, 512) > flops
