"""Files we must refuse: each ends in one line naming the file and the tensor or metadata key at fault."""

import pytest
import torch

from juno_py import load_model
from juno_py.errors import GGUFFormatError, UnsupportedArchitecture
from juno_py.gguf import GGUFFile
from juno_py.models import ARCHITECTURES, Transformer


def refuse(path, error):
    with pytest.raises(error) as info:
        Transformer.from_gguf(GGUFFile(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_unknown_architecture_lists_the_allowlist(tiny_gguf):
    path = tiny_gguf("llama", metadata={"general.architecture": "mamba"})
    message = refuse(path, UnsupportedArchitecture)
    assert "'mamba'" in message and ", ".join(ARCHITECTURES) in message
    with pytest.raises(UnsupportedArchitecture):
        load_model(str(path))


def test_missing_tensor_is_named(tiny_gguf):
    message = refuse(tiny_gguf("llama", drop=["blk.1.ffn_down.weight"]), GGUFFormatError)
    assert "'blk.1.ffn_down.weight' is missing" in message


def test_missing_norm_is_named(tiny_gguf):
    message = refuse(tiny_gguf("gemma3", drop=["blk.3.post_ffw_norm.weight"]), GGUFFormatError)
    assert "'blk.3.post_ffw_norm.weight' is missing" in message


def test_head_count_disagreeing_with_shapes_names_the_tensor(tiny_gguf):
    message = refuse(tiny_gguf("llama", metadata={"llama.attention.head_count_kv": 4}), GGUFFormatError)
    assert "'blk.0.attn_k.weight' has shape (32, 64)" in message and "expected (64, 64)" in message


def test_feed_forward_length_disagreeing_with_shapes_names_the_tensor(tiny_gguf):
    message = refuse(tiny_gguf("qwen3", metadata={"qwen3.feed_forward_length": 128}), GGUFFormatError)
    assert "'blk.0.ffn_gate.weight' has shape (96, 64)" in message


def test_fused_gate_up_of_the_wrong_height_is_refused(tiny_gguf):
    # no ffn_gate: ffn_up must then hold gate and up (2 * n_ff rows)
    message = refuse(tiny_gguf("llama", drop=["blk.0.ffn_gate.weight"]), GGUFFormatError)
    assert "'blk.0.ffn_up.weight' has shape (96, 64)" in message and "(192, 64)" in message


def test_fused_qkv_of_the_wrong_height_is_refused(tiny_gguf):
    path = tiny_gguf("phi3", metadata={"phi3.attention.head_count": 2})
    message = refuse(path, GGUFFormatError)
    assert "'blk.0.attn_qkv.weight'" in message


def test_block_count_beyond_the_tensors_names_the_missing_block(tiny_gguf):
    message = refuse(tiny_gguf("llama", metadata={"llama.block_count": 3}), GGUFFormatError)
    assert "'blk.2." in message and "is missing" in message


def test_tensors_left_unused_are_refused(tiny_gguf):
    message = refuse(tiny_gguf("llama", metadata={"llama.block_count": 1}), GGUFFormatError)
    assert "'blk.1." in message and "not used" in message
    extra = {"blk.0.ffn_gate_exps.weight": torch.zeros(4, 96, 64)}
    message = refuse(tiny_gguf("qwen3", extra=extra), GGUFFormatError)
    assert "'blk.0.ffn_gate_exps.weight'" in message


def test_missing_required_bias_is_named(tiny_gguf):
    message = refuse(tiny_gguf("qwen2", drop=["blk.0.attn_k.bias"]), GGUFFormatError)
    assert "'blk.0.attn_k.bias' is missing" in message


def test_missing_metadata_key_is_named(tiny_gguf):
    message = refuse(tiny_gguf("qwen2", metadata={"qwen2.embedding_length": None}), GGUFFormatError)
    assert "'qwen2.embedding_length' is missing" in message


def test_unsupported_rope_scaling_is_named(tiny_gguf):
    message = refuse(tiny_gguf("llama", metadata={"llama.rope.scaling.type": "dynamic"}), UnsupportedArchitecture)
    assert "llama.rope.scaling.type" in message and "'dynamic'" in message


def test_vocab_size_disagreeing_with_the_embedding_is_refused(tiny_gguf):
    message = refuse(tiny_gguf("qwen3", metadata={"qwen3.vocab_size": 300}), GGUFFormatError)
    assert "'token_embd.weight'" in message and "qwen3.vocab_size" in message
