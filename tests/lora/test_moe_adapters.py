"""Adapters on mixture-of-experts models: one per expert or one shared by a block's experts, the router as a target,
adapter.bin entry names, float64 finite-difference gradients through the routing, playback."""

import pytest
import torch

from juno_py.errors import AdapterMismatch
from juno_py.gguf import GGMLType
from juno_py.lora import AdapterEntry, Mode, attach, detach, load_adapters, read_adapter, write_adapter
from juno_py.lora.format import parse_entry_key, sort_key
from juno_py.models import load_model
from juno_py.testing.tiny_models import sample_ids
from tests.lora.gradient_checks import directional_error, summed_loss


def _model(tiny_gguf, arch="qwen3moe", qtype=GGMLType.Q8_0):
    return load_model(tiny_gguf(arch, qtype))


def _random_adapters(aset, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.3, generator=g)
            ad.lora_A.mul_(3.0)
            if ad.magnitude is not None:
                ad.magnitude.mul_(1 + 0.2 * torch.randn(ad.magnitude.shape, generator=g))


def test_entry_keys_name_the_expert_or_every_expert():
    assert parse_entry_key("3:wup_exps.17") == (3, "wup_exps", 17)
    assert parse_entry_key("3:wup_exps.*") == (3, "wup_exps", None)
    assert parse_entry_key("0:wrouter") == (0, "wrouter", None)
    assert parse_entry_key("0:wq") == (0, "wq", None)
    for bad in ("0:wup_exps", "0:wup_exps.x", "0:wup_exps.01", "0:wq.3", "0:wrouter.*", "0:experts.1"):
        with pytest.raises(ValueError, match="expected '<layer>:<target>'"):
            parse_entry_key(bad)
    keys = ["1:wq", "0:wdown_exps.2", "0:wup_exps.10", "0:wup_exps.*", "0:wup_exps.9", "0:wrouter", "0:wo"]
    assert sorted(keys, key=sort_key) == [
        "0:wo",
        "0:wrouter",
        "0:wup_exps.*",
        "0:wup_exps.9",
        "0:wup_exps.10",
        "0:wdown_exps.2",
        "1:wq",
    ]


def test_attach_per_expert_shared_and_router(tiny_gguf):
    model = _model(tiny_gguf)
    ids = sample_ids(12, seed=4)
    with torch.no_grad():
        before = model.logits(ids)
    aset = attach(model, "all", rank=2, alpha=4)
    n_exp = model.args.n_expert
    assert len(aset.modules) == 2 * (4 + 3 * n_exp)
    assert "1:wdown_exps.7" in aset.modules and "0:wgate" not in aset.modules
    with torch.no_grad():  # B = 0: the outputs are unchanged
        assert torch.equal(model.logits(ids), before)
    detach(model)
    shared = attach(model, "attn,mlp,router", rank=2, alpha=4)
    assert sorted(shared.modules, key=sort_key)[:6] == ["0:wq", "0:wk", "0:wv", "0:wo", "0:wrouter", "0:wgate_exps.0"]
    detach(model)
    shared = attach(model, "mlp", rank=2, alpha=4, experts="shared")
    assert list(shared.modules) == [
        f"{layer}:{t}.*" for layer in (0, 1) for t in ("wgate_exps", "wup_exps", "wdown_exps")
    ]
    ad = shared.adapters["0:wup_exps.*"]
    on_experts = [m.adapters[0] for m in model.blocks[0].moe.experts["wup_exps"]]
    assert all(a is ad for a in on_experts)  # one adapter, played on every expert
    assert shared.n_parameters() == 6 * 2 * (64 + 32)
    with pytest.raises(AdapterMismatch, match="DoRA on experts needs one adapter per expert"):
        attach(model, "experts", mode=Mode.DORA, experts="shared")
    dense = load_model(tiny_gguf("llama"))
    with pytest.raises(AdapterMismatch, match="target wup_exps needs a mixture-of-experts model"):
        attach(dense, "wq,wup_exps")


_loss = summed_loss


FD_CASES = [
    ("qwen3moe", "all,router", "per-expert", Mode.LORA),
    ("qwen3moe", "experts", "per-expert", Mode.DORA),
    ("qwen3moe", "qv,mlp,router", "shared", Mode.LORA),
    ("mixtral", "all,router", "per-expert", Mode.LORA),
    ("gpt-oss", "all,router", "per-expert", Mode.LORA),
    ("gpt-oss", "attn,experts", "per-expert", Mode.DORA),
]


@pytest.mark.parametrize(
    "arch,targets,experts,mode", FD_CASES, ids=[f"{a}-{t}-{e}-{m.name}" for a, t, e, m in FD_CASES]
)
def test_finite_difference_gradients_float64(tiny_gguf, arch, targets, experts, mode, monkeypatch):
    model = _model(tiny_gguf, arch).set_activation_dtype(torch.float64)
    aset = attach(model, targets, rank=3, alpha=6, mode=mode, seed=1, experts=experts)
    _random_adapters(aset)
    for p in aset.parameters():
        p.data = p.data.double()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 200, (2, 9), generator=g)
    targets_ = torch.randint(3, 200, (2, 9), generator=g)
    loss = _loss(model, tokens, targets_)
    loss.backward()
    for mod in aset.modules.values():
        if mod.dora is not None:
            mod.dora_scale(torch.float64)
            monkeypatch.setattr(mod, "norm_is_cached", lambda dtype=torch.float32: True)
    h = 1e-6
    checked: set[tuple[int, str]] = set()
    with torch.no_grad():
        # one adapter per expert trains as one stack per projection: an expert no token chose has a zero row
        for name, p in aset.named_parameters():
            layer, where = name.rsplit(".", 1)[0].split(":")
            rel, numeric, analytic = directional_error(p, lambda: _loss(model, tokens, targets_), g, h)
            assert rel <= 1e-4, (name, numeric, analytic)
            checked.add((int(layer), where.split(".")[0]))
    # every target of every block had its gradients checked
    assert checked == {parse_entry_key(k)[:2] for k in aset.adapters}


@pytest.mark.parametrize("experts", ["per-expert", "shared"])
def test_saved_adapter_plays_back(tiny_gguf, tmp_path, experts):
    model = _model(tiny_gguf)
    aset = attach(model, "all,router", rank=2, alpha=4, seed=3, experts=experts)
    _random_adapters(aset, seed=5)
    ids = sample_ids(20, seed=7)
    with torch.no_grad():
        want = model.logits(ids)
        detach(model)
        base = model.logits(ids)
    assert (want - base).abs().max() > 1e-2  # the adapters change the outputs
    path = aset.save(tmp_path / "moe.bin")
    _, entries = read_adapter(path)
    keys = [e.key for e in entries]
    assert "1:wrouter" in keys
    assert ("0:wup_exps.*" in keys) == (experts == "shared") and ("0:wup_exps.3" in keys) == (experts != "shared")
    e = next(e for e in entries if e.target == "wdown_exps")
    assert (e.in_dim, e.out_dim) == (32, 64) and e.on_experts
    assert e.fingerprint.dims == (32, 64, 8)  # the whole 3-D tensor, GGUF order
    fresh = _model(tiny_gguf)
    load_adapters(fresh, [str(path)])
    with torch.no_grad():
        got = fresh.logits(ids)
    assert (got - want).abs().max().item() <= 1e-5


def test_shared_entry_equals_the_same_adapter_on_each_expert(tiny_gguf, tmp_path):
    model = _model(tiny_gguf)
    aset = attach(model, "wup_exps", rank=2, alpha=4, seed=3, experts="shared")
    _random_adapters(aset, seed=2)
    shared = aset.save(tmp_path / "shared.bin")
    _, entries = read_adapter(shared)
    spread = [
        AdapterEntry(f"{e.layer}:{e.target}.{x}", e.A, e.B, e.alpha, fingerprint=e.fingerprint)
        for e in entries
        for x in range(model.args.n_expert)
    ]
    per_expert = write_adapter(tmp_path / "spread.bin", spread)
    ids = sample_ids(20, seed=8)
    with torch.no_grad():
        load_adapters(model, [str(shared)])
        a = model.logits(ids)
        load_adapters(model, [str(per_expert)])
        b = model.logits(ids)
        load_adapters(model, [f"{shared}:0.5", f"{per_expert}:0.5"])  # both summed, half each: the same again
        c = model.logits(ids)
    assert (a - b).abs().max().item() <= 1e-6 and (a - c).abs().max().item() <= 1e-5


def test_playback_refuses_entries_the_model_lacks(tiny_gguf, tmp_path):
    model = _model(tiny_gguf)
    A, B = torch.zeros(2, 64).numpy(), torch.zeros(32, 2).numpy()
    bad = write_adapter(tmp_path / "bad.bin", [AdapterEntry("0:wup_exps.8", A, B, 4.0)])
    with pytest.raises(AdapterMismatch, match=r"expert 8 does not exist, the model has 8 experts"):
        load_adapters(model, [str(bad)])
    dense_mlp = write_adapter(tmp_path / "dense.bin", [AdapterEntry("0:wup", A, B, 4.0)])
    with pytest.raises(AdapterMismatch, match=r"block 0 has no wup \(its targets: wq, wk, wv, wo, wrouter, wgate_exps"):
        load_adapters(model, [str(dense_mlp)])
    dense = load_model(tiny_gguf("llama"))
    with pytest.raises(AdapterMismatch, match="block 0 has no wup_exps"):
        load_adapters(dense, [str(bad)])
