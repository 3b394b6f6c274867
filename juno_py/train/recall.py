"""Does an adapter answer questions it was never trained on? Greedy playback of Q&A records, scored by whether the
answer contains the record's `keyword`: the held-out check of the built-in facts (tests and the tuning sweep)."""

from __future__ import annotations

import json
from pathlib import Path

from juno_py.models.generate import generate


def read_keyword_records(path) -> list[dict]:
    """{"Q", "A", "keyword"} records, one JSON object per line."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def answer_recall(model, records, max_new_tokens: int = 32) -> tuple[int, list[str]]:
    """How many records the model answers with their keyword (greedy), and one line per record for the log."""
    tok = model.tokenizer
    right, lines = 0, []
    for r in records:
        ids = tok.apply_chat_template([{"role": "user", "content": r["Q"]}], add_generation_prompt=True)
        answer = tok.decode(generate(model, ids, max_new_tokens, temperature=0.0, stop_ids=tok.eog_ids)).strip()
        ok = r["keyword"].lower() in answer.lower()
        right += ok
        lines.append(f"{'ok  ' if ok else 'MISS'} {r['Q']} -> {answer}")
    return right, lines
