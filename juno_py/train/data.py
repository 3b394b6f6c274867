"""Training data: records from JSON/JSONL/text files, token ids with loss masks, and batches (padded or packed).

Record forms: `{"text"}` (and plain .txt files), `{"prompt","completion"}`, `{"messages": [...]}` and Juno's
`{"Q","A"}`. Chat records are rendered with the model's own template; the loss covers each assistant turn's
tokens and its end-of-turn token, nothing else.

Finding assistant spans: the conversation is rendered turn by turn. For assistant turn i, the text of
`messages[:i]` with the generation prompt is the prefix and the text of `messages[:i+1]` the prefix plus the
turn; the difference is the turn, supervised up to and including its first end-of-generation token (the
newline a template writes after `<|im_end|>` is not supervised). When every such render is a prefix of the
next, one sequence carries all turns. A template that rewrites earlier turns (Qwen3 drops past `<think>`
blocks) breaks that chain; then each assistant turn becomes its own sequence, its history rendered exactly
as the template renders it when that turn is generated.

Token boundaries: the prompt part and the supervised part are tokenized separately and concatenated, so no
token straddles a prompt/answer boundary, and the prompt's tokens are exactly what inference feeds the model
before it generates the answer.
"""

from __future__ import annotations

import codecs
import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from juno_py.errors import JunoError, TokenizerError

IGNORE = -100


class DataError(JunoError, ValueError):
    """A malformed data file or record: names the file and line."""


@dataclass
class Example:
    """One token sequence and, per token, whether the loss predicts it."""

    ids: list[int]
    supervised: list[bool]
    record: int = 0  # index of the record it came from (validation holds out whole records)

    def __post_init__(self):
        if len(self.ids) != len(self.supervised):
            raise ValueError("ids and supervised differ in length")

    @property
    def n_supervised(self) -> int:
        return sum(self.supervised[1:])  # the first token is never predicted


@dataclass
class DataStats:
    records: int = 0
    examples: int = 0
    skipped_bad: int = 0
    skipped_empty: int = 0  # records that left nothing to learn from (no tokens, or none supervised)
    dropped_long: int = 0
    split_long: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    per_form: dict = field(default_factory=dict)

    def line(self) -> str:
        forms = ", ".join(f"{k} {v}" for k, v in sorted(self.per_form.items()))
        extra = []
        if self.skipped_bad:
            extra.append(f"{self.skipped_bad} bad records skipped")
        if self.skipped_empty:
            extra.append(f"{self.skipped_empty} records with nothing to learn skipped")
        if self.dropped_long:
            extra.append(f"{self.dropped_long} over-long chat/prompt records dropped")
        if self.split_long:
            extra.append(f"{self.split_long} long texts split")
        return (
            f"{self.records} records ({forms}) -> {self.examples} sequences, {self.tokens} tokens, "
            f"{self.supervised_tokens} supervised" + (f"; {'; '.join(extra)}" if extra else "")
        )


# ---------------------------------------------------------------------------------------------- reading files
MAX_LINE_BYTES = 16 * 2**20  # one JSONL record; far above any real training record, low enough to refuse junk
MAX_DEPTH = 64  # JSON nesting; a chat record needs 4 levels (record, messages, message, content)


def _depth_ok(value) -> bool:
    """Whether `value` nests at most MAX_DEPTH containers deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > MAX_DEPTH:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def _parse_json(text: str, where: str):
    """json.loads with hostile input turned into DataErrors naming `where` (JSONDecodeError passes through)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise DataError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # an integer literal longer than Python converts (sys.get_int_max_str_digits)
        raise DataError(f"{where}: a number with more than {sys.get_int_max_str_digits()} digits") from None
    if not _depth_ok(value):
        raise DataError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    return value


def _jsonl_lines(path: Path, f, skip_bad: bool, stats: DataStats) -> Iterable[tuple[int, str]]:
    """(line number, decoded line) of a JSONL file, each line read with a size bound: a longer line is refused
    (or, with skip_bad, skipped) without holding it in memory."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            if not skip_bad:
                raise DataError(
                    f"{path}:{lineno}: line longer than {MAX_LINE_BYTES // 2**20} MiB; expected one "
                    f"JSON record per line"
                )
            stats.skipped_bad += 1
            while raw and not raw.endswith(b"\n"):  # drop the rest of the line in bounded pieces
                raw = f.readline(MAX_LINE_BYTES)
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line)") from None
        # str.splitlines' line breaks (a lone \r, U+2028, ...) end a line too, as they always have here
        pieces = text.splitlines() or [""]
        for i, piece in enumerate(pieces):
            yield lineno + i, piece
        lineno += len(pieces) - 1


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_ARRAY_CHUNK = 1 << 20  # characters read at a time from a JSON array file


def _json_array(path: Path, f, skip_bad: bool, stats: DataStats) -> Iterable[tuple[int, object]]:
    """(record number, record) of a JSON array file, read one record at a time, each with the bounds of a JSONL
    line: at most MAX_LINE_BYTES and MAX_DEPTH levels, integers within Python's digit limit. Memory holds one
    record's text (and a chunk) beside the records read, not the file's text and its parse at once. A record over
    those bounds is refused, or with skip_bad skipped (counted) when it parses."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    json_decoder = json.JSONDecoder()
    buf, pos, eof, read = "", 0, False, 0

    def more() -> None:
        nonlocal buf, pos, eof, read
        data = f.read(_ARRAY_CHUNK)
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {read + e.start})") from None
        read += len(data)
        buf, pos = buf[pos:] + text, 0
        eof = not data

    def skip_space() -> str:
        """The next character that is not whitespace ('' at the end of the file)."""
        nonlocal pos
        while True:
            pos = _WHITESPACE.match(buf, pos).end()  # type: ignore[union-attr]
            if pos < len(buf) or eof:
                return buf[pos : pos + 1]
            more()

    more()
    if skip_space() != "[":
        raise DataError(f"{path}: invalid JSON array: expected '[' at the start")
    pos += 1
    number = 0
    while True:
        c = skip_space()
        if c == "]" and number == 0:
            pos += 1
            break
        number += 1
        where = f"{path}: record {number}"
        while True:  # parse one record, reading more until it and the character after it are in the buffer
            try:
                value, end = json_decoder.raw_decode(buf, pos)
                complete = end < len(buf) or eof
            except json.JSONDecodeError as e:
                if eof:
                    raise DataError(f"{where}: invalid JSON ({e.msg})") from None
                complete = False
            except RecursionError:
                raise DataError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
            except ValueError:  # an integer literal longer than Python converts
                raise DataError(f"{where}: a number with more than {sys.get_int_max_str_digits()} digits") from None
            if complete:
                break
            if len(buf) - pos > MAX_LINE_BYTES:
                raise DataError(f"{where}: longer than {MAX_LINE_BYTES // 2**20} MiB; expected a training record")
            more()
        size = len(buf[pos:end].encode("utf-8"))
        pos = end
        if size > MAX_LINE_BYTES or not _depth_ok(value):
            problem = (
                f"longer than {MAX_LINE_BYTES // 2**20} MiB"
                if size > MAX_LINE_BYTES
                else f"JSON nested deeper than {MAX_DEPTH} levels"
            )
            if not skip_bad:
                raise DataError(f"{where}: {problem}")
            stats.skipped_bad += 1
        else:
            yield number, value
        c = skip_space()
        if c == ",":
            pos += 1
            continue
        if c == "]":
            pos += 1
            break
        raise DataError(f"{where}: invalid JSON array: expected ',' or ']' after the record")
    if skip_space():
        raise DataError(f"{path}: invalid JSON array: text after its closing ']'")


def read_records(path, skip_bad: bool = False, stats: Optional[DataStats] = None) -> list[tuple[int, dict]]:
    """(line number, record) pairs from a JSONL file, a JSON array, or a plain text file (one text record)."""
    path = Path(path)
    stats = stats if stats is not None else DataStats()
    records: list[tuple[int, dict]] = []
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
            f.seek(0)
            if path.suffix.lower() in (".txt", ".md", ".text"):
                try:
                    return [(1, {"text": f.read().decode("utf-8")})]
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
            if head.startswith(b"["):
                records.extend(_json_array(path, f, skip_bad, stats))  # type: ignore[arg-type]
            else:
                for lineno, line in _jsonl_lines(path, f, skip_bad, stats):
                    if not line.strip():
                        continue
                    try:
                        records.append((lineno, _parse_json(line, f"{path}:{lineno}")))
                    except (json.JSONDecodeError, DataError) as e:
                        if skip_bad:
                            stats.skipped_bad += 1
                            continue
                        if isinstance(e, DataError):
                            raise
                        raise DataError(
                            f"{path}:{lineno}: invalid JSON ({e.msg}); expected one JSON object per line"
                        ) from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None
    out = []
    for lineno, rec in records:
        problem = record_problem(rec)
        if problem:
            if skip_bad:
                stats.skipped_bad += 1
                continue
            raise DataError(f"{path}:{lineno}: {problem}")
        out.append((lineno, rec))
    return out


def record_form(rec: dict) -> str:
    if "messages" in rec:
        return "messages"
    if "prompt" in rec or "completion" in rec:
        return "prompt"
    if "Q" in rec or "A" in rec:
        return "qa"
    return "text"


def record_problem(rec) -> Optional[str]:
    """Why a record is malformed, or None."""
    expected = 'expected an object with "text", "prompt"+"completion", "messages" or "Q"+"A"'
    if not isinstance(rec, dict):
        return f"record is {type(rec).__name__}, {expected}"
    form = record_form(rec)
    if form == "text":
        if not isinstance(rec.get("text"), str):
            return f'field "text" missing or not a string; {expected}'
    elif form == "prompt":
        for k in ("prompt", "completion"):
            if not isinstance(rec.get(k), str):
                return f'field "{k}" missing or not a string (a prompt record needs "prompt" and "completion")'
    elif form == "qa":
        for k in ("Q", "A"):
            if not isinstance(rec.get(k), str) or not rec[k].strip():
                return f'field "{k}" missing or empty (a Q&A record needs "Q" and "A" strings)'
    else:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            return 'field "messages" must be a non-empty list of {"role", "content"} objects'
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f'messages[{j}] must be an object with string "role" and "content"'
        if not any(m["role"] == "assistant" for m in msgs):
            return 'field "messages" has no assistant turn to learn from'
    return None


# ------------------------------------------------------------------------------------------ Q&A rephrasings
_QA_FORMS = (
    "{q}",
    "{q_lower}",
    "Question: {q}",
    "Can you tell me this: {q}",
    "I'd like to know: {q}",
    "Please answer briefly. {q}",
    "Quick question: {q}",
    "{q} Answer in one sentence.",
)


def qa_variants(question: str, n: int) -> list[str]:
    """The question and up to n-1 deterministic rewordings of it (Juno's --qa-variants)."""
    q = question.strip()
    q_lower = q[:1].lower() + q[1:]
    forms = [f.format(q=q, q_lower=q_lower) for f in _QA_FORMS]
    out: list[str] = []
    for f in forms:
        if f not in out:
            out.append(f)
    return out[: max(1, n)]


# ------------------------------------------------------------------------------------- records to examples
class Encoder:
    """Turns records into Examples with one tokenizer and chat template."""

    def __init__(self, tokenizer, max_seq_len: int, qa_variants: int = 1, system: Optional[str] = None):
        self.tok = tokenizer
        self.max_seq_len = max_seq_len
        self.qa_variants = qa_variants
        self.system = system

    def _text_ids(self, text: str, first: bool) -> list[int]:
        return self.tok.encode(text, add_special=first, parse_special=False)

    def _template_ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special=False, parse_special=True)

    def _supervised_span(self, ids: list[int]) -> list[bool]:
        """Supervise up to and including the first end-of-generation token; what the template adds after it
        (a newline) is not part of the answer."""
        mask = [True] * len(ids)
        for i, t in enumerate(ids):
            if self.tok.is_eog(t):
                for j in range(i + 1, len(ids)):
                    mask[j] = False
                break
        return mask

    def chat(self, messages: list[dict], record: int = 0) -> list[Example]:
        render = self.tok.chat_template.render
        if self.system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}] + list(messages)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        pieces: list[tuple[str, str]] = []  # (prompt text, answer text) per assistant turn
        previous_end = ""
        chained = True
        for i in turns:
            prefix = render(messages[:i], add_generation_prompt=True)
            full = render(messages[: i + 1], add_generation_prompt=False)
            if not full.startswith(prefix):
                raise DataError(
                    f"record {record}: the chat template's render of turn {i} does not extend its "
                    f"prompt; cannot locate the assistant's tokens"
                )
            if not prefix.startswith(previous_end):
                chained = False
            pieces.append((prefix, full[len(prefix) :]))
            previous_end = full
        if chained:
            ids: list[int] = []
            sup: list[bool] = []
            consumed = ""
            for prefix, answer in pieces:
                p = self._template_ids(prefix[len(consumed) :])
                a = self._template_ids(answer)
                ids += p + a
                sup += [False] * len(p) + self._supervised_span(a)
                consumed = prefix + answer
            return [Example(ids, sup, record)]
        out = []
        for prefix, answer in pieces:  # a template that rewrites history: one sequence per assistant turn
            p, a = self._template_ids(prefix), self._template_ids(answer)
            out.append(Example(p + a, [False] * len(p) + self._supervised_span(a), record))
        return out

    def encode(self, rec: dict, record: int = 0) -> list[Example]:
        form = record_form(rec)
        if form == "text":
            ids = self._text_ids(rec["text"], first=True)
            return [Example(ids, [True] * len(ids), record)]
        if form == "prompt":
            p = self._text_ids(rec["prompt"], first=True)
            c = self.tok.encode(rec["completion"], add_special=False, parse_special=False)
            if self.tok.eos_id is not None:
                c = c + [self.tok.eos_id]  # so the adapter learns to stop
            return [Example(p + c, [False] * len(p) + [True] * len(c), record)]
        if form == "qa":
            out = []
            for q in qa_variants(rec["Q"], self.qa_variants):
                out += self.chat(
                    [{"role": "user", "content": q}, {"role": "assistant", "content": rec["A"].strip()}], record
                )
            return out
        return self.chat(rec["messages"], record)

    def fit(self, ex: Example, form: str, stats: DataStats) -> list[Example]:
        """Length policy: plain text is split into max_seq_len chunks (all supervised); a chat, prompt or Q&A
        sequence that is too long is dropped (truncating it would cut the answer the loss is about)."""
        L = self.max_seq_len
        if len(ex.ids) <= L:
            return [ex]
        if form == "text":
            stats.split_long += 1
            return [
                Example(ex.ids[i : i + L], ex.supervised[i : i + L], ex.record)
                for i in range(0, len(ex.ids), L)
                if len(ex.ids[i : i + L]) > 1
            ]
        stats.dropped_long += 1
        return []


def build_examples(
    records: Sequence[tuple[str, dict]], encoder: Encoder, stats: Optional[DataStats] = None
) -> list[Example]:
    """Encode (location, record) pairs, location being "file:line" for error messages, and apply the length
    policy."""
    stats = stats if stats is not None else DataStats()
    out: list[Example] = []
    for idx, (where, rec) in enumerate(records):
        form = record_form(rec)
        stats.records += 1
        stats.per_form[form] = stats.per_form.get(form, 0) + 1
        try:
            exs = encoder.encode(rec, idx)
        except (DataError, TokenizerError) as e:
            raise DataError(f"{where}: {e}") from None
        fitted = [piece for ex in exs for piece in encoder.fit(ex, form, stats)]
        pieces = [piece for piece in fitted if piece.n_supervised > 0]  # a sequence with no target teaches nothing
        if fitted and not pieces or not exs:
            stats.skipped_empty += 1
        for piece in pieces:
            out.append(piece)
            stats.examples += 1
            stats.tokens += len(piece.ids)
            stats.supervised_tokens += piece.n_supervised
    return out


def split_validation(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """Hold out whole records (never pieces of one) for validation."""
    if fraction <= 0 or len(records) < 2:
        return list(records), []
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = max(1, min(len(records) - 1, round(fraction * len(records))))
    val = sorted(order[:n_val])
    held = set(val)
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in val]


# ------------------------------------------------------------------------------------------------- batches
@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, T] long, IGNORE where no loss
    positions: torch.Tensor  # [B, T] long
    # [B, T] long: document of each token (a token attends only to its own document's tokens; each padding token
    # is a document of its own), None for plain causal rows. O(T), never a [T, T] mask: see models.attention
    documents: Optional[torch.Tensor]
    n_supervised: int
    n_real: int = 0  # tokens of the examples, padding excluded

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    def dense_mask(self) -> Optional[torch.Tensor]:
        """The attention restriction as a bool `[B, T, T]` (True: may attend): the same documents, O(T²); None for
        plain causal rows. A reference for checks, not for training."""
        if self.documents is None:
            return None
        return self.documents[:, :, None] == self.documents[:, None, :]


def _targets(ex: Example) -> list[int]:
    """targets[t] = ids[t+1] where that token is supervised, else IGNORE."""
    out = [IGNORE] * len(ex.ids)
    for t in range(len(ex.ids) - 1):
        if ex.supervised[t + 1]:
            out[t] = ex.ids[t + 1]
    return out


def pad_batch(examples: Sequence[Example], pad_id: int = 0) -> Batch:
    """One example per row, right-padded; padding is masked out of attention and loss."""
    T = max(len(e.ids) for e in examples)
    B = len(examples)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    positions = torch.arange(T).repeat(B, 1)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e.ids)
        tokens[b, :n] = torch.tensor(e.ids)
        targets[b, :n] = torch.tensor(_targets(e))
        valid[b, :n] = True
    documents = _documents(torch.zeros(B, T, dtype=torch.long), valid) if not bool(valid.all()) else None
    return Batch(tokens, targets, positions, documents, int((targets != IGNORE).sum()), int(valid.sum()))


def _documents(doc: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Document ids with each padding token (not `valid`) a document of its own: -1 - its index."""
    alone = -1 - torch.arange(doc.shape[1], dtype=torch.long).expand_as(doc)
    return torch.where(valid, doc, alone)


PACK_SEARCH = 64  # open rows a document may join: first-fit over the most recent ones keeps packing O(n)


def pack_examples(examples: Sequence[Example], max_len: int) -> list[list[Example]]:
    """Greedy first-fit packing of examples into rows of at most max_len tokens (order kept within a row),
    searching the `PACK_SEARCH` most recently opened rows that still have room."""
    rows: list[list[Example]] = []
    sizes: list[int] = []
    open_rows: list[int] = []
    for e in examples:
        n = len(e.ids)
        i = next((i for i in open_rows[-PACK_SEARCH:] if sizes[i] + n <= max_len), None)
        if i is None:
            i = len(rows)
            rows.append([])
            sizes.append(0)
            open_rows.append(i)
        rows[i].append(e)
        sizes[i] += n
        if sizes[i] >= max_len:
            open_rows.remove(i)
        if len(open_rows) > 2 * PACK_SEARCH:
            del open_rows[:-PACK_SEARCH]
    return rows


def packed_batch(rows: Sequence[Sequence[Example]], pad_id: int = 0) -> Batch:
    """Several documents per row: block-diagonal causal attention and per-document positions, so packed
    documents never see each other."""
    T = max(sum(len(e.ids) for e in row) for row in rows)
    B = len(rows)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    doc = torch.full((B, T), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for d, e in enumerate(row):
            n = len(e.ids)
            tokens[b, at : at + n] = torch.tensor(e.ids)
            targets[b, at : at + n] = torch.tensor(_targets(e))
            positions[b, at : at + n] = torch.arange(n)
            doc[b, at : at + n] = d
            at += n
    documents = _documents(doc, doc >= 0)
    return Batch(tokens, targets, positions, documents, int((targets != IGNORE).sum()), int((doc >= 0).sum()))


def plan_epoch(
    examples: Sequence[Example], batch_size: int, seed: int, epoch: int, pack: bool, max_len: int
) -> list[list[list[Example]]]:
    """One epoch's batches in a deterministic order for (seed, epoch): batches of rows of examples (one example
    per row unless packed). Cheap: tensors are built only when a batch is collated, so a resume can skip ahead."""
    order = list(range(len(examples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    shuffled = [examples[i] for i in order]
    rows = pack_examples(shuffled, max_len) if pack else [[e] for e in shuffled]
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]


def collate(rows: Sequence[Sequence[Example]], pad_id: int = 0) -> Batch:
    """A batch of rows: padded when every row holds one example, else packed."""
    if all(len(row) == 1 for row in rows):
        return pad_batch([row[0] for row in rows], pad_id)
    return packed_batch(rows, pad_id)


BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data"
BUILTIN_FACTS = BUILTIN_DIR / "facts.jsonl"  # ten invented facts, Juno's {"Q","A"} form
BUILTIN_FACTS_HELDOUT = BUILTIN_DIR / "facts_heldout.jsonl"  # their rewordings, never trained on, with keywords


def _read_all(paths: Sequence, skip_bad: bool, stats: DataStats) -> list[tuple[str, dict]]:
    """("file:line", record) pairs of every file."""
    records = [(f"{p}:{lineno}", rec) for p in paths for lineno, rec in read_records(p, skip_bad, stats)]
    if not records:
        raise DataError(f"{', '.join(map(str, paths))}: no usable records")
    return records


def _refuse_if_nothing_to_learn(examples: list, stats: DataStats, paths: Sequence) -> None:
    """A one-line error when every record came out empty (no tokens, or none the loss predicts)."""
    if not examples and stats.skipped_empty and stats.skipped_empty + stats.dropped_long == stats.records:
        raise DataError(
            f"{', '.join(map(str, paths))}: no usable records: {stats.skipped_empty} of {stats.records} have no "
            f"tokens to learn from after tokenization (empty text or answer)"
        )


def load_dataset(
    paths: Iterable,
    tokenizer,
    max_seq_len: int,
    qa_variants_n: int = 1,
    skip_bad: bool = False,
    validation_split: float = 0.0,
    seed: int = 0,
    system: Optional[str] = None,
    validation_paths: Iterable = (),
) -> tuple[list[Example], list[Example], DataStats]:
    """Read, validate, split (whole records) and encode: (train examples, validation examples, stats).

    Validation comes from `validation_paths` when given, else from `validation_split` of the records. It uses
    the plain question of a Q&A record, no rephrasings, so it measures what training did not see verbatim."""
    paths, validation_paths = list(paths), list(validation_paths)
    stats = DataStats()
    records = _read_all(paths, skip_bad, stats)
    if validation_paths:
        train_recs, val_recs = records, _read_all(validation_paths, skip_bad, DataStats())
    else:
        train_recs, val_recs = split_validation(records, validation_split, seed)
    train = build_examples(train_recs, Encoder(tokenizer, max_seq_len, qa_variants_n, system), stats)
    _refuse_if_nothing_to_learn(train, stats, paths)
    val = build_examples(val_recs, Encoder(tokenizer, max_seq_len, 1, system), DataStats())
    return train, val, stats


def load_examples(
    paths: Iterable, tokenizer, max_seq_len: int, skip_bad: bool = False, system: Optional[str] = None
) -> tuple[list[Example], DataStats]:
    """Every record of `paths` encoded once (no rephrasings, no split): what `juno-py eval` scores."""
    stats = DataStats()
    paths = list(paths)
    records = _read_all(paths, skip_bad, stats)
    examples = build_examples(records, Encoder(tokenizer, max_seq_len, 1, system), stats)
    _refuse_if_nothing_to_learn(examples, stats, paths)
    return examples, stats
