"""The tokenizer a GGUF file describes, encoding and decoding exactly as llama.cpp's llama-vocab.cpp.

Encoding: the text is first cut on special tokens (user-defined ones always, control ones only with
`parse_special`), longest token first; each remaining fragment goes to byte-level BPE or to
SentencePiece. Which tokens count as control, and which end generation, follows llama.cpp's
load-time rules, including the ones keyed on token text rather than metadata.
"""

from __future__ import annotations

import codecs
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from juno_py.errors import TokenizerError, show
from juno_py.tokenizer import pretokenize
from juno_py.tokenizer.bpe import ByteLevelBPE
from juno_py.tokenizer.spm import SentencePieceBPE

# GGUF token types (tokenizer.ggml.token_type) and llama.cpp's token attributes.
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6
UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = (1 << i for i in range(6))
LSTRIP, RSTRIP = 1 << 7, 1 << 8
_TYPE_ATTR = {
    TYPE_NORMAL: NORMAL,
    TYPE_UNKNOWN: UNKNOWN,
    TYPE_CONTROL: CONTROL,
    TYPE_USER_DEFINED: USER_DEFINED,
    TYPE_UNUSED: UNUSED,
    TYPE_BYTE: BYTE,
}


@dataclass(frozen=True)
class _Pre:
    """llama.cpp's settings for one `tokenizer.ggml.pre` value of a BPE vocabulary."""

    regexes: str  # key of pretokenize.REGEXES
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


def _pre_table() -> dict[str, _Pre]:
    groups = [
        (("default",), _Pre("default")),
        (
            ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
            _Pre("llama3", ignore_merges=True, add_bos=True),
        ),
        (("dbrx", "smaug-bpe"), _Pre("llama3")),
        (
            (
                "gpt-2",
                "phi-2",
                "jina-es",
                "jina-de",
                "gigachat",
                "jina-v2-es",
                "jina-v2-de",
                "a.x-4.0",
                "mellum",
                "modern-bert",
                "mpt",
                "olmo",
                "jais",
                "exaone4",
            ),
            _Pre("gpt2"),
        ),
        (("trillion", "granite-docling"), _Pre("gpt2", clean_spaces=False)),
        (("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), _Pre("starcoder")),
        (("smollm", "command-r"), _Pre("starcoder", clean_spaces=False)),
        (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"), _Pre("qwen2", clean_spaces=False)),
        (("stablelm2", "megrez"), _Pre("qwen2")),
    ]
    return {name: pre for names, pre in groups for name in names}


PRE_TOKENIZERS = _pre_table()

# Tokens llama.cpp recognises by text when the metadata does not name them; each becomes CONTROL.
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_TEXT_ROLES = {
    "eot": _EOT_TEXTS,
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts that end generation wherever they sit in the vocabulary (llama.cpp's special_eog_ids).
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)

_ID_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "eot": "eot_token_id",
    "eom": "eom_token_id",
    "unk": "unknown_token_id",
    "sep": "seperator_token_id",
    "pad": "padding_token_id",
    "mask": "mask_token_id",
    "fim_pre": "fim_pre_token_id",
    "fim_suf": "fim_suf_token_id",
    "fim_mid": "fim_mid_token_id",
    "fim_pad": "fim_pad_token_id",
    "fim_rep": "fim_rep_token_id",
    "fim_sep": "fim_sep_token_id",
}
_DEPRECATED_ID_KEYS = {"fim_pre": "prefix_token_id", "fim_suf": "suffix_token_id", "fim_mid": "middle_token_id"}
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}

_C_SPACES = " \t\n\v\f\r"  # C isspace() in the "C" locale
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Encode/decode for one GGUF vocabulary ("gpt2" byte-level BPE or "llama" SentencePiece)."""

    def __init__(self, metadata: dict, source: str = "<metadata>", architecture: str | None = None):
        self.source = source
        self.metadata = metadata
        self.architecture = architecture or metadata.get("general.architecture")
        self.model = metadata.get("tokenizer.ggml.model")
        if self.model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"{source}: tokenizer.ggml.model {show(self.model)} is not supported (expected 'gpt2' or 'llama')"
            )
        self._read_vocabulary()
        pre = self._read_flags()
        ids = self._read_special_ids()
        self._find_roles_by_text(ids)
        self.eog_ids = frozenset(self._end_of_generation(ids))
        self.special_ids = ids
        self.bos_id, self.eos_id, self.eot_id, self.eom_id = ids["bos"], ids["eos"], ids["eot"], ids["eom"]
        self.unk_id, self.pad_id = ids["unk"], ids["pad"]
        self._set_strip_attrs()
        # llama.cpp's cache_special_tokens: longest text first
        n = len(self.tokens)
        self._special = sorted(
            (i for i in range(n) if self._attrs[i] & (CONTROL | USER_DEFINED | UNKNOWN)),
            key=lambda i: -len(self._bytes(self.tokens[i])),
        )
        self._special_rank = {i: rank for rank, i in enumerate(self._special)}
        self._special_any = _literal_finder([self.tokens[i] for i in self._special])
        self._special_user = _literal_finder(
            [self.tokens[i] for i in self._special if not self._attrs[i] & (CONTROL | UNKNOWN)]
        )
        if self.model == "gpt2":
            merges = metadata.get("tokenizer.ggml.merges")
            if not isinstance(merges, list):
                raise TokenizerError(f"{source}: tokenizer.ggml.merges is missing")
            self._backend = ByteLevelBPE(self.tokens, merges, pretokenize.REGEXES[pre.regexes], pre.ignore_merges)
        else:
            scores = metadata.get("tokenizer.ggml.scores") or [0.0] * n
            if len(scores) < n:
                raise TokenizerError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            unk = ids["unk"] if ids["unk"] is not None else 0
            self._backend = SentencePieceBPE(self.tokens, scores[:n], self._types, unk, source)
        self._piece_cache: dict[int, bytes] = {}
        self._chat_template = None

    @classmethod
    def from_gguf(cls, gguf_file) -> "Tokenizer":
        """From a `GGUFFile` or a path to one."""
        if isinstance(gguf_file, (str, Path)):
            from juno_py.gguf import GGUFFile

            gguf_file = GGUFFile(gguf_file)
        return cls(gguf_file.metadata, source=str(gguf_file.path), architecture=gguf_file.architecture)

    def _meta(self, prefix: str, name: str):
        return self.metadata.get(prefix + name)

    @staticmethod
    def _bytes(text: str) -> bytes:
        return text.encode("utf-8", "surrogateescape")

    def _read_vocabulary(self) -> None:
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError(f"{self.source}: tokenizer.ggml.tokens is missing or empty")
        n = len(tokens)
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names them
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        if len(self._ids) != n:
            dup = next(t for i, t in enumerate(self.tokens) if self._ids[t] != i)
            raise TokenizerError(f"{self.source}: duplicate token {show(dup)} in tokenizer.ggml.tokens")
        types = self.metadata.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise TokenizerError(f"{self.source}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self._types = list(types[:n]) if types is not None else [TYPE_NORMAL] * n
        self._attrs = [_TYPE_ATTR.get(t, 0) for t in self._types]

    def _read_flags(self) -> _Pre | None:
        """add_bos / add_eos / add_space_prefix / clean_spaces: llama.cpp's defaults, then the metadata."""
        meta = functools.partial(self._meta, "tokenizer.ggml.")
        pre = None
        if self.model == "gpt2":
            self.pre = meta("pre") or "default"  # llama.cpp warns and uses 'default' when it is missing
            pre = PRE_TOKENIZERS.get(self.pre)
            if pre is None:
                raise TokenizerError(
                    f"{self.source}: unknown pre-tokenizer tokenizer.ggml.pre = {show(self.pre)} "
                    f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            self.add_space_prefix, self.add_bos, self.clean_spaces = False, pre.add_bos, pre.clean_spaces
        else:
            self.pre = "default"
            self.add_space_prefix, self.add_bos, self.clean_spaces = True, True, False
        self.add_eos = False
        for flag, name in (
            ("add_space_prefix", "add_space_prefix"),
            ("add_bos", "add_bos_token"),
            ("add_eos", "add_eos_token"),
        ):
            if meta(name) is not None:
                setattr(self, flag, bool(meta(name)))
        return pre

    def _read_special_ids(self) -> dict:
        """BOS, EOS, EOT, ... ids: llama.cpp's defaults per vocabulary type, overridden by in-range metadata."""
        n = len(self.tokens)
        ids = {role: None for role in _ID_KEYS}
        for role, default in _DEFAULT_IDS[self.model].items():
            ids[role] = default if default < n else None
        for role, name in [*_ID_KEYS.items(), *_DEPRECATED_ID_KEYS.items()]:
            value = self._meta("tokenizer.ggml.", name)
            if isinstance(value, int) and 0 <= value < n:
                ids[role] = value
        for flag, role in (("add_bos", "bos"), ("add_eos", "eos")):
            if getattr(self, flag) and ids[role] is None:
                raise TokenizerError(
                    f"{self.source}: tokenizer.ggml.{flag}_token is true but tokenizer.ggml.{role}_token_id is not set"
                )
        return ids

    # -- load-time rules -------------------------------------------------------------------------

    def _find_roles_by_text(self, ids: dict) -> None:
        """EOT, EOM and FIM tokens named by text when the metadata has no id; they become CONTROL."""
        for role, texts in _TEXT_ROLES.items():
            if ids[role] is not None:
                continue
            for text in texts:  # llama.cpp takes the first hit of a hash-map walk; we take list order
                i = self._ids.get(text)
                if i is not None:
                    ids[role] = i
                    self._attrs[i] |= CONTROL
                    break
        for i, text in enumerate(self.tokens):
            if self._attrs[i] & CONTROL and "unused" in text:
                self._attrs[i] |= UNUSED

    def _end_of_generation(self, ids: dict) -> set[int]:
        eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids[r] is not None}
        for text in EOG_TEXTS:
            i = self._ids.get(text)
            if i is not None:
                eog.add(i)
                self._attrs[i] |= CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            if text in self._ids:
                self._attrs[self._ids[text]] = USER_DEFINED
        eog |= {ids[r] for r in ("eos", "eot", "eom") if ids[r] is not None}
        texts = {self.tokens[i] for i in eog}
        end = self._ids.get("<|end|>")
        if end in eog and (({"<|return|>", "<|call|>"} <= texts) or ({"<|calls|>", "<|flush|>"} <= texts)):
            eog.discard(end)  # harmony / solar-open: <|end|> closes a message, not the generation
            self._attrs[end] = USER_DEFINED
        s = self._ids.get("</s>")
        if s in eog and "<|tool_response>" in texts:
            eog.discard(s)
            self._attrs[s] = NORMAL
        return eog

    def _set_strip_attrs(self) -> None:
        name = str(self.metadata.get("general.name", "")).lower()
        arch = str(self.metadata.get("general.architecture", ""))
        specials = [i for i in range(len(self.tokens)) if self._attrs[i] & (CONTROL | USER_DEFINED | UNKNOWN)]
        pre = str(self.metadata.get("tokenizer.ggml.pre", ""))
        if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or arch in (
            "nomic-bert-moe",
            "jina-bert-v3",
        ):
            if "<mask>" in self._ids:
                self._attrs[self._ids["<mask>"]] |= LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in specials:
                self._attrs[i] |= RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._ids:
                    i = self._ids[text]
                    self._attrs[i] = self._attrs[i] | RSTRIP if on else self._attrs[i] & ~RSTRIP
        elif "modern-bert" in name and "[MASK]" in self._ids:
            self._attrs[self._ids["[MASK]"]] |= LSTRIP

    # -- encode ----------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list:
        """Fragments of `text`: token ids for special tokens, (start, end) spans for the rest."""
        finder = self._special_any if parse_special else self._special_user
        present = finder(text)
        fragments: list = [(0, len(text))]
        for i in sorted((self._ids[t] for t in present), key=self._special_rank.__getitem__):
            tok, attr = self.tokens[i], self._attrs[i]
            out: list = []
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    continue
                base, end = frag
                while (m := text.find(tok, base, end)) >= 0:
                    left = m
                    if attr & LSTRIP:
                        while left > base and text[left - 1] in _C_SPACES:
                            left -= 1
                    if left > base:
                        out.append((base, left))
                    out.append(i)
                    base = m + len(tok)
                    if attr & RSTRIP:
                        while base < end and text[base] in _C_SPACES:
                            base += 1
                if base < end:
                    out.append((base, end))
            fragments = out
        return fragments

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; `add_special` adds BOS/EOS as the file says, `parse_special` reads
        control-token texts such as "<|im_start|>" as those tokens."""
        fragments = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if self.model == "llama":
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                piece = text[frag[0] : frag[1]]
                if self.add_space_prefix and prev_special:
                    piece = " " + piece
                out.extend(self._backend.encode(piece.replace(" ", "\u2581")))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._backend.encode(text[frag[0] : frag[1]]))
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # -- decode ----------------------------------------------------------------------------------

    def _piece(self, token_id: int) -> bytes:
        """llama.cpp's token_to_piece with special=True (its cache)."""
        piece = self._piece_cache.get(token_id)
        if piece is not None:
            return piece
        text, attr = self.tokens[token_id], self._attrs[token_id]
        if attr & (UNKNOWN | CONTROL | USER_DEFINED):
            piece = self._bytes(text)
        elif attr & NORMAL:
            piece = self._bytes(text.replace("\u2581", " ")) if self.model == "llama" else _gpt2_decode(text)
        elif attr & BYTE and (m := _BYTE_TOKEN.fullmatch(text)):
            piece = bytes([int(m.group(1), 16)])
        else:
            piece = b""
        self._piece_cache[token_id] = piece
        return piece

    def token_to_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes one token stands for (possibly part of a UTF-8 character). Control and unknown
        tokens give b"" unless `special`."""
        if not 0 <= token_id < len(self.tokens):
            raise TokenizerError(f"{self.source}: token id {token_id} is outside the vocabulary of {len(self.tokens)}")
        if not special and self._attrs[token_id] & (UNKNOWN | CONTROL):
            return b""
        return self._piece(token_id)

    def detokenize(self, ids, remove_special: bool = False, unparse_special: bool = False) -> bytes:
        """llama.cpp's llama_detokenize, byte for byte."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for i in ids:
            piece = self.token_to_bytes(i, unparse_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        text = b"".join(parts)
        return _clean_spaces(text) if self.clean_spaces else text

    def decode(self, ids, special: bool = False) -> str:
        """Text of `ids` as llama.cpp detokenizes it; control tokens are dropped unless `special`.
        Bytes that are not UTF-8 become U+FFFD."""
        return self.detokenize(ids, unparse_special=special).decode("utf-8", "replace")

    def stream(self, special: bool = False) -> "StreamDecoder":
        """A decoder for generated tokens that emits only whole UTF-8 characters."""
        return StreamDecoder(self, special)

    # -- facts -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, text: str) -> int | None:
        return self._ids.get(text)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[token_id] & CONTROL)

    @property
    def chat_template(self):
        """The file's chat template, or the built-in one for its architecture."""
        if self._chat_template is None:
            from juno_py.tokenizer.chat import ChatTemplate

            self._chat_template = ChatTemplate.for_tokenizer(self)
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template) -> None:
        self._chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **extra) -> list[int]:
        """Render `messages` and tokenize the prompt as the template means it: special tokens parsed,
        no BOS added (templates that want one write it themselves)."""
        prompt = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(prompt, add_special=False, parse_special=True)

    def __repr__(self) -> str:
        return f"Tokenizer({self.model}/{self.pre}, {self.vocab_size} tokens, from {self.source})"


class StreamDecoder:
    """Feeds token ids one at a time and returns the text they complete (no partial characters).

    Pieces are joined as they are, without detokenize()'s leading-space strip or space cleanup."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_to_bytes(token_id, self.special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _gpt2_decode(text: str) -> bytes:
    """llama.cpp's llama_decode_text: GPT-2's byte alphabet back to bytes."""
    out = bytearray()
    for ch in text:
        b = pretokenize.UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += (
                b"[UNK_BYTE_0x"
                + ch.encode("utf-8", "surrogateescape").hex().encode()
                + text.encode("utf-8", "surrogateescape")
                + b"]"
            )
    return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces: " ?" " !" " ." " ,", " ' ", " 's" " 'm" " 're" " 've"."""
    t = bytearray(text)
    out = bytearray(t[:1])
    for i in range(1, len(t)):
        if t[i - 1] == 0x20 and t[i] in b"?!.,":
            out.pop()
        out.append(t[i])
    t, out = out, bytearray(out[:1])
    i = 1
    while i < len(t):
        x = t[i]
        if x == 0x27 and i + 1 < len(t) and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()  # drop the space before, skip the one after (llama.cpp zeroes it)
            out.append(x)
            t[i + 1] = 0
            i += 2
            continue
        out.append(x)
        i += 1
    t, out = out, bytearray(out[:1])
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < len(t):
            x1 = t[i + 1]
            if x1 in b"sm" or (i + 2 < len(t) and bytes(t[i + 1 : i + 3]) in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return bytes(out)


def _literal_finder(words: list[str]):
    """A function giving the subset of `words` that occur in a text (at any position)."""
    if not words:
        return lambda text: frozenset()
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        alts = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    # longest word starting at every position; shorter words inside it are added from `inside`
    finder: list = []  # compiled on first use: a large vocabulary's pattern takes a while
    inside: dict[str, frozenset] = {}

    def find(text: str) -> frozenset:
        if not finder:
            finder.append(re.compile("(?=(" + pattern(trie) + "))"))
        longest = {m.group(1) for m in finder[0].finditer(text)}
        found = set()
        for w in longest:
            if w not in inside:
                inside[w] = frozenset(x for x in words if x in w)
            found |= inside[w]
        return frozenset(found)

    return find
