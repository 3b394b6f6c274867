"""llama.cpp's pre-tokenizer machinery against the original regexes run by the `regex` module.

llama.cpp's hand-written GPT-2 and Llama 3 matchers and its collapsed-category std::regex path are
meant to equal these regexes; on characters whose Unicode category both sides agree on, so must ours.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from juno_py.tokenizer import pretokenize

regex = pytest.importorskip("regex")

ORIGINAL = {
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
ALPHABET = st.sampled_from(
    list("aZq09 '\t\n\r.,;!-_()[]$+<=>^~|")
    + ["'s", "'LL", "'re", "é", "ß", "中", "🙂", "١", "²", "\u0301", "\u00a0", "\u3000", "\u2009", "Ω", "\x01"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ALPHABET, max_size=40).map("".join), st.sampled_from(sorted(ORIGINAL)))
def test_split_equals_original_regex(text, name):
    expected = regex.findall(ORIGINAL[name], text)
    assert pretokenize.split(text, pretokenize.REGEXES[name]) == expected
    assert pretokenize.split(text, pretokenize.REGEXES[name], reference=True) == expected


def test_smollm_splits_every_digit():
    assert pretokenize.split("abc 12345 x1", pretokenize.REGEXES["starcoder"]) == [
        "abc",
        " ",
        "1",
        "2",
        "3",
        "4",
        "5",
        " x",
        "1",
    ]


def test_llama3_groups_digits_by_three():
    assert pretokenize.split("1234567", pretokenize.REGEXES["llama3"]) == ["123", "456", "7"]


def test_default_pre_tokenizer_splits_punctuation_then_digit_triples():
    assert pretokenize.split("a,b 123456789!", pretokenize.REGEXES["default"]) == [
        "a",
        ",",
        "b",
        " ",
        "123",
        "456",
        "789",
        "!",
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(ALPHABET, max_size=40).map("".join), st.sampled_from(sorted(pretokenize.REGEXES)))
def test_fast_split_equals_llama_cpp_hand_written_matchers(text, name):
    regexes = pretokenize.REGEXES[name]
    assert pretokenize.split(text, regexes) == pretokenize.split(text, regexes, reference=True)


def test_reference_split_on_golden_text():
    from tests.tokenizer.conftest import load_golden

    text = load_golden("variants")["text"]
    for name, regexes in pretokenize.REGEXES.items():
        assert pretokenize.split(text, regexes) == pretokenize.split(text, regexes, reference=True), name
