"""Exports of adapters on mixture-of-experts models: the router travels as a llama.cpp adapter (a 2-D tensor) and
back; expert entries and PEFT exports of router or expert entries are refused in one line, writing nothing."""

import pytest
import torch

from juno_py.exchange import export_gguf_lora, export_peft, import_gguf_lora
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.lora import attach, read_adapter
from juno_py.merge.targets import MergeError
from juno_py.models import load_model


def _adapter(base_path, out, targets, experts="per-expert"):
    model = load_model(base_path)
    aset = attach(model, targets, rank=2, alpha=4.0, seed=1, experts=experts)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    return aset.save(out)


@pytest.mark.parametrize("arch,n_expert", [("qwen3moe", 8), ("gpt-oss", 4)])
def test_router_and_attention_round_trip_through_a_llama_cpp_adapter(tiny_gguf, tmp_path, arch, n_expert):
    base = tiny_gguf(arch, GGMLType.Q8_0)
    adapter = _adapter(base, tmp_path / "a.bin", "attn,router")
    out = export_gguf_lora(base, adapter, tmp_path / "a.gguf")
    with GGUFFile(out) as f:
        assert f.tensors["blk.1.ffn_gate_inp.weight.lora_a"].shape == (2, 64)
        assert f.tensors["blk.1.ffn_gate_inp.weight.lora_b"].shape == (n_expert, 2)
    back = import_gguf_lora(base, out, tmp_path / "back.bin")
    want, got = read_adapter(adapter)[1], read_adapter(back)[1]
    assert [e.key for e in got] == [e.key for e in want]
    for x, y in zip(want, got):
        assert (abs(x.scale - y.scale) < 1e-6) and torch.allclose(
            torch.from_numpy(y.B @ y.A) * y.scale, torch.from_numpy(x.B @ x.A) * x.scale, atol=1e-6
        ), x.key


@pytest.mark.parametrize("arch,experts", [("mixtral", "per-expert"), ("mixtral", "shared"), ("gpt-oss", "per-expert")])
def test_expert_entries_are_refused_by_both_exports(tiny_gguf, tmp_path, arch, experts):
    base = tiny_gguf(arch, GGMLType.Q8_0)
    adapter = _adapter(base, tmp_path / "e.bin", "qv,experts", experts)
    first = "0:wgate_exps.0" if experts == "per-expert" else "0:wgate_exps.*"
    with pytest.raises(MergeError, match=rf"entry '{first.replace('.', '[.]').replace('*', '[*]')}' adapts experts"):
        export_gguf_lora(base, adapter, tmp_path / "e.gguf")
    assert not (tmp_path / "e.gguf").exists()
    with pytest.raises(MergeError, match="adapts a mixture-of-experts router or expert: PEFT export covers") as err:
        export_peft(base, adapter, tmp_path / "peft")
    assert "\n" not in str(err.value) and len(str(err.value)) <= 500
    assert not (tmp_path / "peft").exists()
    router = _adapter(base, tmp_path / "r.bin", "router")
    with pytest.raises(MergeError, match=r"entry '0:wrouter' adapts a mixture-of-experts router"):
        export_peft(base, router, tmp_path / "peft")
