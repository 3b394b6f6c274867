"""Tokenizers of the two real models and llama.cpp's golden tokenization of them (tests/golden/data)."""

import json
from pathlib import Path

import pytest

from juno_py.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "data"


def load_golden(name: str) -> dict:
    return json.loads((GOLDEN / f"tokenization_{name}.json").read_text())


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_path):
    return Tokenizer.from_gguf(gemma3_path)


@pytest.fixture(scope="session", params=["smollm2", "gemma3"])
def model_and_golden(request):
    """(tokenizer, llama.cpp's golden record) for each real model."""
    return request.getfixturevalue(f"{request.param}_tokenizer"), load_golden(request.param)
