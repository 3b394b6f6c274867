"""Exports of adapters on mixture-of-experts models.

PEFT: attention, router and experts (one adapter per expert, or one shared by the experts) through PEFT's
`target_parameters`; transformers' Qwen3MoeForCausalLM, MixtralForCausalLM and GptOssForCausalLM holding the same
weights, with the folder loaded by `PeftModel.from_pretrained`, give juno-py's playback logits. DoRA on the router
or the experts is refused in one line, writing nothing; our PEFT import refuses router and expert modules.
llama.cpp adapters carry the router (a 2-D tensor) and back; their expert entries are refused."""

import json

import pytest
import torch

from juno_py.exchange import export_gguf_lora, export_peft, import_gguf_lora, import_peft
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.lora import Mode, Scaling, attach, read_adapter, write_adapter
from juno_py.merge.targets import MergeError
from juno_py.models import load_model
from juno_py.testing.tiny_models import hf_model_from_gguf, sample_ids
from tests.merge.helpers import playback_logits

BOUND = 2e-5  # fp32; the models agree to about 1e-6 with and without adapters
# PEFT checks rank_pattern / alpha_pattern keys against the adapted modules only and calls a parameter's key
# ignored, though it applies it (the ranks load and the logits agree)
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
N_EXPERT = {"qwen3moe": 8, "mixtral": 4, "gpt-oss": 4}
ROUTER = {"qwen3moe": "mlp.gate", "mixtral": "mlp.gate", "gpt-oss": "mlp.router"}


def _adapter(base_path, out, targets, experts="per-expert", layers=None, **config):
    model = load_model(base_path)
    config = {"rank": 2, "alpha": 4.0, "seed": 1, **config}
    aset = attach(model, targets, experts=experts, layers=layers, **config)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(config["seed"] + 1))
    return aset.save(out)


def _peft_and_playback(base, arch, adapter, folder):
    """(logits of transformers + PEFT loading `folder`, juno-py's playback of `adapter`, the base's logits)."""
    from peft import PeftModel

    ids = sample_ids(20, seed=3)
    hf = hf_model_from_gguf(base, arch)
    with torch.no_grad():
        plain = hf(torch.tensor([ids])).logits[0]
        got = PeftModel.from_pretrained(hf, str(folder)).eval()(torch.tensor([ids])).logits[0]
    return got, playback_logits(base, adapter, ids), plain


def _tensors(folder):
    from safetensors.numpy import load_file

    prefix = "base_model.model.model.layers."
    return {k[len(prefix) :]: v for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt-oss"])
@pytest.mark.parametrize("experts", ["per-expert", "shared"])
def test_peft_export_of_router_and_experts_reproduces_playback(tiny_gguf, tmp_path, arch, experts):
    base = tiny_gguf(arch, GGMLType.Q8_0)
    adapter = _adapter(base, tmp_path / "a.bin", "attn,router,experts", experts)
    folder = export_peft(base, adapter, tmp_path / "peft")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"] and cfg["use_dora"] is False
    parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", f"{ROUTER[arch]}.weight"]
    assert cfg["target_parameters"] == sorted(parameters)
    # gate and up: one pair of rank 2 + 2 per expert (gate_up_proj); down, router, attention: rank 2
    layers = range(3 if arch == "gpt-oss" else 2)
    assert cfg["r"] == 2 and cfg["rank_pattern"] == {f"model.layers.{i}.mlp.experts.gate_up_proj": 4 for i in layers}
    n, d = N_EXPERT[arch], 64
    ff = {"qwen3moe": 32, "mixtral": 64, "gpt-oss": 32}[arch]
    t = _tensors(folder)
    # PEFT nests a module's wrappers: gate_up_proj (registered first) inside down_proj's, one base_layer deeper
    assert t["0.mlp.experts.base_layer.lora_A.weight"].shape == (n * 4, d)
    assert t["0.mlp.experts.base_layer.lora_B.weight"].shape == (2 * ff, 4 * n)
    assert t["0.mlp.experts.lora_A.weight"].shape == (n * 2, ff)
    assert t["0.mlp.experts.lora_B.weight"].shape == (d, 2 * n)
    assert t[f"0.{ROUTER[arch]}.lora_A.weight"].shape == (2, d) and t[f"0.{ROUTER[arch]}.lora_B.weight"].shape == (n, 2)
    got, want, plain = _peft_and_playback(base, arch, adapter, folder)
    assert (want - plain).abs().max() > 0.5  # the adapter changes the logits
    assert (got - want).abs().max().item() <= BOUND


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt-oss"])
def test_peft_export_of_mixed_expert_adapters_is_exact(tiny_gguf, tmp_path, arch):
    """Shared and per-expert entries on one projection, experts left out, ranks, alphas and scalings that differ
    between parts, a layer with only one expert parameter adapted (no nesting)."""
    base = tiny_gguf(arch, GGMLType.Q8_0)
    parts = [
        _adapter(base, tmp_path / "1.bin", "wgate_exps", "shared", layers=[0]),
        _adapter(base, tmp_path / "2.bin", "wgate_exps,wup_exps,wdown_exps", layers=[0], rank=3, alpha=5.0, seed=2),
        _adapter(base, tmp_path / "3.bin", "wdown_exps,router", layers=[1], rank=1, alpha=3.0, seed=3),
        _adapter(base, tmp_path / "4.bin", "wq", rank=4, alpha=8.0, seed=4, scaling=Scaling.RSLORA),
    ]
    left_out = {"0:wgate_exps.1", "0:wup_exps.2", "0:wdown_exps.0", "1:wdown_exps.3"}
    entries = [e for p in parts for e in read_adapter(p)[1] if e.key not in left_out]
    adapter = write_adapter(tmp_path / "a.bin", entries)
    folder = export_peft(base, adapter, tmp_path / "peft")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == sorted(
        ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
        + ["model.layers.1.mlp.experts.down_proj", f"model.layers.1.{ROUTER[arch]}.weight"]
    )
    t = _tensors(folder)
    assert t["0.mlp.experts.base_layer.lora_A.weight"].shape[0] == N_EXPERT[arch] * 8  # shared 2 + gate 3 + up 3
    assert t["1.mlp.experts.lora_A.weight"].shape[0] == N_EXPERT[arch] * 1
    assert not t["1.mlp.experts.lora_B.weight"][:, 3].any()  # expert 3 of layer 1 adapts nothing
    got, want, plain = _peft_and_playback(base, arch, adapter, folder)
    assert (want - plain).abs().max() > 0.5
    assert (got - want).abs().max().item() <= BOUND


@pytest.mark.parametrize("targets,first", [("qv,experts", "0:wgate_exps.0"), ("router", "0:wrouter")])
def test_peft_export_refuses_dora_on_the_router_or_experts(tiny_gguf, tmp_path, targets, first):
    base = tiny_gguf("qwen3moe", GGMLType.Q8_0)
    adapter = _adapter(base, tmp_path / "d.bin", targets, mode=Mode.DORA)
    with pytest.raises(MergeError) as err:
        export_peft(base, adapter, tmp_path / "peft")
    message = str(err.value)
    assert message.startswith(f"{adapter}: entry '{first}' is DoRA on a mixture-of-experts router or expert")
    assert "LoRA only" in message and "\n" not in message and len(message) <= 500
    assert not (tmp_path / "peft").exists()


def test_peft_import_refuses_router_and_expert_modules(tiny_gguf, tmp_path):
    base = tiny_gguf("gpt-oss", GGMLType.Q8_0)
    folder = export_peft(base, _adapter(base, tmp_path / "a.bin", "qv,experts"), tmp_path / "peft")
    with pytest.raises(MergeError, match=r"module 'model.layers.0.mlp.experts': a mixture-of-experts router or") as err:
        import_peft(base, folder, tmp_path / "back.bin")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "back.bin").exists()


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
def test_expert_entries_are_refused_by_the_llama_cpp_export(tiny_gguf, tmp_path, arch, experts):
    base = tiny_gguf(arch, GGMLType.Q8_0)
    adapter = _adapter(base, tmp_path / "e.bin", "qv,experts", experts)
    first = "0:wgate_exps.0" if experts == "per-expert" else "0:wgate_exps.*"
    with pytest.raises(MergeError, match=rf"entry '{first.replace('.', '[.]').replace('*', '[*]')}' adapts experts"):
        export_gguf_lora(base, adapter, tmp_path / "e.gguf")
    assert not (tmp_path / "e.gguf").exists()
