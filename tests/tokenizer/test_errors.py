"""Vocabularies we cannot use fail with one line naming the file and the field."""

import pytest

from juno_py.errors import TokenizerError
from juno_py.gguf import GGUFFile
from juno_py.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_path):
    return dict(GGUFFile(smollm2_path).metadata)


def _error(metadata, source="model.gguf") -> str:
    with pytest.raises(TokenizerError) as info:
        Tokenizer(metadata, source=source)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_pre_tokenizer_is_one_line_naming_file_and_value(smollm2_metadata):
    message = _error({**smollm2_metadata, "tokenizer.ggml.pre": "mystery-bpe"}, source="/models/x.gguf")
    assert "/models/x.gguf" in message and "'mystery-bpe'" in message and "tokenizer.ggml.pre" in message


def test_missing_pre_tokenizer_means_default_as_in_llama_cpp(smollm2_metadata):
    metadata = {k: v for k, v in smollm2_metadata.items() if k != "tokenizer.ggml.pre"}
    assert Tokenizer(metadata).pre == "default"


def test_unsupported_tokenizer_model(smollm2_metadata):
    message = _error({**smollm2_metadata, "tokenizer.ggml.model": "bert"})
    assert "'bert'" in message and "model.gguf" in message


def test_missing_merges(smollm2_metadata):
    metadata = {k: v for k, v in smollm2_metadata.items() if k != "tokenizer.ggml.merges"}
    assert "tokenizer.ggml.merges" in _error(metadata)


def test_add_bos_without_a_bos_token():
    # a tiny vocabulary: llama.cpp's default BPE BOS id (11) lies outside it, so there is no BOS
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.add_bos_token": True,
    }
    assert "add_bos_token" in _error(metadata)
    tok = Tokenizer({**metadata, "tokenizer.ggml.add_bos_token": False})
    assert tok.bos_id is None and tok.encode("abba") == [2, 1, 0]


def test_out_of_range_token_id_is_refused(smollm2_tokenizer):
    with pytest.raises(TokenizerError):
        smollm2_tokenizer.token_to_bytes(smollm2_tokenizer.vocab_size)
