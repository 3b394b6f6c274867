"""The backends of FrozenQuantLinear: both provide the Protocols of `juno_py.weights.base`, construction picks the one
for where the bytes are, and a device move switches to the other."""

import pytest
import torch
from torch import nn

from juno_py.gguf import GGMLType
from juno_py.testing.blocks import random_rows
from juno_py.weights import (
    ExactProducts,
    FrozenBase,
    FrozenQuantLinear,
    ResidentQuantLinear,
    StreamingQuantLinear,
    has_exact_products,
)

N_OUT, N_IN = 40, 256


def _raw(seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_rows(GGMLType.Q4_K, N_OUT, N_IN, seed=seed))


@pytest.mark.parametrize(
    "dequant,backend",
    [("auto", StreamingQuantLinear), ("torch", StreamingQuantLinear), ("triton", ResidentQuantLinear)],
)
def test_each_backend_provides_both_protocols(dequant, backend):
    lin = FrozenQuantLinear(_raw(), GGMLType.Q4_K, N_IN, torch.randn(N_OUT), dequant=dequant)
    assert type(lin) is backend and lin.resident == (backend is ResidentQuantLinear)
    assert isinstance(lin, FrozenQuantLinear) and isinstance(lin, FrozenBase) and isinstance(lin, ExactProducts)
    assert has_exact_products(lin)
    assert repr(lin).startswith("FrozenQuantLinear(")


def test_other_bases_have_no_exact_products():
    lin = nn.Linear(8, 4)
    assert not isinstance(lin, FrozenBase) and not isinstance(lin, ExactProducts)
    assert not has_exact_products(lin)


def test_from_gguf_builds_the_streaming_backend(layers_gguf):
    from juno_py.testing.blocks import layer_name

    lin = FrozenQuantLinear.from_gguf(layers_gguf, layer_name(GGMLType.Q8_0))
    assert type(lin) is StreamingQuantLinear and isinstance(lin, FrozenBase)


def test_a_parent_module_move_switches_the_backend():
    """`Module.to` reaches the frozen linear through its parent, and the backend follows the bytes' device (the meta
    device: a move that runs on any machine, with no data to decode afterwards)."""
    parent = nn.ModuleDict({"lin": FrozenQuantLinear(_raw(), GGMLType.Q4_K, N_IN)})
    assert type(parent["lin"]) is StreamingQuantLinear
    parent.to("meta")
    lin = parent["lin"]
    assert lin.raw.device.type == "meta" and type(lin) is ResidentQuantLinear and lin.resident
    assert isinstance(lin, FrozenQuantLinear) and isinstance(lin, FrozenBase)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_switches_backend_and_keeps_products():
    raw = _raw(3)
    lin = FrozenQuantLinear(raw, GGMLType.Q4_K, N_IN, torch.randn(N_OUT))
    w = lin.dequantize_rows(0, N_OUT).double()
    x = torch.randn(9, N_IN, generator=torch.Generator().manual_seed(1))
    g = torch.randn(9, N_OUT, generator=torch.Generator().manual_seed(2))
    assert lin.to("cuda") is lin and type(lin) is ResidentQuantLinear and lin.raw.is_cuda
    y = lin.matmul(x.cuda()).cpu().double()
    dx = lin.matmul_transposed(g.cuda()).cpu().double()
    assert float((y - x.double() @ w.T).norm() / (x.double() @ w.T).norm()) <= 1e-5
    assert float((dx - g.double() @ w).norm() / (g.double() @ w).norm()) <= 1e-5
    lin.cpu()
    assert type(lin) is StreamingQuantLinear and lin.raw.device.type == "cpu"
    assert torch.equal(lin.raw, raw) and torch.equal(lin.dequantize_rows(0, N_OUT).double(), w)


def test_setting_dequant_rebinds_the_backend():
    lin = FrozenQuantLinear(_raw(), GGMLType.Q4_K, N_IN)
    lin.dequant = "triton"
    assert type(lin) is ResidentQuantLinear
    lin.dequant = "auto"
    assert type(lin) is StreamingQuantLinear
    with pytest.raises(ValueError, match="dequant"):
        lin.dequant = "cuda"
