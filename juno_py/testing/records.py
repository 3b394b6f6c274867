"""A small training set mixing every record format the data loader reads, and a JSONL writer."""

from __future__ import annotations

import json
from pathlib import Path

MIXED_RECORDS = [
    {"Q": "What is the capital of Velmora?", "A": "Quenhaven is."},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "the end"},
        ]
    },
    {"text": "the river flows on and on through the old town"},
    {"prompt": "Say a word:", "completion": " otter"},
    {"Q": "Who sings?", "A": "Juno sings."},
    {"text": "a short one"},
    {"prompt": "two plus two is", "completion": " four"},
    {"messages": [{"role": "user", "content": "name a color"}, {"role": "assistant", "content": "teal"}]},
    {"Q": "When was it built?", "A": "In 1847."},
    {"text": "water and stone"},
]


def write_jsonl(path: Path, records) -> Path:
    """Write one JSON object a line (UTF-8) and return `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
