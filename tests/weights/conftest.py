"""Fixtures of the frozen-linear tests: one tiny GGUF holding a random layer of every decodable type."""

import pytest

from juno_py.gguf import GGUFFile
from juno_py.testing.blocks import write_layers_gguf


@pytest.fixture(scope="session")
def layers_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "layers.gguf"
    write_layers_gguf(path)
    with GGUFFile(path) as f:
        yield f
