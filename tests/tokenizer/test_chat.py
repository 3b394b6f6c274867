"""Chat templates: the real files' (or the built-in) rendering, transformers as the oracle, and the sandbox."""

import pytest

from juno_py.errors import TokenizerError
from juno_py.tokenizer import ChatTemplate
from juno_py.tokenizer.chat import BUILTIN_TEMPLATES

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?  "},
    ],
    [{"role": "user", "content": "Ünïcödé 🙂 <b>bold</b>\n\nnew lines  "}],
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2_tokenizer, hf_smollm2, messages, add_generation_prompt):
    assert smollm2_tokenizer.metadata.get("tokenizer.chat_template")  # the file carries its own template
    ours = smollm2_tokenizer.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_builtin_templates_render_as_transformers_would(hf_smollm2, key, messages):
    """The same template source through transformers' own jinja environment gives the same text."""
    if key == "gemma" and messages[0]["role"] == "system":
        pass  # the system turn folds into the first user turn: covered too
    ours = ChatTemplate.builtin(key, bos_token=hf_smollm2.bos_token, eos_token=hf_smollm2.eos_token)
    theirs = hf_smollm2.apply_chat_template(
        messages, chat_template=BUILTIN_TEMPLATES[key], tokenize=False, add_generation_prompt=True
    )
    assert ours.render(messages) == theirs


def test_gemma3_uses_builtin_template(gemma3_tokenizer):
    assert gemma3_tokenizer.metadata.get("tokenizer.chat_template") is None
    template = gemma3_tokenizer.chat_template
    assert "gemma" in template.name
    assert (
        template.render(CONVERSATIONS[0]) == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    )
    assert template.render(CONVERSATIONS[1], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
    )


def test_gemma3_prompt_tokens_are_turn_markers(gemma3_tokenizer):
    tok = gemma3_tokenizer
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert ids[:3] == [tok.bos_id, tok.token_id("<start_of_turn>"), tok.token_id("user")]
    assert ids.count(tok.bos_id) == 1
    assert tok.token_id("<end_of_turn>") in ids and tok.token_id("<end_of_turn>") in tok.eog_ids


def test_smollm2_prompt_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert ids[0] == tok.token_id("<|im_start|>") and ids.count(tok.token_id("<|im_end|>")) == 2
    assert tok.decode(ids, special=True) == tok.chat_template.render(CONVERSATIONS[0])


def test_gemma_template_rejects_non_alternating_roles(gemma3_tokenizer):
    with pytest.raises(TokenizerError, match="alternate"):
        gemma3_tokenizer.chat_template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_content_parts_are_joined():
    template = ChatTemplate.builtin("chatml")
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}
    ]
    assert template.render(parts) == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


def test_helpers_are_available():
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ bos_token }}{% if add_generation_prompt %}!{% endif %}"
        "{% generation %}g{% endgeneration %}{{ extra }}"
    )
    out = ChatTemplate(source, bos_token="<s>").render([{"role": "user", "content": "<é>"}, {"role": "x"}], extra="E")
    assert out == '{"role": "user", "content": "<é>"}4<s>!gE'


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ (messages | attr('__class__')) }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ 'a' * 100000000 }}",
    "{{ 7 ** 100000000 }}",
    "{% for i in range(10**9) %}{% endfor %}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_fail_with_one_line(source):
    with pytest.raises(TokenizerError) as info:
        ChatTemplate(source, name="evil.jinja").render(CONVERSATIONS[0])
    message = str(info.value)
    assert message.startswith("evil.jinja: ") and "\n" not in message


def test_template_from_file_is_sandboxed(tmp_path):
    good = tmp_path / "chat.jinja"
    good.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert ChatTemplate.from_file(good).render(CONVERSATIONS[0]) == "[user] Hi there\n"
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"chat_template": "{{ messages[0].content }}"}')
    assert ChatTemplate.from_file(config).render(CONVERSATIONS[0]) == "Hi there"
    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match=str(evil)):
        ChatTemplate.from_file(evil).render(CONVERSATIONS[0])


@pytest.mark.parametrize(
    "source, reason",
    [
        ("{% if %}", "syntax error at line 1"),
        ("{{ undefined_name.x }}", "rendering failed"),
        ("{{ raise_exception('no tools') }}", "rejected the messages: no tools"),
    ],
)
def test_broken_templates_fail_with_one_line(source, reason):
    with pytest.raises(TokenizerError) as info:
        ChatTemplate(source, name="t.jinja").render(CONVERSATIONS[0])
    assert str(info.value).startswith("t.jinja: ") and reason in str(info.value) and "\n" not in str(info.value)
