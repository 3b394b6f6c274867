"""One adapter per expert held as one stack per projection and block (`ExpertStack`): the same initial values, losses,
gradients, optimizer steps and adapter.bin bytes as separate tensors per expert; a parameter count that does not
grow with the experts; expert views that follow the stack's values, dtype and loaded state, one gradient node per
stack."""

import json

import numpy as np
import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.lora import (
    AdaptedLinear,
    AdapterSet,
    ExpertAdapter,
    ExpertStack,
    LoraAdapter,
    Mode,
    attach,
    detach,
    load_adapters,
    model_targets,
    parse_targets,
    read_adapter,
    write_adapter,
)
from juno_py.lora.adapters import AdapterConfig
from juno_py.lora.format import encode_adapter, parse_entry_key
from juno_py.metrics import MetricsRecorder
from juno_py.models import load_model
from juno_py.models.layout import EXPERT_TARGETS
from juno_py.testing.records import write_jsonl
from juno_py.train.data import load_dataset
from juno_py.train.loop import TrainConfig, train
from juno_py.train.optim import build_optimizer


def _path(tiny_gguf, arch="qwen3moe", **config):
    return tiny_gguf(arch, GGMLType.Q8_0, **({"config": config} if config else {}))


def _attached(path, targets="all,router", mode=Mode.LORA, expert_path="loop", seed=1):
    model = load_model(path)
    aset = attach(model, targets, rank=3, alpha=6, mode=mode, seed=seed)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # B off zero, so every factor has a gradient
        for p in aset.parameters():
            if p.dim() >= 2 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    for blk in model.blocks:
        blk.moe.expert_path = expert_path
    return model, aset


def _unstacked(model, aset):
    """The same adapters held as separate tensors: each expert's A, B (and m) a LoraAdapter of its own."""
    modules = {}
    for key, mod in aset.modules.items():
        ad = mod.adapters[0]
        if isinstance(ad, ExpertAdapter):
            own = LoraAdapter(mod.in_features, mod.out_features, ad.config, magnitude=ad.magnitude)
            with torch.no_grad():
                own.lora_A.copy_(ad.lora_A)
                own.lora_B.copy_(ad.lora_B)
            layer, target, e = parse_entry_key(key)
            mod = AdaptedLinear(mod.base, [own], name=key)
            model.set_linear(layer, target, mod, e)
        modules[key] = mod
    for blk in model.blocks:
        blk.moe.adapter_stacks.clear()
    out = AdapterSet(model, modules)
    for p in out.parameters():
        p.requires_grad_(True)
    return out


def _expert_values(aset, what):
    """Per adapter key: its A, B and m (`what` "value") or their gradients ("grad"; a stacked expert's is its row
    of the stack's, an expert without one zeros)."""
    out = {}
    for key, ad in aset.adapters.items():
        names = ["lora_A", "lora_B"] + (["magnitude"] if ad.magnitude is not None else [])
        for name in names:
            if what == "value":
                out[key, name] = getattr(ad, name).detach().clone()
            elif isinstance(ad, ExpertAdapter):
                grad = getattr(ad.stack, name).grad
                out[key, name] = None if grad is None else grad[ad.index].clone()
            else:
                out[key, name] = getattr(ad, name).grad
        for k in [k for k in out if k[0] == key and out[k] is None]:
            out[k] = torch.zeros_like(getattr(ad, k[1]))
    return out


def test_initial_values_are_those_of_separate_adapters(tiny_gguf):
    for arch, targets, mode in (("qwen3moe", "all,router", Mode.LORA), ("gpt-oss", "attn,experts", Mode.DORA)):
        model = load_model(_path(tiny_gguf, arch))
        config = AdapterConfig(rank=3, alpha=6, mode=mode)
        gen = torch.Generator().manual_seed(7)
        want = {}
        for ref in model.targets(model_targets(model, parse_targets(targets))):
            mag = ref.module.row_norms_sq().sqrt() if mode == Mode.DORA else None
            key = f"{ref.layer}:{ref.target}" + ("" if ref.expert is None else f".{ref.expert}")
            want[key] = LoraAdapter(ref.module.in_features, ref.module.out_features, config, gen, mag)
        aset = attach(model, targets, config=config, seed=7)
        assert set(aset.adapters) == set(want)
        for key, ad in aset.adapters.items():
            assert isinstance(ad, ExpertAdapter) == ("_exps." in key)
            assert torch.equal(ad.lora_A, want[key].lora_A), key
            assert torch.equal(ad.lora_B, want[key].lora_B), key
            if mode == Mode.DORA:
                assert torch.equal(ad.magnitude, want[key].magnitude), key


CASES = [
    ("qwen3moe", "all,router", Mode.LORA, "loop"),
    ("qwen3moe", "all,router", Mode.LORA, "grouped"),
    ("gpt-oss", "attn,experts", Mode.LORA, "grouped"),
    ("gpt-oss", "attn,experts", Mode.DORA, "loop"),
]


@pytest.mark.parametrize("arch,targets,mode,expert_path", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_stacked_experts_train_as_separate_tensors(tiny_gguf, arch, targets, mode, expert_path):
    """Three optimizer steps: the same losses, gradients and weights. Every expert takes tokens in every step here:
    an expert that takes none gets a zero gradient from its stack, which AdamW's moments and weight decay move, where
    a tensor of its own gets none and stays."""
    if expert_path == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    path = _path(tiny_gguf, arch)
    stacked_model, stacked = _attached(path, targets, mode, expert_path)
    separate_model, separate = _attached(path, targets, mode, expert_path)
    separate = _unstacked(separate_model, separate)
    assert len(list(separate.parameters())) > len(list(stacked.parameters()))
    runs = []
    for model, aset in ((stacked_model, stacked), (separate_model, separate)):
        opt = build_optimizer(aset, 1e-2, weight_decay=0.01, plus_ratio=2.0)
        ids = torch.randint(3, 200, (3, 16), generator=torch.Generator().manual_seed(5))
        steps = []
        for step in range(3):
            aset.before_step()
            model.expert_load(reset=True)
            loss = model.loss(ids, ids.roll(-1, 1))
            loss.backward()
            assert all(bool((v > 0).all()) for v in model.expert_load().values())
            grads = _expert_values(aset, "grad")
            opt.step()
            opt.zero_grad()
            aset.after_optimizer_step()
            steps.append((loss.item(), grads, _expert_values(aset, "value")))
        runs.append(steps)
    for (loss, grads, values), (want_loss, want_grads, want_values) in zip(*runs):
        assert loss == pytest.approx(want_loss, rel=1e-6, abs=0)
        assert grads.keys() == want_grads.keys() == values.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], want_grads[k], rtol=1e-5, atol=1e-7, msg=str(k))
            torch.testing.assert_close(values[k], want_values[k], rtol=1e-5, atol=1e-7, msg=str(k))


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
def test_adapter_bin_is_byte_identical_and_loads_back(tiny_gguf, tmp_path, mode):
    path = _path(tiny_gguf, "gpt-oss")
    model, aset = _attached(path, "attn,experts", mode)
    with torch.no_grad():
        for p in aset.parameters():
            p.mul_(1.5)
    stacked = aset.save(tmp_path / "stacked.bin").read_bytes()
    # sharded training's save: the whole tensors by parameter name, a stack's sliced per expert
    whole = {n: p.detach().clone() for n, p in aset.named_parameters()}
    assert encode_adapter(aset.entries(whole)) == stacked
    separate = _unstacked(load_model(path), aset)
    assert separate.save(tmp_path / "separate.bin").read_bytes() == stacked
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.logits(ids)
        played = load_model(path)
        load_adapters(played, [str(tmp_path / "separate.bin")])
        torch.testing.assert_close(played.logits(ids), want, rtol=1e-5, atol=1e-5)


def test_parameter_tensors_do_not_grow_with_the_experts(tiny_gguf):
    counts = {}
    for n_expert in (4, 16):
        model = load_model(_path(tiny_gguf, "qwen3moe", num_experts=n_expert, num_experts_per_tok=2))
        aset = attach(model, "all,router", rank=2, alpha=4)
        params = list(aset.parameters())
        n_layer = len(model.blocks)
        # per block: A and B of q, k, v, o and the router, and one A and one B stack per expert projection
        assert len(params) == n_layer * (2 * 5 + 2 * len(EXPERT_TARGETS))
        assert len(aset.adapters) == n_layer * (5 + len(EXPERT_TARGETS) * n_expert)
        # registered once in the model: what trains is exactly the set's parameters
        assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
        stacks = [m for m in model.modules() if isinstance(m, ExpertStack)]
        assert len(stacks) == n_layer * len(EXPERT_TARGETS) and all(s.lora_A.shape[0] == n_expert for s in stacks)
        counts[n_expert] = aset.n_parameters()
        detach(model)
        assert not any(p.requires_grad for p in model.parameters())
        assert not any(isinstance(m, ExpertStack) for m in model.modules())
    assert counts[16] > counts[4]


def test_expert_views_follow_the_stack(tiny_gguf):
    model, aset = _attached(_path(tiny_gguf), "experts")
    stack = model.blocks[1].moe.adapter_stacks["wup_exps"]
    ads = [aset.adapters[f"1:wup_exps.{e}"] for e in range(stack.n_expert)]
    # one gradient node for all the experts' rows, made anew (not replayed as as_strided) after an in-place change
    for _ in range(2):
        nodes = {id(ad.lora_A.grad_fn) for ad in ads}
        assert len(nodes) == 1 and type(ads[0].lora_A.grad_fn).__name__ == "UnbindBackward0"
        with torch.no_grad():
            stack.lora_A.add_(1.0)
    assert torch.equal(ads[2].lora_B, stack.lora_B[2])
    # the optimizer's in-place step
    model.loss(*[torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(3))] * 2).backward()
    opt = build_optimizer(aset, 0.1)
    before = ads[1].lora_B.detach().clone()
    opt.step()
    assert not torch.equal(ads[1].lora_B, before) and torch.equal(ads[1].lora_B, stack.lora_B[1])
    # a swap of the data (a device or dtype move), and a loaded state
    stack.lora_A.data = stack.lora_A.data.double()
    assert ads[0].lora_A.dtype == torch.float64 and torch.equal(ads[3].lora_A, stack.lora_A[3])
    rows = ads[0].lora_B
    model.blocks[1].moe.to(torch.float64)  # a module move lets go of the views it replaces
    assert stack._rows is None and rows.dtype == torch.float32 and ads[0].lora_B.dtype == torch.float64
    state = {k: torch.full_like(v, 0.5) for k, v in model.blocks[1].moe.adapter_stacks.state_dict().items()}
    model.blocks[1].moe.adapter_stacks.load_state_dict(state)
    assert all(bool((ad.lora_A == 0.5).all()) for ad in ads)
    # the stacked tensors, not views of them, are what the set trains
    assert any(p is stack.lora_A for p in aset.parameters())
    assert "1:wup_exps.lora_A" in dict(aset.named_parameters())


@pytest.mark.parametrize("expert_path", ["loop", "grouped"])
def test_a_training_run_gives_the_losses_of_separate_tensors(tiny_gguf, tmp_path, expert_path):
    """The training loop (`train`) over stacked experts and over the same adapters held apart: the same losses and
    gradient norms step by step, the same adapter.bin at the end."""
    if expert_path == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    path = _path(tiny_gguf)
    facts = [{"Q": f"What is fact {i}?", "A": f"It is number {i * 7}."} for i in range(6)]
    data = write_jsonl(tmp_path / "facts.jsonl", facts)
    runs = []
    for held in ("stacked", "separate"):
        model, aset = _attached(path, "all,router", expert_path=expert_path)
        if held == "separate":
            aset = _unstacked(model, aset)
        examples = load_dataset([data], model.tokenizer, 128)[0]
        events = tmp_path / f"{held}.jsonl"
        cfg = TrainConfig(lr=1e-2, batch_size=6, max_steps=4, epochs=None, seed=2, lora_path=tmp_path / f"{held}.bin")
        rec = MetricsRecorder(events_out=events)
        train(model, aset, examples, cfg, recorder=rec, progress=False, log=lambda s: None)
        rec.close()
        steps = [json.loads(line) for line in events.read_text().splitlines()]
        runs.append([(e["loss"], e["grad_norm"]) for e in steps if e["kind"] == "train_step"])
    assert len(runs[0]) == 4
    for (loss, norm), (want_loss, want_norm) in zip(*runs):
        assert loss == pytest.approx(want_loss, rel=1e-6) and norm == pytest.approx(want_norm, rel=1e-5)
    stacked, separate = (read_adapter(tmp_path / f"{h}.bin")[1] for h in ("stacked", "separate"))
    assert [e.key for e in stacked] == [e.key for e in separate]
    for got, want in zip(stacked, separate):
        np.testing.assert_allclose(got.A, want.A, rtol=1e-5, atol=1e-7, err_msg=got.key)
        np.testing.assert_allclose(got.B, want.B, rtol=1e-5, atol=1e-7, err_msg=got.key)


def test_playback_holds_a_files_experts_as_stacks(tiny_gguf, tmp_path):
    """A file's per-expert entries of a projection that cover every expert play back as the rows of one stack (no
    gradient), which the grouped path multiplies as it is; a projection missing an expert's entry plays tensors of
    its own; two files give two stacks of a target."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    path = _path(tiny_gguf)
    model, aset = _attached(path, "all,router")
    file = aset.save(tmp_path / "a.bin")
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model.logits(ids)
    for expert_path in ("loop", "grouped"):
        played = load_model(path)
        load_adapters(played, [str(file)])
        for blk in played.blocks:
            blk.moe.expert_path = expert_path
        moe = played.blocks[1].moe
        assert set(moe.adapter_stacks) == set(EXPERT_TARGETS)
        assert isinstance(moe.experts["wup_exps"][2].adapters[0], ExpertAdapter)
        assert not any(p.requires_grad for p in played.parameters())
        with torch.no_grad():
            torch.testing.assert_close(played.logits(ids), want, rtol=1e-5, atol=1e-5)
        if expert_path == "grouped":
            assert moe._projection("wup_exps").slots[0].stack is moe.adapter_stacks["wup_exps"]
    _, entries = read_adapter(file)
    write_adapter(tmp_path / "partial.bin", [e for e in entries if e.key != "1:wup_exps.3"])
    played = load_model(path)
    load_adapters(played, [str(tmp_path / "partial.bin")])
    moe = played.blocks[1].moe
    assert set(moe.adapter_stacks) == {"wgate_exps", "wdown_exps"}
    assert type(moe.experts["wup_exps"][0].adapters[0]) is LoraAdapter
    assert not isinstance(moe.experts["wup_exps"][3], AdaptedLinear)
    both = []
    for expert_path in ("loop", "grouped"):
        played = load_model(path)
        load_adapters(played, [str(file), f"{file}:0.5"])
        assert {"wup_exps", "wup_exps_1"} <= set(played.blocks[0].moe.adapter_stacks)
        for blk in played.blocks:
            blk.moe.expert_path = expert_path
        with torch.no_grad():
            both.append(played.logits(ids))
    torch.testing.assert_close(both[1], both[0], rtol=1e-5, atol=1e-5)
