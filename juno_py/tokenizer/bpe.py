"""GPT-2 byte-level BPE ("gpt2" in GGUF): llama.cpp's pre-tokenizer, then merges by rank via `tokenizers`.

llama.cpp merges any ranked pair, whether or not the result is in the vocabulary, and spells a
final symbol that is not a token byte by byte. `tokenizers` refuses such merges, so the missing
strings join its vocabulary as extra ids that we spell out afterwards the way llama.cpp does.
"""

from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _hf_models

from juno_py.tokenizer import pretokenize


class ByteLevelBPE:
    def __init__(self, tokens: list[str], merges: list[str], regexes: list[str], ignore_merges: bool):
        self.regexes = regexes
        vocab = {t: i for i, t in enumerate(tokens)}
        extra: dict[str, int] = {}

        def ensure(s: str) -> None:
            if s not in vocab and s not in extra:
                extra[s] = len(tokens) + len(extra)

        for ch in pretokenize.BYTE_TO_UNICODE:
            ensure(ch)
        pairs: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for m in merges:
            cut = m.find(" ", 1)  # llama.cpp: the first space after the first character
            if cut < 0:
                continue
            pair = (m[:cut], m[cut + 1 :])
            if pair in seen:  # llama.cpp keeps the first rank of a repeated pair
                continue
            seen.add(pair)
            pairs.append(pair)
            for s in (pair[0], pair[1], pair[0] + pair[1]):
                ensure(s)
        self._spelled = {i: self._spell(s, vocab) for s, i in extra.items()}
        self._model = _HFTokenizer(_hf_models.BPE({**vocab, **extra}, pairs, ignore_merges=ignore_merges))

    @staticmethod
    def _spell(symbol: str, vocab: dict[str, int]) -> list[int]:
        """llama.cpp's fallback for a symbol that is no token: each UTF-8 byte as a one-byte token."""
        ids = []
        for b in symbol.encode("utf-8", "surrogateescape"):
            i = vocab.get(bytes([b]).decode("utf-8", "surrogateescape"))
            if i is not None:
                ids.append(i)
        return ids

    def encode(self, text: str) -> list[int]:
        words = [pretokenize.byte_encode(w) for w in pretokenize.split(text, self.regexes)]
        if not words:
            return []
        ids = self._model.encode(words, is_pretokenized=True, add_special_tokens=False).ids
        if any(i in self._spelled for i in ids):
            ids = [j for i in ids for j in self._spelled.get(i, (i,))]
        return ids
