"""Chat templates: the file's `tokenizer.chat_template` (or a template file) rendered in a jinja2 sandbox,
with the globals Hugging Face's `apply_chat_template` provides, and a built-in template per architecture
for files that carry none.

A template is untrusted code. It runs in `ImmutableSandboxedEnvironment`; on top of that, reaching
for any unsafe attribute fails at once (jinja2 would otherwise render it as an empty string), and every
way to spend memory or time is bounded: `range` sizes, loop iterations, integer sizes, the length of any
string or list an operation builds (`*`, `%`, `~`, `+`, widths of `center`/`ljust`/`rjust`/`zfill`/`format`,
`join`, `replace`, `indent`, ...), the total work and a wall-clock deadline. The checks run in the filters
too, so they also hold while jinja2 folds constants at compile time. Every failure is one `TokenizerError`
line naming the template.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
import time
from pathlib import Path
from types import BuiltinMethodType, MethodType

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from juno_py.errors import TokenizerError, one_line

MAX_REPEAT = 1_000_000  # longest string or list `*`, a width or a padding may build
MAX_EXPONENT = 256
MAX_INT_BITS = 1 << 16  # largest integer `*` and `**` may build
MAX_RANGE = 100_000  # items of one range()
MAX_ITERATIONS = 50_000  # loop iterations (all loops together) in one render
MAX_VALUE = 16_000_000  # characters or items of any one value an operation builds
MAX_WORK = 256_000_000  # characters or items all checked operations of one render build together
MAX_SECONDS = 1.0  # wall clock for one render (or one compile)
MAX_OUTPUT = 16_000_000  # characters a rendered prompt may have
_MAX_INDENT = 100  # tojson indentation


class _Budget:
    """What one render (or compile) may still spend; checked by every bounded operation."""

    def __init__(self):
        self.deadline = time.monotonic() + MAX_SECONDS
        self.iterations = 0
        self.work = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template ran longer than {MAX_SECONDS} s")

    def iterate(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_ITERATIONS:
            raise SecurityError(f"the template's loops ran more than {MAX_ITERATIONS} iterations")
        if not self.iterations & 63:
            self.tick()

    def built(self, size: int) -> None:
        if size > MAX_VALUE:
            raise SecurityError(f"an operation would build a value of {size} items (at most {MAX_VALUE})")
        self.work += size
        if self.work > MAX_WORK:
            raise SecurityError(f"the template built more than {MAX_WORK} characters or items in all")


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _budget() -> _Budget:
    b = _BUDGET.get(None)
    if b is None:
        b = _Budget()
        _BUDGET.set(b)
    return b


def _sized(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else None


def _checked(value):
    """`value` after counting what building it cost; refused when too large."""
    n = _sized(value)
    if n is not None:
        _budget().built(n)
    return value


def _text_size(value, limit: int = MAX_VALUE) -> int:
    """About how many characters str(value) has, found without building it (nested lists may share
    items, so str() of a small-looking value can be huge: shared parts are sized once); refused past `limit`."""
    memo: dict[int, int] = {}

    def size(v, depth: int) -> int:
        if isinstance(v, (str, bytes)):
            return len(v) + 2
        if not isinstance(v, (list, tuple, dict, set, frozenset)):
            return 24
        known = memo.get(id(v))
        if known is not None:
            return known
        if depth > 100:
            raise SecurityError("a value nested more than 100 levels deep")
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
        total = 2 + 2 * len(items)
        for x in items:
            total += size(x, depth + 1)
            if total > limit:
                raise SecurityError(f"converting a value to text would build more than {limit} characters")
        memo[id(v)] = total
        return total

    return size(value, 0)


def _width(value, what: str) -> None:
    if isinstance(value, int) and abs(value) > MAX_REPEAT:
        raise SecurityError(f"{what} {value} is larger than {MAX_REPEAT}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _percent_format(fmt, args) -> None:
    """`fmt % args` may pad to any width a spec names: every width and precision must be small."""
    if not isinstance(fmt, str):
        return
    total = _text_size(args) + len(fmt)
    for spec in _PERCENT_SPEC.finditer(fmt):
        for part in spec.groups():
            if part == "*":
                for a in args if isinstance(args, tuple) else (args,):
                    _width(a, "a '*' width")
                    total += abs(a) if isinstance(a, int) else 0
            elif part:
                _width(int(part), "a '%' width")
                total += int(part)
    _budget().built(total)


class _BoundedFormatter(SandboxedFormatter):
    """str.format with every width and precision in a format spec bounded."""

    built = 0  # characters of the string being formatted so far

    def format_field(self, value, format_spec):
        for digits in re.findall(r"\d+", format_spec):
            _width(int(digits), "a format width")
        _text_size(value)
        out = _checked(super().format_field(value, format_spec))
        self.built += len(out)
        if self.built > MAX_VALUE:
            raise SecurityError(f"str.format would build more than {MAX_VALUE} characters")
        return out


# pre-checks of the filters that can build much more than they are given: (value, *args, **kwargs) as called
def _pre_center(value, width=80):
    _width(width, "center width")


def _pre_format(value, *args, **kwargs):
    _percent_format(value, kwargs or args)


def _pre_indent(s, width=4, first=False, blank=False):
    _width(width, "indent width")
    if isinstance(s, str) and isinstance(width, (int, str)):
        _budget().built(len(s) + (width if isinstance(width, int) else len(width)) * (s.count("\n") + 1))


def _pre_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    if isinstance(s, str) and isinstance(width, int):
        _budget().built(len(s) + len(s) // max(width, 1) * len(wrapstring or "\n"))


def _pre_batch(value, linecount, fill_with=None):
    _width(linecount, "batch size")


def _pre_slice(value, slices, fill_with=None):
    _width(slices, "slice count")


def _pre_join(value, d="", attribute=None):
    if hasattr(value, "__len__"):
        _budget().built((len(d) if isinstance(d, str) else _text_size(d)) * len(value))
    if isinstance(value, (list, tuple)):
        _text_size(value)


def _pre_replace(s, old, new, count=None):
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = len(s) + 1 if old == "" else s.count(old)
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        _budget().built(len(s) + hits * max(len(new) - len(old), 0))


def _pre_text(value, *args, **kwargs):
    _text_size(value)


_FILTER_CHECKS = {
    "center": _pre_center,
    "format": _pre_format,
    "indent": _pre_indent,
    "wordwrap": _pre_wordwrap,
    "batch": _pre_batch,
    "slice": _pre_slice,
    "join": _pre_join,
    "replace": _pre_replace,
    "string": _pre_text,
    "pprint": _pre_text,
    "tojson": _pre_text,
    "list": _pre_text,
}


def _guard_filter(f, pre=None):
    skip = 1 if _PassArg.from_obj(f) is not None else 0

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        _budget().tick()
        if pre is not None:
            pre(*args[skip:], **kwargs)
        return _checked(f(*args, **kwargs))

    return guarded


def _loop(iterable):
    """What a `{% for %}` iterates: the same items, each one counted against the budget."""
    return _CountedLoop(iterable)


class _CountedLoop:
    def __init__(self, iterable):
        self.iterable = iterable

    def __len__(self):
        return len(self.iterable)

    def __iter__(self):
        budget = _budget()
        for item in self.iterable:
            budget.iterate()
            yield item


def _concat(first, *rest):
    """`a ~ b ~ ...` (jinja2's str_join) with the size of the result checked before it is built."""
    parts = (first,) + rest
    size = sum(len(p) if isinstance(p, str) else _text_size(p) for p in parts)
    _budget().built(size)
    return "".join(map(str, parts))


def _range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise SecurityError(f"range() of {len(r)} items (at most {MAX_RANGE})")
    return r


class _BoundLoopsAndConcat(NodeTransformer):
    """Every loop iterates through `_loop`, every `~` goes through `_concat`."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "juno_loop", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        node = self.generic_visit(node)
        return nodes.Filter(node.nodes[0], "juno_concat", list(node.nodes[1:]), [], None, None, lineno=node.lineno)


def _content(name: str) -> str:
    """Jinja for the text of message[name]: a string, or the text parts of a list of parts."""
    return (
        f"(message['{name}'] if message['{name}'] is string else "
        f"message['{name}'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(''))"
    )


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
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + ("
        + _TEXT
        + ") | trim + '<|eot_id|>' }}"
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
    "qwen2": "chatml",
    "qwen3": "chatml",
    "qwen2moe": "chatml",
    "qwen3moe": "chatml",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
}


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers: no HTML escaping (jinja2's own tojson escapes <, >, & and ')
    if (isinstance(indent, int) and abs(indent) > _MAX_INDENT) or (
        isinstance(indent, str) and len(indent) > _MAX_INDENT
    ):
        raise SecurityError(f"tojson indent larger than {_MAX_INDENT}")
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
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source, name, filename):
        tree = _BoundLoopsAndConcat().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context, operator, left, right):
        _budget().tick()
        if operator == "**" and isinstance(right, (int, float)):
            if abs(right) > MAX_EXPONENT:
                raise SecurityError(f"exponent {right} is larger than {MAX_EXPONENT}")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS:
                raise SecurityError(f"'**' would build an integer of more than {MAX_INT_BITS} bits")
        if operator == "*":
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() + right.bit_length() > MAX_INT_BITS
            ):
                raise SecurityError(f"'*' would build an integer of more than {MAX_INT_BITS} bits")
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise SecurityError(f"'*' would build a value of {len(seq) * n} items (at most {MAX_REPEAT})")
        if operator == "+" and _sized(left) is not None and _sized(right) is not None:
            _budget().built(len(left) + len(right))
        if operator == "%":
            _percent_format(left, right)
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
        _budget().tick()
        if isinstance(__obj, (MethodType, BuiltinMethodType)) and isinstance(getattr(__obj, "__self__", None), str):
            text, method = __obj.__self__, __obj.__name__
            if method in ("center", "ljust", "rjust", "zfill") and args:
                _width(args[0], f"{method} width")
            elif method == "expandtabs":
                _width((args[0] if args else kwargs.get("tabsize", 8)) * max(text.count("\t"), 1), "expandtabs width")
            elif method == "join" and args:
                items = args[0] if isinstance(args[0], (list, tuple, str)) else list(_CountedLoop(args[0]))
                _budget().built(len(text) * len(items) + _text_size(items))
                args = (items,) + args[1:]
            elif method == "replace" and len(args) >= 2:
                _pre_replace(text, *args[:3])
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        if (
            not isinstance(value, (MethodType, BuiltinMethodType))
            or value.__name__ not in ("format", "format_map")
            or not isinstance(value.__self__, str)
            or isinstance(value.__self__, Markup)
        ):
            return super().wrap_str_format(value)
        text, is_map, formatter = value.__self__, value.__name__ == "format_map", _BoundedFormatter(self)

        def wrapper(*args, **kwargs):
            _budget().tick()
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            formatter.built = 0
            return _checked(type(text)(formatter.vformat(text, args, kwargs)))

        return functools.update_wrapper(wrapper, value)


def _finalize(value):
    """Every `{{ ... }}` value before it becomes text: its text size checked first."""
    if not isinstance(value, str):
        _text_size(value)
    return value


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag], finalize=_finalize)
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _guard_filter(f, _FILTER_CHECKS.get(name))
    env.filters["juno_loop"] = _loop
    env.filters["juno_concat"] = _concat
    env.globals.pop("lipsum", None)  # lipsum(n) loops n times inside one call
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, range=_range)
    return env


def _one_line(text) -> str:
    return " ".join(str(text)[:2000].split()) or "(no message)"


def _error(message: str) -> TokenizerError:
    return TokenizerError(one_line(message))


class ChatTemplate:
    """A compiled chat template. `name` says where it came from, in error messages."""

    def __init__(self, source: str, name: str = "chat template", bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str):
            raise TokenizerError(f"{name}: a chat template must be text, not {type(source).__name__}")
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        budget = _BUDGET.set(_Budget())  # constant folding runs the filters at compile time: bounded as well
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as e:
            raise _error(f"{name}: template syntax error at line {e.lineno}: {_one_line(e.message)}") from None
        except Exception as e:  # noqa: BLE001 - anything the compiler raises is the template's fault
            raise _error(f"{name}: template does not compile: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _BUDGET.reset(budget)

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
                raise TokenizerError(f'{path}: no "chat_template" string in this JSON file ({_one_line(e)})') from None
        return cls(text, name=str(path), bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def builtin(cls, key: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        if key not in BUILTIN_TEMPLATES:
            raise TokenizerError(f"no built-in chat template {key!r} (known: {', '.join(sorted(BUILTIN_TEMPLATES))})")
        return cls(
            BUILTIN_TEMPLATES[key], name=f"built-in {key!r} chat template", bos_token=bos_token, eos_token=eos_token
        )

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
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        budget = _BUDGET.set(_Budget())
        try:
            out, size = [], 0
            for chunk in self._template.generate(**context):
                size += len(chunk)
                if size > MAX_OUTPUT:
                    raise SecurityError(f"the rendered prompt exceeds {MAX_OUTPUT} characters")
                out.append(chunk)
            return "".join(out)
        except _TemplateRaised as e:
            raise _error(f"{self.name}: the template rejected the messages: {_one_line(e)}") from None
        except SecurityError as e:
            raise _error(f"{self.name}: unsafe template: {_one_line(e)}") from None
        except TemplateError as e:
            raise _error(f"{self.name}: rendering failed: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - an untrusted template may fail in any way
            raise _error(f"{self.name}: rendering failed: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _BUDGET.reset(budget)

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
