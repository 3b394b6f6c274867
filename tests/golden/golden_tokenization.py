"""Golden tokenization from llama.cpp (through llama-cpp-python): `make(out_dir)` writes
tokenization_smollm2.json, tokenization_gemma3.json and tokenization_variants.json.

Run through `python tests/golden/make_golden.py --only tokenization`. Module-level code uses the
standard library only: `golden_text()` and `SHORT_STRINGS` are what the files were made from (the
files also store them).

Each model file holds: the long text; llama.cpp's ids for it whole (BOS added as the file says) and
line by line (no BOS), with and without parse_special; its detokenization; the short strings with
their ids for every add_special x parse_special, detokenizations and per-token pieces (hex);
BOS/EOS/EOT and the end-of-generation ids. The variants file re-reads SmolLM2's and Gemma 3's
vocabularies with another `tokenizer.ggml.pre` (default, gpt-2, llama-bpe, qwen2) or with
`tokenizer.ggml.add_space_prefix` true, so the pre-tokenizers and the SentencePiece space prefix
that the two real files do not use are checked against llama.cpp too.
"""

from __future__ import annotations

import ctypes
import json
import random
import tempfile
from pathlib import Path

# -------------------------------------------------------------------------------------------- inputs

SPECIAL_TEXTS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<jupyter_code>",
    "<empty_output>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<unk>",
    "<mask>",
    "</s>",
    "<s>",
    "<unused0>",
    "<unused42>",
    "<start_of_image>",
    "<end_of_image>",
    "[multimodal]",
    "<table>",
    "</td>",
    "<h1>",
    "<blockquote>",
    "<|eot_id|>",
    "<|end|>",
    "<EOT>",
]

SHORT_STRINGS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    "\r\n",
    " \n ",
    "  hello",
    " hello",
    "hello ",
    "hello  ",
    "Hello World",
    "HELLO world",
    "1234567",
    "12345678901234567890",
    "3.14159",
    "1,000,000.50",
    "0x1F",
    "don't I'm we're they've he'll she'd it's",
    "DON'T I'M WE'RE",
    "'s 'll 'd",
    "' '",
    "a ' b",
    " 's",
    "x , y . z ! w ?",
    "Hi , there . How ' s it ?",
    "héllo wörld",
    "naïve café",
    "e\u0301",
    "日本語のテキスト",
    "中文文本",
    "한국어",
    "🙂",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "🇫🇷",
    "مرحبا بالعالم",
    "שלום עולם",
    "Ελληνικά",
    "Привет мир",
    "हिन्दी",
    "ภาษาไทย",
    "a\u00a0b",
    "\u3000x",
    "x\u2009y",
    "\u200b",
    "\ufeffbom",
    "Ｈｅｌｌｏ",
    "²³ ½ ∑≤≠",
    "ﬁ",
    "\x00\x01\x1b\x1f",
    "\t\tindented",
    "    four spaces",
    "a  b   c    d",
    "   leading",
    "trailing   ",
    "mixed 中文 and English 123",
    "!!!...???",
    "''",
    "``",
    "--->",
    "<<>>",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>",
    "<eos>",
    "</s>",
    "<s>",
    "<unk>",
    "<pad>",
    "<unused0>",
    "<|endoftext|>",
    "<table><tr><td>x</td></tr></table>",
    "<|im_start",
    "end_of_turn>",
    "< bos>",
    "a<|im_end|>b",
    " <|im_end|> ",
    "<end_of_turn><end_of_turn>",
    "▁leading block",
    "word▁word",
    "<0x41>",
    "\n" * 40,
    " " * 40,
    "\t" * 40,
    "x" + " " * 33 + "y",
]

_PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, isn't it?",
    '"Well," she said, "I\'d rather we didn\'t."',
    "They'll say we've won; he'd disagree.",
    "Numbers like 42, 3.14159, -17 and 1e-9 appear everywhere (see Table 3).",
    "E-mail me at someone@example.com or visit https://example.org/path?q=1&r=2#frag.",
    "Prices rose 12% in Q3 -- from $1,299.99 to $1,454.99 -- a record!",
    "WHY ARE YOU SHOUTING?! I'm not... I'M NOT.",
    "co-operate, re-enter, state-of-the-art; well_known_name",
    "Mr. O'Neil's dog's bone; the Joneses' car.",
    "Ünïcödé àccents: café, naïve, façade, Zürich, São Paulo, Øresund.",
]
_UNICODE = [
    "日本語のテキストと漢字、ひらがな、カタカナ。",
    "中文文本：你好，世界！",
    "한국어 문장입니다.",
    "Emoji: 🙂 😂 👍🏽 👨\u200d👩\u200d👧 🇫🇷 🇯🇵 ❤️ ✨ 🚀",
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "עברית: שלום עולם",
    "Ελληνικά: Γειά σου Κόσμε",
    "Русский: Привет, мир!",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "Math: ∑ x² ≤ ∞, ½ + ¼ ≠ ⅓, α→β",
    "Full width: Ｈｅｌｌｏ　ｗｏｒｌｄ",
    "Combining: e\u0301 a\u0308 n\u0303; ligature ﬁ; zero\u200bwidth; nbsp\u00a0here; thin\u2009space",
    "Controls: \x01\x02\x1b[0m\x7f end",
    "Mixed: English 中文 123 مرحبا 🙂 done",
]
_CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i * i);\n\tif (i % 3 == 0) continue;\n}\n',
    '{\n  "name": "juno",\n  "version": [0, 1, 0],\n  "nested": {"a": null, "b": true}\n}\n',
    'class Foo:\n    """Docstring."""\n\n    def __init__(self):\n        self.x = {\'k\': [1, 2, 3]}  # comment\n',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;\n",
    '<div class="row"><table><tr><td>cell</td></tr></table></div>\n<h1>Title</h1><blockquote>q</blockquote>\n',
    "    \t  mixed indentation\n\t\t\ttabs\n        eight spaces\n                sixteen\n",
    'x = [1,2,3]; y = x[::-1]; z = {**a, **b}; w = a if b else c; print(f"{x!r:>10}")\n',
]


def golden_text(min_chars: int = 20_000) -> str:
    """A deterministic text mixing prose, code, long digit runs, whitespace runs, unicode and the
    special-token texts of both models."""
    rng = random.Random(20250301)
    parts: list[str] = []
    total = 0
    while total < min_chars:
        kind = rng.randrange(8)
        if kind == 0:
            s = " ".join(rng.choice(_PROSE) for _ in range(rng.randint(2, 6))) + "\n"
        elif kind == 1:
            s = rng.choice(_CODE)
        elif kind == 2:
            s = "".join(str(rng.randrange(10)) for _ in range(rng.randint(5, 60))) + rng.choice(
                [" ", "\n", ".", ",", "x"]
            )
        elif kind == 3:
            s = (
                rng.choice(["", "word"])
                + rng.choice([" ", "\t", "\n", "\r\n", "\u00a0", "\u3000"]) * rng.randint(1, 40)
                + rng.choice(["end", "", "\n"])
            )
        elif kind == 4:
            s = rng.choice(_UNICODE) + rng.choice(["\n", " ", "\n\n"])
        elif kind == 5:
            tok = rng.choice(SPECIAL_TEXTS)
            s = (
                rng.choice(["", " ", "\n", "text", "  "])
                + tok
                + rng.choice(["", " ", "\n", "user\n", "model\n", "  x"])
            )
        elif kind == 6:
            s = (
                "<|im_start|>user\n"
                + rng.choice(_PROSE)
                + "<|im_end|>\n<start_of_turn>model\n"
                + rng.choice(_UNICODE)
                + "<end_of_turn>\n"
            )
        else:
            s = rng.choice(["    ", "\t", "", "  "]) + rng.choice(_PROSE) + rng.choice(["   \n", "\n\n\n", " ", "\n"])
        parts.append(s)
        total += len(s)
    return "".join(parts)


# ------------------------------------------------------------------------------------------ llama.cpp


class LlamaVocab:
    """llama.cpp's tokenizer of one GGUF (vocab_only), called through its C API."""

    def __init__(self, path: Path):
        import llama_cpp

        self.api = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm._model.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self.api.llama_token * n_max)()
        n = self.api.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        assert n >= 0, n
        return list(buf[:n])

    def detokenize(self, ids: list[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        arr = (self.api.llama_token * max(1, len(ids)))(*ids)
        n_max = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(n_max)
        n = self.api.llama_detokenize(self.vocab, arr, len(ids), buf, n_max, remove_special, unparse_special)
        assert n >= 0, n
        return buf.raw[:n].decode("utf-8", "surrogateescape")

    def piece(self, token: int, special: bool) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.api.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        assert n >= 0, n
        return buf.raw[:n].hex()

    def facts(self) -> dict:
        a, v = self.api, self.vocab
        null = lambda i: None if i < 0 else i  # noqa: E731
        n = a.llama_vocab_n_tokens(v)
        return {
            "vocab_size": n,
            "bos": null(a.llama_vocab_bos(v)),
            "eos": null(a.llama_vocab_eos(v)),
            "eot": null(a.llama_vocab_eot(v)),
            "add_bos": bool(a.llama_vocab_get_add_bos(v)),
            "add_eos": bool(a.llama_vocab_get_add_eos(v)),
            "eog": [i for i in range(n) if a.llama_vocab_is_eog(v, i)],
        }


def _ids_variants(lc: LlamaVocab, text: str) -> dict:
    return {
        f"{'special' if ps else 'plain'}{'_bos' if add else ''}": lc.tokenize(text, add, ps)
        for ps in (False, True)
        for add in (False, True)
    }


def _detok_or_same(detok: str, text: str):
    return True if detok == text else detok


def model_record(lc: LlamaVocab, name: str, text: str) -> dict:
    whole = {k: lc.tokenize(text, True, ps) for k, ps in (("plain_bos", False), ("special_bos", True))}
    lines = text.splitlines(keepends=True)
    record = {
        "model": name,
        "made_with": f"llama-cpp-python {lc.api.__version__}",
        **lc.facts(),
        "text": text,
        "whole": whole,
        # true: llama_detokenize(ids, remove_special=True, unparse_special) gives the text back exactly
        "whole_detok": {k: _detok_or_same(lc.detokenize(ids, remove_special=True), text) for k, ids in whole.items()},
        "whole_detok_special": {
            k: _detok_or_same(lc.detokenize(ids, remove_special=True, unparse_special=True), text)
            for k, ids in whole.items()
        },
        "lines": {
            ps_name: [lc.tokenize(line, False, ps) for line in lines]
            for ps_name, ps in (("plain", False), ("special", True))
        },
        "short": [],
    }
    for s in SHORT_STRINGS:
        ids = _ids_variants(lc, s)
        record["short"].append(
            {
                "text": s,
                "ids": ids,
                "detok": lc.detokenize(ids["plain"]),
                "detok_special": lc.detokenize(ids["special_bos"], unparse_special=True),
                "detok_remove_special": lc.detokenize(ids["special_bos"], remove_special=True),
                "pieces": [lc.piece(i, False) for i in ids["special_bos"]],
                "pieces_special": [lc.piece(i, True) for i in ids["special_bos"]],
            }
        )
    return record


# ----------------------------------------------------------------------------------- variant vocabularies

VARIANTS = [  # (name, base model, metadata changes)
    ("smollm2_pre_default", "smollm2-135m", {"tokenizer.ggml.pre": "default"}),
    ("smollm2_pre_gpt-2", "smollm2-135m", {"tokenizer.ggml.pre": "gpt-2"}),
    ("smollm2_pre_llama-bpe", "smollm2-135m", {"tokenizer.ggml.pre": "llama-bpe"}),
    ("smollm2_pre_qwen2", "smollm2-135m", {"tokenizer.ggml.pre": "qwen2"}),
    ("gemma3_space_prefix", "gemma3-270m", {"tokenizer.ggml.add_space_prefix": True}),
]


def write_vocab_variant(src: Path, dst: Path, changes: dict) -> None:
    """A GGUF holding only `src`'s metadata, with `changes` applied (llama.cpp's vocab_only reads no tensors)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = changes.get(key, field.contents())
        writer.add_key_value(key, value, vtype, sub)
    for key, value in changes.items():
        if key not in reader.fields:
            vtype = gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.STRING
            writer.add_key_value(key, value, vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def variant_records(text: str) -> dict:
    from juno_py import store

    out = {}
    lines = text.splitlines(keepends=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, changes in VARIANTS:
            path = Path(tmp) / f"{name}.gguf"
            write_vocab_variant(store.resolve_model(model), path, changes)
            lc = LlamaVocab(path)
            out[name] = {
                "base": model,
                "changes": changes,
                **lc.facts(),
                "lines": [lc.tokenize(line, False, False) for line in lines],
                "short": [
                    {"text": s, "ids": lc.tokenize(s, True, False), "detok": lc.detokenize(lc.tokenize(s, True, False))}
                    for s in SHORT_STRINGS
                ],
            }
            del out[name]["eog"]
    return out


def _dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n")
    print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB")


def make(out_dir: Path) -> None:
    from juno_py import store

    text = golden_text()
    for name, model in (("smollm2", "smollm2-135m"), ("gemma3", "gemma3-270m")):
        lc = LlamaVocab(store.resolve_model(model))
        _dump(model_record(lc, model, text), Path(out_dir) / f"tokenization_{name}.json")
    _dump({"text": text, "variants": variant_records(text)}, Path(out_dir) / "tokenization_variants.json")
