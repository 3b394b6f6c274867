"""A mixture-of-experts model on the device path: every expert's frozen linear decodes with Triton (the
interpreter on the CPU; on a GPU the model's quantized bytes are resident there), against the eager CPU model:
logits, and the gradients of per-expert and router adapters through one training step."""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.lora import attach  # noqa: E402
from juno_py.models import load_model  # noqa: E402
from tests.kernels.test_dequant_model import CUDA, device_model, rel  # noqa: E402

IDS = [1, 5, 9, 200, 17, 42, 3, 77, 150, 8, 64, 99]


def _adapters(model, experts):
    aset = attach(model, "all,router", rank=2, alpha=4, seed=0, experts=experts)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.1)
    return aset


# the interpreter takes a minute a case on two cores: the GPU runs both, the CPU the per-expert one
@pytest.mark.parametrize("experts", ["per-expert"] + (["shared"] if CUDA else []))
def test_moe_device_path_matches_eager_cpu(tiny_gguf, experts):
    path = tiny_gguf("qwen3moe", GGMLType.Q8_0)
    eager, dev = load_model(path), device_model(path)
    a_eager, a_dev = _adapters(eager, experts), _adapters(dev, experts)
    tokens = torch.tensor([IDS])
    targets = torch.tensor([IDS[1:] + [2]])
    with torch.no_grad():
        want = eager.logits(IDS)
        got = dev.logits(IDS).float().cpu()
    assert rel(got, want) <= 1e-5
    eager.loss(tokens, targets).backward()
    dev.loss(tokens, targets).backward()
    checked = 0
    for (name, p), (_, q) in zip(a_eager.named_parameters(), a_dev.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert rel(q.grad.float().cpu(), p.grad) <= 1e-4, name
            checked += 1
    assert checked > len(list(a_eager.parameters())) // 2
    if CUDA:
        assert next(iter(dev.blocks[0].moe.experts["wup_exps"][0].buffers())).is_cuda
