"""Our tokenizer against llama.cpp's, on the golden data made by tests/golden/make_golden.py."""

import pytest

from juno_py.gguf import GGUFFile
from juno_py.tokenizer import Tokenizer
from tests.tokenizer.conftest import load_golden


def _flags(key: str) -> tuple[bool, bool]:
    """(add_special, parse_special) of a golden ids key such as 'special_bos'."""
    return key.endswith("_bos"), key.startswith("special")


def test_long_text_whole_matches_llama_cpp(model_and_golden):
    tok, g = model_and_golden
    assert len(g["text"]) >= 20_000
    for key, ids in g["whole"].items():
        add_special, parse_special = _flags(key)
        assert tok.encode(g["text"], add_special=add_special, parse_special=parse_special) == ids, key


@pytest.mark.parametrize("kind", ["plain", "special"])
def test_long_text_line_by_line_matches_llama_cpp(model_and_golden, kind):
    tok, g = model_and_golden
    lines = g["text"].splitlines(keepends=True)
    assert len(lines) == len(g["lines"][kind])
    mismatched = [
        line
        for line, ids in zip(lines, g["lines"][kind])
        if tok.encode(line, add_special=False, parse_special=kind == "special") != ids
    ]
    assert mismatched == []


def test_short_strings_match_llama_cpp(model_and_golden):
    tok, g = model_and_golden
    for case in g["short"]:
        for key, ids in case["ids"].items():
            add_special, parse_special = _flags(key)
            assert tok.encode(case["text"], add_special=add_special, parse_special=parse_special) == ids, (
                case["text"],
                key,
            )


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def test_detokenize_matches_llama_cpp(model_and_golden):
    tok, g = model_and_golden
    for case in g["short"]:
        ids = case["ids"]
        assert _text(tok.detokenize(ids["plain"])) == case["detok"], case["text"]
        assert _text(tok.detokenize(ids["special_bos"], unparse_special=True)) == case["detok_special"], case["text"]
        assert _text(tok.detokenize(ids["special_bos"], remove_special=True)) == case["detok_remove_special"], case[
            "text"
        ]
    for key, ids in g["whole"].items():
        for special, field in ((False, "whole_detok"), (True, "whole_detok_special")):
            expected = g["text"] if g[field][key] is True else g[field][key]
            assert _text(tok.detokenize(ids, remove_special=True, unparse_special=special)) == expected, (key, special)


def test_token_pieces_match_llama_cpp(model_and_golden):
    tok, g = model_and_golden
    for case in g["short"]:
        ids = case["ids"]["special_bos"]
        assert [tok.token_to_bytes(i).hex() for i in ids] == case["pieces"], case["text"]
        assert [tok.token_to_bytes(i, special=True).hex() for i in ids] == case["pieces_special"], case["text"]


def test_special_ids_match_llama_cpp(model_and_golden):
    tok, g = model_and_golden
    assert tok.vocab_size == g["vocab_size"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (g["bos"], g["eos"], g["add_bos"], g["add_eos"])
    assert tok.eog_ids == set(g["eog"])


def test_end_of_turn_tokens_end_generation(smollm2_tokenizer, gemma3_tokenizer):
    smol, gemma = smollm2_tokenizer, gemma3_tokenizer
    assert smol.token_id("<|im_end|>") in smol.eog_ids and smol.eos_id in smol.eog_ids
    assert smol.token_id("<|im_start|>") not in smol.eog_ids
    assert gemma.metadata.get("tokenizer.ggml.eot_token_id") is None  # found by its text, as llama.cpp does
    assert gemma.eot_id == gemma.token_id("<end_of_turn>")
    assert {gemma.token_id("<end_of_turn>"), gemma.eos_id} <= gemma.eog_ids
    assert gemma.token_id("<start_of_turn>") not in gemma.eog_ids


def test_eot_is_found_by_text_when_llama_cpp_finds_one():
    g = load_golden("gemma3")
    assert g["eot"] is not None  # llama.cpp's pick; with several candidates (SmolLM2) it depends on hash order


@pytest.mark.parametrize(
    "variant",
    ["smollm2_pre_default", "smollm2_pre_gpt-2", "smollm2_pre_llama-bpe", "smollm2_pre_qwen2", "gemma3_space_prefix"],
)
def test_other_pre_tokenizers_match_llama_cpp(variant, request):
    """The real vocabularies re-read with another tokenizer.ggml.pre (or SentencePiece's space prefix on)."""
    golden = load_golden("variants")
    record = golden["variants"][variant]
    path = request.getfixturevalue({"smollm2-135m": "smollm2_path", "gemma3-270m": "gemma3_path"}[record["base"]])
    metadata = {**GGUFFile(path).metadata, **record["changes"]}
    tok = Tokenizer(metadata, source=variant)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (record["bos"], record["eos"], record["add_bos"])
    lines = golden["text"].splitlines(keepends=True)
    assert [line for line, ids in zip(lines, record["lines"]) if tok.encode(line, add_special=False) != ids] == []
    for case in record["short"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["detok"], case["text"]
