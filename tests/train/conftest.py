"""A tiny llama GGUF (chatml template, byte-level BPE) and small data sets, shared by the training tests."""

import pytest

from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama", seed=3)


@pytest.fixture
def tiny_model(tiny_path):
    from juno_py.models import load_model

    return load_model(tiny_path)


@pytest.fixture
def mixed_data(tmp_path):
    return write_jsonl(tmp_path / "mixed.jsonl", MIXED_RECORDS)
