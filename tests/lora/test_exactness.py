"""The adapter math, exactly: float64 finite-difference gradients, and playback against dense merged weights."""

import pytest
import torch
from torch import nn

from juno_py.gguf import GGMLType
from juno_py.lora import Mode, attach
from juno_py.models import load_model
from tests.lora.gradient_checks import directional_error, summed_loss

CASES = [("llama", "all"), ("qwen2", "all"), ("qwen3", "all"), ("phi3", "qv"), ("phi3", "all"), ("gemma3", "all")]


def _model(tiny_gguf, arch):
    return load_model(tiny_gguf(arch, GGMLType.Q8_0)).set_activation_dtype(torch.float64)


def _random_adapters(aset, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.3, generator=g)
            ad.lora_A.mul_(3.0)
            if ad.magnitude is not None:
                ad.magnitude.mul_(1 + 0.2 * torch.randn(ad.magnitude.shape, generator=g))


_loss = summed_loss


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
@pytest.mark.parametrize("arch,targets", CASES)
def test_finite_difference_gradients_float64(tiny_gguf, arch, targets, mode, monkeypatch):
    model = _model(tiny_gguf, arch)
    aset = attach(model, targets, rank=3, alpha=6, mode=mode, seed=1)
    _random_adapters(aset)
    for p in aset.parameters():
        p.data = p.data.double()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 200, (2, 9), generator=g)
    targets_ = torch.randint(3, 200, (2, 9), generator=g)
    loss = _loss(model, tokens, targets_)
    loss.backward()
    # the DoRA norm is detached: finite differences hold it at its current value (the surrogate), the layer told
    # that its cached norm stays valid while A and B move
    for mod in aset.modules.values():
        if mod.dora is not None:
            mod.dora_scale(torch.float64)
            monkeypatch.setattr(mod, "norm_is_cached", lambda dtype=torch.float32: True)
    h = 1e-6
    worst = 0.0
    with torch.no_grad():
        for key, ad in aset.adapters.items():
            for name, p in ad.named_parameters():
                rel, numeric, analytic = directional_error(p, lambda: _loss(model, tokens, targets_), g, h)
                worst = max(worst, rel)
                assert rel <= 1e-4, (key, name, numeric, analytic)
    assert worst < 1e-4


class DenseLinear(nn.Module):
    """A plain float64 linear: the 'merged' weights the adapter must equal."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x):
        y = x.to(torch.float64) @ self.weight.T
        return y + self.bias.double() if self.bias is not None else y


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
@pytest.mark.parametrize("arch,targets", CASES)
def test_playback_equals_dense_merged_weights(tiny_gguf, arch, targets, mode):
    path = tiny_gguf(arch, GGMLType.Q8_0)
    model = _model(tiny_gguf, arch)
    aset = attach(model, targets, rank=3, alpha=6, mode=mode, seed=1)
    _random_adapters(aset)
    ids = list(range(3, 40))
    with torch.no_grad():
        adapted = model.logits(ids)
        merged = load_model(path).set_activation_dtype(torch.float64)
        for key, mod in aset.modules.items():
            layer, target = key.split(":")
            ad = mod.adapters[0]
            W = mod.base.dequantize_rows(0, mod.out_features).double()
            Wp = W + ad.scale * ad.lora_B.double() @ ad.lora_A.double()
            if mode == Mode.DORA:
                Wp = (ad.magnitude.double() / Wp.norm(dim=1))[:, None] * Wp
            merged.blocks[int(layer)].linears[target] = DenseLinear(Wp, mod.base.bias)
        dense = merged.logits(ids)
    rel = (adapted - dense).norm() / dense.norm()
    assert (adapted - load_model(path).set_activation_dtype(torch.float64).logits(ids)).abs().max() > 1e-3
    assert rel <= 1e-9, float(rel)
