"""Chat-template attacks on memory and time: each one ends fast, in one TokenizerError line."""

import time
import tracemalloc

import pytest

from juno_py.errors import MAX_MESSAGE, TokenizerError
from juno_py.tokenizer import chat
from juno_py.tokenizer.chat import ChatTemplate

MESSAGES = [{"role": "user", "content": "Hi"}]

ATTACKS = {
    "nested loops that print nothing": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "many short loops": "{% for a in range(100000) %}{% for b in range(3) %}{% endfor %}{% endfor %}",
    "range too big": "{% for a in range(10**9) %}{% endfor %}",
    "huge exponent": "{{ 2 ** 100000 }}",
    "power of a power": "{{ ((10 ** 200) ** 200) ** 200 }}",
    "repeated squaring": "{% set ns = namespace(x=10**100) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
    "center at compile time": "{{ 'x' | center(4000000000) }}",
    "format filter at compile time": "{{ '%4000000000s' | format('x') }}",
    "percent operator": "{{ '%4000000000s' % 'x' }}",
    "percent star width": "{{ '%*s' % (4000000000, 'x') }}",
    "many percent widths": "{{ ('%1000000s' * 20000) % ((1,) * 20000) }}",
    "str.format width": "{{ '{:>4000000000}'.format('x') }}",
    "str.format nested width": "{{ '{:>{w}}'.format('x', w=4000000000) }}",
    "str.format many fields": "{{ ('{0:1000000}' * 80000).format('x') }}",
    "ljust": "{{ 'x'.ljust(4000000000) }}",
    "rjust": "{{ 'x'.rjust(4000000000) }}",
    "zfill": "{{ '1'.zfill(4000000000) }}",
    "string multiplication": "{{ 'x' * 4000000000 }}",
    "list multiplication": "{{ [1] * 4000000000 }}",
    "indent": "{{ ('a\\n' * 500000) | indent(1000000) }}",
    "join separator": "{{ range(20000) | join('x' * 1000000) }}",
    "join with a list as separator": "{{ ('x' * 1000000) | join(range(20000) | list) }}",
    "str.join": "{{ ('x' * 1000000).join(range(20000) | map('string') | list) }}",
    "replace": "{{ ('x' * 1000000) | replace('', 'y' * 1000000) }}",
    "str.replace": "{{ ('x' * 1000000).replace('x', 'y' * 1000000) }}",
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling by +": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "shared nested lists printed": "{% set ns = namespace(a=[1]) %}{% for i in range(64) %}"
    "{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a }}",
    "shared nested lists to json": "{% set ns = namespace(a=[1]) %}{% for i in range(64) %}"
    "{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a | tojson }}",
    "tojson indent": "{{ [[[1]]] | tojson(indent=4000000000) }}",
    "batch fill": "{{ [1] | batch(4000000000, 0) | list }}",
    "lipsum": "{{ lipsum(1000000000) }}",
    "output flood": "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
}


@pytest.mark.parametrize("source", ATTACKS.values(), ids=ATTACKS.keys())
def test_attack_ends_fast_in_one_line(source):
    start = time.process_time()  # CPU time: the machine may be shared
    with pytest.raises(TokenizerError) as e:
        ChatTemplate(source, name="evil").render(MESSAGES)
    seconds = time.process_time() - start
    msg = str(e.value)
    assert msg.startswith("evil: ") and "\n" not in msg and len(msg) <= MAX_MESSAGE, msg
    assert seconds < 0.5, f"{seconds:.2f} s: {msg}"
    tracemalloc.start()  # memory in a second run: tracing slows Python down several times
    try:
        with pytest.raises(TokenizerError):
            ChatTemplate(source, name="evil").render(MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB: {msg}"


def test_deadline_stops_slow_work(monkeypatch):
    """Work inside every other bound (recursion that doubles, 2^22 calls printing nothing) meets the clock."""
    monkeypatch.setattr(chat, "MAX_SECONDS", 0.2)
    source = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(22) }}"
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match="ran longer than 0.2 s"):
        ChatTemplate(source, name="slow").render(MESSAGES)
    assert time.perf_counter() - start < 0.6


def test_bounds_leave_ordinary_templates_alone():
    source = (
        "{% for m in messages %}{{ '%-6s|' % m['role'] }}{{ '{:>4}'.format(loop.index) }}"
        "{{ m['content'] | center(10) }}{{ (m['content'] ~ '!') * 2 }}{{ 2 ** 10 }}{{ [1, 2] + [3] }}"
        "{{ ' '.join(['a', 'b']) }}{{ 'x'.ljust(3) }}|{{ loop.length }}{% endfor %}"
    )
    out = ChatTemplate(source).render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert out == (
        "user  |   1    Hi    Hi!Hi!1024[1, 2, 3]a bx  |2assistant|   2    Yo    Yo!Yo!1024[1, 2, 3]a bx  |2"
    )


def test_real_templates_render_as_unbounded_jinja(smollm2_tokenizer, gemma3_tokenizer):
    """The store models' templates give byte for byte what jinja2's plain sandbox gives."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    conversations = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi <b>"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye\n\n"},
        ],
        [{"role": "user", "content": "x" * 50_000}],
    ]
    for tok in (smollm2_tokenizer, gemma3_tokenizer):
        template = tok.chat_template
        plain = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        plain.globals.update(raise_exception=chat._raise_exception)
        plain.filters["tojson"] = chat._tojson
        reference = plain.from_string(template.source)
        for messages in conversations:
            if template.name.startswith("built-in 'gemma'") and messages[0]["role"] == "system":
                pass  # gemma folds the system message into the first user turn: still the same text
            for gen in (True, False):
                expected = reference.render(
                    messages=messages,
                    add_generation_prompt=gen,
                    bos_token=template.bos_token,
                    eos_token=template.eos_token,
                )
                assert template.render(messages, add_generation_prompt=gen) == expected
