"""A tiny model whose every linear is IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0 or MXFP4
(random valid blocks, decoded by the frozen linear through the generic codec path): its logits equal those of the
same model with the weights stored dense (F32, decoded by the `gguf` package), and a LoRA and a DoRA step train on
it."""

import pytest
import torch

from juno_py.lora import Mode, attach
from juno_py.models import load_model
from juno_py.weights.frozen import FrozenQuantLinear
from tests.gguf.newtype_blocks import NEW_TYPES, tiny_llama_parts, write_model_pair

IDS = [1, 5, 9, 200, 17, 42, 3, 77, 150, 8, 64, 99]


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_llama_parts()


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_model_in_new_type_matches_dense_and_trains(tmp_path, tiny_llama, ggml_type):
    quant_path, dense_path = write_model_pair(tmp_path, *tiny_llama, ggml_type)
    model, dense = load_model(quant_path), load_model(dense_path)
    linears = [lin for blk in model.blocks for lin in blk.linears.values()]
    assert len(linears) == 7 and all(isinstance(lin, FrozenQuantLinear) for lin in linears)
    assert {lin._ggml_type for lin in linears} == {int(ggml_type)}  # the output projection is the F32 embedding
    with torch.no_grad():
        got, ref = model.logits(IDS), dense.logits(IDS)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert float(ref.std()) > 0
    assert torch.equal(got, ref)

    for mode in (Mode.LORA, Mode.DORA):
        step_moves_logits(load_model(quant_path) if mode is Mode.DORA else model, mode, got)


def step_moves_logits(model, mode: Mode, before: torch.Tensor) -> None:
    """One training step with adapters of `mode` on every linear: gradients reach every adapter, the step moves
    them, and the logits change."""
    adapters = attach(model, "all", rank=4, alpha=8, mode=mode, seed=0)
    opt = torch.optim.AdamW(list(adapters.parameters()), lr=1e-2)
    tokens = torch.tensor([IDS[:-1]])
    targets = torch.tensor([IDS[1:]])
    loss = model.loss(tokens, targets)
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in adapters.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads)
    opt.step()
    with torch.no_grad():
        after = model.logits(IDS)
    assert torch.isfinite(after).all()
    assert not torch.equal(after, before)
