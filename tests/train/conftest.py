"""A tiny llama GGUF (chatml template, byte-level BPE) and small data sets, shared by the training tests."""

import json

import pytest

from tests.fixtures.tiny_models import write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama", seed=3)


@pytest.fixture
def tiny_model(tiny_path):
    from juno_py.models import load_model

    return load_model(tiny_path)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


MIXED_RECORDS = [
    {"Q": "What is the capital of Velmora?", "A": "Quenhaven is."},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"},
                  {"role": "assistant", "content": "the end"}]},
    {"text": "the river flows on and on through the old town"},
    {"prompt": "Say a word:", "completion": " otter"},
    {"Q": "Who sings?", "A": "Juno sings."},
    {"text": "a short one"},
    {"prompt": "two plus two is", "completion": " four"},
    {"messages": [{"role": "user", "content": "name a color"}, {"role": "assistant", "content": "teal"}]},
    {"Q": "When was it built?", "A": "In 1847."},
    {"text": "water and stone"},
]


@pytest.fixture
def mixed_data(tmp_path):
    return write_jsonl(tmp_path / "mixed.jsonl", MIXED_RECORDS)
