"""A tiny llama GGUF (chatml template, byte-level BPE) and small data sets, shared by the training tests."""

import pytest

from juno_py.gguf.constants import GGMLType
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


@pytest.fixture(scope="module")
def q8_path(tmp_path_factory):
    """The tiny llama in Q8_0: the sharded runs' model."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-q8") / "tiny-q8.gguf", "llama", GGMLType.Q8_0, seed=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """MIXED_RECORDS as JSONL, once per module: the multi-process runs' data."""
    return write_jsonl(tmp_path_factory.mktemp("shard-data") / "mixed.jsonl", MIXED_RECORDS)
