"""decode(encode(x)) gives x back wherever llama.cpp's detokenize does; streaming never splits a character."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ALPHABET = st.sampled_from(
    list("abcXYZ019 ,.!?'\"\t\n\r-_()<>|/")
    + ["é", "ß", "中", "文", "🙂", "👍🏽", "ع", "\u0301", "\u00a0", "\u3000", "²", "▁", "  ", "\n\n"]
)


def test_decode_inverts_encode_where_llama_cpp_does(model_and_golden):
    tok, g = model_and_golden
    given_back = [c["text"] for c in g["short"] if c["detok"] == c["text"]]  # llama.cpp's detokenize of its ids
    assert len(given_back) > len(g["short"]) // 2
    for text in given_back:
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(tok.encode(text)) == text  # BOS is a control token: decode() drops it
    assert g["whole_detok"]["plain_bos"] is True and tok.decode(tok.encode(g["text"])) == g["text"]
    special = tok.encode(g["text"], add_special=False, parse_special=True)
    assert g["whole_detok_special"]["special_bos"] is True and tok.decode(special, special=True) == g["text"]


@SETTINGS
@given(st.lists(ALPHABET, max_size=40).map("".join))
def test_byte_level_bpe_round_trips_any_text(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


@SETTINGS
@given(st.lists(ALPHABET.filter(lambda c: c not in ("▁", "<", ">")), max_size=40).map("".join))
def test_sentencepiece_round_trips_text_without_markers(gemma3_tokenizer, text):
    # U+2581 reads back as a space, and "<...>" could spell a control token, which decode() drops
    assert gemma3_tokenizer.decode(gemma3_tokenizer.encode(text)) == text


def test_stream_decoder_emits_whole_characters(model_and_golden):
    tok, g = model_and_golden
    text = "héllo 世界 🙂👍🏽 مرحبا"
    ids = tok.encode(text, add_special=False)
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    assert b"".join(tok.token_to_bytes(i) for i in ids) == text.encode()


def test_control_tokens_render_only_when_asked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", parse_special=True)
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, special=True) == "<|im_start|>user\nhi<|im_end|>"
