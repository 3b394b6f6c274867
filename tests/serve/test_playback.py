"""juno_py.playback: the stop-text hold-back, adapter names and selections, and the model left on the base when
a selection fails."""

from pathlib import Path

import pytest
import torch

from juno_py.errors import AdapterMismatch
from juno_py.lora import AdaptedLinear, Mode
from juno_py.playback import Adapters, SelectionError, UnknownAdapter, _held_back, open_model, parse_named
from juno_py.testing.tiny_models import write_tiny_gguf
from tests.merge.helpers import make_adapter


def test_held_back_is_the_longest_suffix_that_could_start_a_stop():
    assert _held_back("hello wor", ["world"]) == 3
    assert _held_back("hello", ["world"]) == 0
    assert _held_back("ab<|", ["<|end|>", "|x"]) == 2
    assert _held_back("aaa", ["aab"]) == 2
    assert _held_back("x", ["x"]) == 0  # a whole stop is found, not held back


def test_named_adapters():
    assert parse_named(["a=x/one.bin", "x/two.bin", "x/three.safetensors"]) == {
        "a": Path("x/one.bin"),
        "two": Path("x/two.bin"),
        "three.safetensors": Path("x/three.safetensors"),
    }
    for bad in (["base=x.bin"], ["a+b=x.bin"], ["a:1=x.bin"], ["=x.bin"], ["a=x.bin", "a=y.bin"]):
        with pytest.raises(SelectionError):
            parse_named(bad)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("playback")
    base = write_tiny_gguf(folder / "tiny.gguf", "qwen2", seed=3)
    files = {
        "a": make_adapter(base, folder / "a.bin", rank=2, b_std=0.2, seed=1),
        "d": make_adapter(base, folder / "d.bin", targets="qv", rank=2, mode=Mode.DORA, seed=2),
    }
    model = open_model(base, weights_cache="none")
    return model, Adapters(model, files)


def test_selections(served):
    _, adapters = served
    assert adapters.parse("base") == () and adapters.parse(" a ") == (("a", 1.0),)
    assert adapters.parse("a:0.5+d") == (("a", 0.5), ("d", 1.0)) == adapters.parse("a:0.5,d")
    with pytest.raises(UnknownAdapter, match="no adapter named 'b' \\(served: base, a, d\\)"):
        adapters.parse("a+b")
    for bad in ("", "a+a", "a:nan"):
        with pytest.raises(SelectionError):
            adapters.parse(bad)


def test_a_failed_selection_leaves_the_base(served):
    model, adapters = served
    ids = [5, 6, 7, 8]
    adapters.use(())
    with torch.no_grad():
        base = model.logits(ids)
    adapters.use(adapters.parse("a"))
    with torch.no_grad():
        assert not torch.equal(model.logits(ids), base)
    with pytest.raises(AdapterMismatch, match="DoRA"):
        adapters.use(adapters.parse("a+d"))
    assert adapters.current == ()
    assert not any(isinstance(m, AdaptedLinear) for blk in model.blocks for m in blk.linears.values())
    with torch.no_grad():
        assert torch.equal(model.logits(ids), base)
