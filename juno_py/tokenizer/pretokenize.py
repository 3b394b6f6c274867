"""Pre-tokenization for byte-level BPE, as llama.cpp does it (`unicode_regex_split` in unicode.cpp).

A pre-tokenizer is a list of regexes applied in turn, each one splitting every piece the previous
ones left (a regex never sees past the end of its piece). Two regexes have hand-written matchers in
llama.cpp (GPT-2's and Llama 3's); every other one runs through ECMAScript `std::regex` on a
"collapsed" text where each non-ASCII code point is replaced by one stand-in byte per Unicode
category. We mirror both paths, because the collapse is what decides what `\\p{L}` matches.
"""

from __future__ import annotations

import functools
import re
import unicodedata

# -- code point classes (llama.cpp's unicode_cpt_flags) ----------------------------------------

NUMBER, LETTER, SEPARATOR, MARK, PUNCTUATION, SYMBOL, CONTROL, UNDEFINED = (1 << i for i in range(8))
WHITESPACE = 1 << 8

_CATEGORY_FLAG = {
    "N": NUMBER,
    "L": LETTER,
    "Z": SEPARATOR,
    "M": MARK,
    "P": PUNCTUATION,
    "S": SYMBOL,
    "Cc": CONTROL,
    "Cf": CONTROL,
    "Co": CONTROL,
    "Cs": CONTROL,
    "Cn": UNDEFINED,
}

# The Unicode White_Space property, which is llama.cpp's `unicode_set_whitespace`.
WHITESPACE_CPTS = frozenset(
    [
        0x09,
        0x0A,
        0x0B,
        0x0C,
        0x0D,
        0x20,
        0x85,
        0xA0,
        0x1680,
        *range(0x2000, 0x200B),
        0x2028,
        0x2029,
        0x202F,
        0x205F,
        0x3000,
    ]
)


@functools.lru_cache(maxsize=65536)
def char_flags(ch: str) -> int:
    """Category flag of one character, plus WHITESPACE; never 0 (0 means "past the piece")."""
    cat = unicodedata.category(ch)
    flags = _CATEGORY_FLAG.get(cat) or _CATEGORY_FLAG[cat[0]]
    if ord(ch) in WHITESPACE_CPTS:
        flags |= WHITESPACE
    return flags


# -- hand-written matchers ----------------------------------------------------------------------


def _flags_within(text: str, start: int, end: int):
    """char_flags of text[i], 0 outside [start, end): a matcher never looks past its piece."""
    return lambda i: char_flags(text[i]) if start <= i < end else 0


def _contraction(text: str, pos: int, end: int, fold_case: bool) -> int:
    """Length of 's 't 'm 'd (2) or 're 've 'll (3) at text[pos], else 0."""
    if text[pos] != "'" or pos + 1 >= end:
        return 0
    nxt = text[pos + 1 : min(pos + 3, end)]
    if fold_case:  # llama.cpp's unicode_tolower: only ASCII letters fold to these
        nxt = "".join(ch.lower() if ch.isascii() else ch for ch in nxt)
    if nxt[0] in "stmd":
        return 2
    return 3 if nxt in ("re", "ve", "ll") else 0


def _whitespace_end(text: str, pos: int, end: int, flags, newlines: bool) -> int:
    r"""End of the whitespace match at pos: \s*[\r\n]+ (if `newlines`), \s+(?!\S), \s+; pos + 1 if none."""
    n_ws = 0
    last_newline = 0
    while flags(pos + n_ws) & WHITESPACE:
        if newlines and text[pos + n_ws] in "\r\n":
            last_newline = pos + n_ws + 1
        n_ws += 1
    if last_newline:
        return last_newline
    if n_ws > 1 and pos + n_ws < end:  # leave the last space to the next word
        return pos + n_ws - 1
    return pos + max(n_ws, 1)


def _split_gpt2(text: str, start: int, end: int, out: list[int]) -> None:
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ on text[start:end]."""
    flags = _flags_within(text, start, end)
    pos = start
    while pos < end:
        at = pos
        c = text[pos]
        f2 = flags(pos + 1) if c == " " else flags(pos)
        if n := _contraction(text, pos, end, fold_case=False):
            pos += n
        elif f2 & (LETTER | NUMBER):
            cls = f2 & (LETTER | NUMBER)
            pos += c == " "
            while flags(pos) & cls:
                pos += 1
        elif f2 and not f2 & (WHITESPACE | LETTER | NUMBER):
            pos += c == " "
            while (g := flags(pos)) and not g & (WHITESPACE | LETTER | NUMBER):
                pos += 1
        else:
            pos = _whitespace_end(text, pos, end, flags, newlines=False)
        out.append(pos - at)


def _split_llama3(text: str, start: int, end: int, out: list[int]) -> None:
    """Llama 3's regex (see _LLAMA3 below) on text[start:end], case-insensitive contractions."""
    flags = _flags_within(text, start, end)
    pos = start
    while pos < end:
        at = pos
        c = text[pos]
        f = flags(pos)
        if n := _contraction(text, pos, end, fold_case=True):
            out.append(n)
            pos += n
            continue
        if not (c in "\r\n" or f & NUMBER) and (f & LETTER or flags(pos + 1) & LETTER):  # [^\r\n\p{L}\p{N}]?\p{L}+
            pos += 1
            while flags(pos) & LETTER:
                pos += 1
        elif f & NUMBER:  # \p{N}{1,3}
            while flags(pos) & NUMBER and pos - at < 3:
                pos += 1
        elif not (flags(pos + 1) if c == " " else f) & (WHITESPACE | LETTER | NUMBER):
            # ' ?[^\s\p{L}\p{N}]+[\r\n]*': llama.cpp tests the current character's flags here, which are
            # never 0, so a lone space at the end of the piece lands here too
            pos += c == " "
            while (g := flags(pos)) and not g & (WHITESPACE | LETTER | NUMBER):
                pos += 1
            while pos < end and text[pos] in "\r\n":
                pos += 1
        else:
            pos = _whitespace_end(text, pos, end, flags, newlines=True)
        out.append(pos - at)


# -- the std::regex path on collapsed text --------------------------------------------------------

# Stand-in characters per category, and the ASCII members of each category as llama.cpp lists them
# (its \p{S} omits '~': we keep that).
_COLLAPSE_CHAR = {NUMBER: "\xd1", LETTER: "\xd2", PUNCTUATION: "\xd3", MARK: "\xd4", SYMBOL: "\xd5"}
_UCAT = {
    r"\p{N}": (NUMBER, "0-9"),
    r"\p{L}": (LETTER, "A-Za-z"),
    r"\p{P}": (PUNCTUATION, r"!-#%-*,-/:-;?-@\[-\]_\{\}"),
    r"\p{M}": (MARK, ""),
    r"\p{S}": (SYMBOL, r"\$\+<->^`\|"),
    r"\p{Lu}": (LETTER, "A-Za-z"),
    r"\p{Ll}": (LETTER, "A-Za-z"),
    r"\p{Lt}": (LETTER, "A-Za-z"),
    r"\p{Lm}": (LETTER, "A-Za-z"),
    r"\p{Lo}": (LETTER, "A-Za-z"),
}
_UCAT_RE = re.compile(r"\\p\{[A-Za-z]{1,2}\}")


@functools.lru_cache(maxsize=65536)
def _collapse_char(ch: str) -> str:
    if ch < "\x80":
        return ch
    f = char_flags(ch)
    if f & WHITESPACE:
        return "\x0b"  # C++'s \s knows only ASCII spaces: llama.cpp passes the others as \v
    return _COLLAPSE_CHAR.get(f & 0xFF, "\xd0")


def _ascii_spaces(ch: str) -> str:
    return "\x0b" if ch >= "\x80" and ord(ch) in WHITESPACE_CPTS else ch


def _collapse_regex(expr: str) -> str:
    """Replace each \\p{X} by a class of its stand-in byte and its ASCII members, as llama.cpp does."""
    parts = []
    inside = False
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif inside and ch == "]" and expr[i - 1] != "\\":
            inside = False
        elif ch == "\\" and (m := _UCAT_RE.match(expr, i)) and m.group() in _UCAT:
            flag, ascii_members = _UCAT[m.group()]
            body = _COLLAPSE_CHAR[flag] + ascii_members
            parts.append(body if inside else f"[{body}]")
            i = m.end()
            continue
        parts.append(ch)
        i += 1
    return "".join(parts)


class _RegexSplitter:
    """One regex run like std::regex_iterator over each piece: unmatched gaps stay pieces too."""

    def __init__(self, expr: str):
        self.collapse = bool(_UCAT_RE.search(expr))
        # re.ASCII: C++'s \s is the six ASCII spaces; non-ASCII spaces were collapsed to \v.
        self.pattern = re.compile(_collapse_regex(expr) if self.collapse else expr, re.ASCII)

    def __call__(self, text: str, start: int, end: int, out: list[int]) -> None:
        at = start
        for m in self.pattern.finditer(text, start, end):
            if m.start() > at:
                out.append(m.start() - at)
            out.append(m.end() - m.start())
            at = m.end()
        if at < end:
            out.append(end - at)


# -- pre-tokenizers by tokenizer.ggml.pre ---------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

REGEXES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "starcoder": [r"\p{N}", _GPT2],
}


# llama.cpp runs these two through hand-written matchers (ported above as the reference); the regexes
# they implement, run on the collapsed text, give the same pieces (tests/tokenizer/test_pretokenize.py)
# about ten times faster.
HAND_WRITTEN = {_GPT2: _split_gpt2, _LLAMA3: _split_llama3}
_AS_REGEX = {_GPT2: _GPT2 + r"|\s+", _LLAMA3: _LLAMA3}


@functools.lru_cache(maxsize=None)
def _splitter(expr: str, reference: bool):
    if reference and expr in HAND_WRITTEN:
        return HAND_WRITTEN[expr]
    return _RegexSplitter(_AS_REGEX.get(expr, expr))


def split(text: str, regexes: list[str], reference: bool = False) -> list[str]:
    """The pieces of `text` after applying each regex to every piece left by the previous one
    (`reference`: through llama.cpp's hand-written matchers where it has them)."""
    lengths = [len(text)] if text else []
    for expr in regexes:
        fn = _splitter(expr, reference)
        if isinstance(fn, _RegexSplitter):
            subject = "".join(map(_collapse_char if fn.collapse else _ascii_spaces, text))
        else:
            subject = text
        out: list[int] = []
        at = 0
        for n in lengths:
            fn(subject, at, at + n, out)
            at += n
        lengths = out
    pieces = []
    at = 0
    for n in lengths:
        pieces.append(text[at : at + n])
        at += n
    return pieces


# -- GPT-2 byte <-> unicode map -------------------------------------------------------------------


def _byte_to_unicode() -> list[str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_UNICODE = _byte_to_unicode()
UNICODE_TO_BYTE = {u: b for b, u in enumerate(BYTE_TO_UNICODE)}


def byte_encode(word: str) -> str:
    """The word's UTF-8 bytes spelled in GPT-2's byte alphabet."""
    return "".join(map(BYTE_TO_UNICODE.__getitem__, word.encode("utf-8", "surrogatepass")))
