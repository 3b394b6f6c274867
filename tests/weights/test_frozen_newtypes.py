"""A tiny model whose every linear is IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0 or MXFP4
(random valid blocks, decoded by the frozen linear through the generic codec path): its logits equal those of the
same model with the weights stored dense (F32, decoded by the `gguf` package), and a LoRA step trains on it."""

import gguf
import numpy as np
import pytest
import torch

from juno_py.gguf import GGMLType, GGUFWriter
from juno_py.lora import Mode, attach
from juno_py.models import load_model
from juno_py.weights.frozen import FrozenQuantLinear
from tests.fixtures.tiny_models import _ITEM_TYPES, gguf_metadata, gguf_tensors, hf_tiny_model
from tests.gguf.newtype_blocks import NEW_TYPES, random_blocks

# rows of 256 columns: every input width is a whole number of 256-value blocks
CONFIG = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64)
IDS = [1, 5, 9, 200, 17, 42, 3, 77, 150, 8, 64, 99]


@pytest.fixture(scope="module")
def tiny_llama():
    model = hf_tiny_model("llama", 0, CONFIG)
    return gguf_metadata("llama", model), gguf_tensors("llama", model)


def write_pair(folder, metadata, tensors, ggml_type: GGMLType):
    """The model with every linear (2-D tensors but the embeddings) as random `ggml_type` blocks, and the same
    model with those weights decoded by the gguf package and stored as F32."""
    paths = folder / f"{ggml_type.name}.gguf", folder / f"{ggml_type.name}-dense.gguf"
    with GGUFWriter(paths[0]) as quant, GGUFWriter(paths[1]) as dense:
        for key, value, vtype in metadata:
            for w in (quant, dense):
                w.add_field(key, value, vtype, _ITEM_TYPES.get(key))
        for i, (name, t) in enumerate(tensors.items()):
            t = t.detach().float().contiguous()
            if t.dim() != 2 or name == "token_embd.weight":
                data = t.numpy().reshape(-1, t.shape[-1]) if t.dim() == 2 else t.numpy()
                for w in (quant, dense):
                    w.add_tensor(name, data, GGMLType.F32, tuple(t.shape))
                continue
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(ggml_type))]
            n_blocks = t.numel() // block
            raw = random_blocks(ggml_type, n_blocks, seed=i, moderate=True).reshape(t.shape[0], -1)
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(ggml_type))).astype(np.float32)
            quant.add_tensor(name, raw, ggml_type, tuple(t.shape))
            dense.add_tensor(name, np.ascontiguousarray(values.reshape(t.shape)), GGMLType.F32, tuple(t.shape))
    return paths


@pytest.mark.parametrize("ggml_type", NEW_TYPES, ids=lambda t: t.name)
def test_model_in_new_type_matches_dense_and_trains(tmp_path, tiny_llama, ggml_type):
    quant_path, dense_path = write_pair(tmp_path, *tiny_llama, ggml_type)
    model, dense = load_model(quant_path), load_model(dense_path)
    linears = [lin for blk in model.blocks for lin in blk.linears.values()]
    assert len(linears) == 7 and all(isinstance(lin, FrozenQuantLinear) for lin in linears)
    assert {lin._ggml_type for lin in linears} == {int(ggml_type)}  # the output projection is the F32 embedding
    with torch.no_grad():
        got, ref = model.logits(IDS), dense.logits(IDS)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert float(ref.std()) > 0
    assert torch.equal(got, ref)

    # one LoRA step: gradients reach every adapter, the step moves B, and the logits change
    adapters = attach(model, "all", rank=4, alpha=8, mode=Mode.LORA, seed=0)
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
    assert not torch.equal(after, got)
