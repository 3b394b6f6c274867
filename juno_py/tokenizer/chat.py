"""Chat templates: the file's `tokenizer.chat_template` (or a template file) rendered in a jinja2 sandbox,
with the globals Hugging Face's `apply_chat_template` provides, and a built-in template per architecture
for files that carry none.

A template is untrusted code. It runs in `ImmutableSandboxedEnvironment`; on top of that, reaching
for any unsafe attribute fails at once (jinja2 would otherwise render it as an empty string), and
`*`/`**` cannot build huge values. Every failure is one `TokenizerError` line naming the template.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from juno_py.errors import TokenizerError

MAX_REPEAT = 1_000_000  # longest string or list `*` may build
MAX_EXPONENT = 256
MAX_OUTPUT = 16_000_000  # characters a rendered prompt may have


def _content(name: str) -> str:
    """Jinja for the text of message[name]: a string, or the text parts of a list of parts."""
    return (f"(message['{name}'] if message['{name}'] is string else "
            f"message['{name}'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(''))")


_TEXT = _content("content")

BUILTIN_TEMPLATES = {
    "chatml": (
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + " + _TEXT + " + '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    ),
    "llama3": (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (" + _TEXT + ") | trim + '<|eot_id|>' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
    ),
    "phi3": (
        "{%- for message in messages -%}"
        "{{ '<|' + message['role'] + '|>\\n' + " + _TEXT + " + '<|end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- else -%}{{ eos_token }}{%- endif -%}"
    ),
    # Gemma has no system role: a system message is put in front of the first user turn.
    "gemma": (
        "{{- bos_token -}}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set message = messages[0] -%}{%- set prefix = (" + _TEXT + ") | trim + '\\n\\n' -%}"
        "{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for message in turns -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif -%}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
        " + (prefix if loop.first else '') + (" + _TEXT + ") | trim + '<end_of_turn>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
}

ARCHITECTURE_TEMPLATES = {
    "qwen2": "chatml", "qwen3": "chatml", "qwen2moe": "chatml", "qwen3moe": "chatml",
    "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma",
}


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers: no HTML escaping (jinja2's own tojson escapes <, >, & and ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise SecurityError(f"'*' would build a value of {len(seq) * n} items (at most {MAX_REPEAT})")
        return super().call_binop(context, operator, left, right)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "(no message)"


class ChatTemplate:
    """A compiled chat template. `name` says where it came from, in error messages."""

    def __init__(self, source: str, name: str = "chat template", bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str):
            raise TokenizerError(f"{name}: a chat template must be text, not {type(source).__name__}")
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as e:
            raise TokenizerError(f"{name}: template syntax error at line {e.lineno}: {_one_line(e.message)}") from None
        except Exception as e:  # noqa: BLE001 - anything the compiler raises is the template's fault
            raise TokenizerError(f"{name}: template does not compile: {type(e).__name__}: {_one_line(e)}") from None

    @classmethod
    def from_file(cls, path, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        """A template from a file (untrusted: same sandbox). A .json file may hold it under
        "chat_template" (as tokenizer_config.json does)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read chat template: {_one_line(e)}") from None
        if path.suffix == ".json":
            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError) as e:
                raise TokenizerError(f"{path}: no \"chat_template\" string in this JSON file ({_one_line(e)})") from None
        return cls(text, name=str(path), bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def builtin(cls, key: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        if key not in BUILTIN_TEMPLATES:
            raise TokenizerError(f"no built-in chat template {key!r} (known: {', '.join(sorted(BUILTIN_TEMPLATES))})")
        return cls(BUILTIN_TEMPLATES[key], name=f"built-in {key!r} chat template", bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def for_tokenizer(cls, tokenizer, name: str | None = None) -> "ChatTemplate":
        """The template in the tokenizer's GGUF metadata (`tokenizer.chat_template`, or
        `tokenizer.chat_template.<name>`), else the built-in one for its architecture."""
        text = lambda i: tokenizer.tokens[i] if i is not None else ""  # noqa: E731
        bos, eos = text(tokenizer.bos_id), text(tokenizer.eos_id)
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        source = tokenizer.metadata.get(key)
        if source is not None:
            return cls(source, name=f"{tokenizer.source} ({key})", bos_token=bos, eos_token=eos)
        if name:
            raise TokenizerError(f"{tokenizer.source}: no chat template named {name!r} ({key} is missing)")
        return cls.builtin(builtin_key(tokenizer.architecture, tokenizer.token_id), bos, eos)

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for `messages` (dicts with "role" and "content"). Tokenize it with
        `parse_special=True` and without adding BOS: templates that want BOS write `bos_token`."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra,
                   "messages": list(messages), "add_generation_prompt": add_generation_prompt}
        try:
            out, size = [], 0
            for chunk in self._template.generate(**context):
                size += len(chunk)
                if size > MAX_OUTPUT:
                    raise SecurityError(f"the rendered prompt exceeds {MAX_OUTPUT} characters")
                out.append(chunk)
            return "".join(out)
        except _TemplateRaised as e:
            raise TokenizerError(f"{self.name}: the template rejected the messages: {_one_line(e)}") from None
        except SecurityError as e:
            raise TokenizerError(f"{self.name}: unsafe template: {_one_line(e)}") from None
        except TemplateError as e:
            raise TokenizerError(f"{self.name}: rendering failed: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - an untrusted template may fail in any way
            raise TokenizerError(f"{self.name}: rendering failed: {type(e).__name__}: {_one_line(e)}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name})"


def builtin_key(architecture: str | None, token_id) -> str:
    """Which built-in template suits a file of `architecture` whose vocabulary answers `token_id(text)`."""
    if architecture in ARCHITECTURE_TEMPLATES:
        return ARCHITECTURE_TEMPLATES[architecture]
    if token_id("<|start_header_id|>") is not None and token_id("<|eot_id|>") is not None:
        return "llama3"
    if architecture == "llama" or token_id("<|im_start|>") is not None:
        return "chatml"
    raise TokenizerError(f"no chat template in the file and no built-in one for architecture {architecture!r}")
