"""Adapters on the quantized base: identity at init, the factored DoRA norm, playback and the mismatch policy."""

import warnings

import numpy as np
import pytest
import torch

from juno_py.errors import AdapterMismatch
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.kernels.dora import factored_row_norm
from juno_py.lora import (
    AdapterConfig,
    Mode,
    attach,
    detach,
    load_adapters,
    parse_adapter_spec,
    parse_targets,
    read_adapter,
    write_adapter,
)
from juno_py.lora.adapters import AdaptedLinear, LoraAdapter
from juno_py.lora.format import Fingerprint
from juno_py.models import load_model
from juno_py.testing.blocks import random_rows
from juno_py.weights import FrozenQuantLinear
from tests.weights.memory_probe import LargestTensor

ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gemma3"]


def perturb(aset, seed=1, b_std=0.05, m_spread=0.05):
    """Random non-zero B (and m around its initial value) so an adapter has an effect."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, b_std, generator=g)
            if ad.magnitude is not None:
                ad.magnitude.mul_(1 + m_spread * torch.randn(ad.magnitude.shape, generator=g))


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_adapter_leaves_logits_unchanged(tiny_gguf, arch, mode):
    model = load_model(tiny_gguf(arch, GGMLType.Q8_0))
    ids = list(range(3, 19))
    with torch.no_grad():
        base = model.logits(ids)
        aset = attach(model, "all", rank=4, alpha=8, mode=mode)
        adapted = model.logits(ids)
    assert len(aset.modules) == 7 * len(model.blocks)
    assert (adapted - base).abs().max() <= 1e-5


def test_attach_trains_only_adapters(tiny_gguf):
    model = load_model(tiny_gguf("qwen2", GGMLType.Q8_0))
    aset = attach(model, "qv", rank=2, mode=Mode.DORA)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in aset.parameters()}
    groups = aset.groups()
    assert len(groups["A"]) == len(groups["B"]) == len(groups["magnitude"]) == 2 * len(model.blocks)
    opt_groups = {g["name"]: g for g in aset.param_groups(1e-3, 0.1, plus_ratio=16)}
    assert [(g["lr"], g["base_lr"], g["weight_decay"]) for g in opt_groups.values()] == [
        (1e-3, 1e-3, 0.1),
        (1.6e-2, 1.6e-2, 0.0),
        (1e-3, 1e-3, 0.0),
    ]
    assert all(opt_groups[k]["params"] == groups[k] for k in groups)
    detach(model)
    assert not any(isinstance(m, AdaptedLinear) for blk in model.blocks for m in blk.linears.values())


def test_parse_targets_and_specs():
    assert parse_targets("qv") == ("wq", "wv")
    assert parse_targets("q,gate,wdown") == ("wq", "wgate", "wdown")
    assert len(parse_targets("all")) == 7
    with pytest.raises(ValueError, match="unknown target"):
        parse_targets("wx")
    assert parse_adapter_spec("a.bin:0.5") == ("a.bin", 0.5)
    assert parse_adapter_spec("dir:x/a.bin") == ("dir:x/a.bin", 1.0)


# --------------------------------------------------------------------------------------------- factored norm
def _random_layer(ggml_type, n_out, n_in, seed=0):
    return FrozenQuantLinear(random_rows(ggml_type, n_out, n_in, seed), ggml_type, n_in)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F16])
def test_factored_norm_equals_dense_norm(ggml_type):
    base = _random_layer(ggml_type, 300, 512)
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(16, 512, generator=g) * 0.05, torch.randn(300, 16, generator=g) * 0.05
    s = 2.0
    ad = LoraAdapter(512, 300, AdapterConfig(rank=16, alpha=32, mode=Mode.DORA), magnitude=torch.ones(300))
    with torch.no_grad():
        ad.lora_A.copy_(A)
        ad.lora_B.copy_(B)
    lin = AdaptedLinear(base, [ad])
    W = base.dequantize_rows(0, 300).double()
    dense = (W + s * B.double() @ A.double()).norm(dim=1)
    got = lin.weight_row_norm(torch.float64)
    assert ((got - dense).abs() / dense).max() <= 1e-6
    # the same with the pieces given by hand, fp64 throughout
    U = W @ A.double().T
    exact = factored_row_norm((W * W).sum(1), U, A.double(), B.double(), s, torch.float64)
    assert ((exact - dense).abs() / dense).max() <= 1e-12


def test_factored_norm_never_builds_a_dense_product():
    n = 4096
    base = _random_layer(GGMLType.Q4_0, n, n)
    ad = LoraAdapter(n, n, AdapterConfig(rank=64, alpha=64, mode=Mode.DORA), magnitude=torch.ones(n))
    with torch.no_grad():
        ad.lora_B.normal_(0, 0.01)
    lin = AdaptedLinear(base, [ad])
    lin.base_row_norms_sq()  # computed once at load, outside the measured step
    with LargestTensor() as largest:
        lin.weight_row_norm()
    dense = n * n * 4
    assert largest.nbytes <= dense // 8, (largest.nbytes, largest.op)


def test_dora_scale_cached_while_frozen_and_refreshed_when_trained():
    base = _random_layer(GGMLType.Q8_0, 64, 64)
    ad = LoraAdapter(64, 64, AdapterConfig(rank=4, mode=Mode.DORA), magnitude=base.row_norms_sq().sqrt())
    lin = AdaptedLinear(base, [ad])
    g1 = lin.dora_scale()
    key = lin._g_cache[0]
    lin.dora_scale()
    assert lin._g_cache[0] == key  # unchanged adapter: no recomputation
    with torch.no_grad():
        ad.lora_B.add_(0.1)
    g2 = lin.dora_scale()
    assert lin._g_cache[0] != key and not torch.equal(g1, g2)


def _bf16_playback(mode):
    """An adapted Q8_0 layer in eval mode with B ≠ 0, bf16 activations, and `afresh()`: the output of a layer built
    anew from the adapter as it is now."""
    base = _random_layer(GGMLType.Q8_0, 48, 64)
    ad = LoraAdapter(
        64, 48, AdapterConfig(rank=4, mode=mode), magnitude=base.row_norms_sq().sqrt() if mode == Mode.DORA else None
    )
    with torch.no_grad():
        ad.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).bfloat16()

    def afresh():
        return AdaptedLinear(base, [LoraAdapter.from_entry(ad.to_entry("w"))]).eval()(x)

    return AdaptedLinear(base, [ad]).eval(), ad, x, afresh


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
def test_playback_keeps_casts_and_g_until_the_adapter_changes(mode):
    """bf16 playback without gradients casts A and B (and forms g) once and reuses them while the adapter is
    unchanged; an in-place change of A, B or m is seen at the next call (the output of a layer built afresh from the
    changed adapter, bit for bit); with gradients nothing is kept and the output stays connected to the adapter."""
    dora = mode == Mode.DORA
    lin, ad, x, afresh = _bf16_playback(mode)

    with torch.no_grad():
        y = lin(x)
        kept = ad._factors_kept
        assert kept[1].dtype == torch.bfloat16 and torch.equal(lin(x), y) and ad._factors_kept is kept
        assert torch.equal(y, afresh())
        changes = [lambda: ad.lora_A.mul_(1.5), lambda: ad.lora_B.add_(0.01)]
        changes += [lambda: ad.magnitude.mul_(1.1)] if dora else []
        for change in changes:
            change()
            y2 = lin(x)
            assert torch.equal(y2, afresh()) and not torch.equal(y2, y)
            y = y2
    y = lin(x)  # gradients on: the casts are the parameters' own
    y.float().sum().backward()
    assert ad.lora_A.grad is not None and ad.lora_B.grad is not None
    assert not dora or ad.magnitude.grad is not None


@pytest.mark.parametrize("mode", [Mode.LORA, Mode.DORA])
def test_a_fused_optimizer_step_is_seen_once_the_loop_says_so(mode):
    """torch's fused AdamW moves A, B and m without bumping their version counters, which key the playback casts
    (and DoRA's norm and g): `weights_changed`, which the training loop calls after every step, drops them, so a
    validation pass between steps plays the adapter as it is then (bit for bit a layer built afresh from it)."""
    lin, ad, x, afresh = _bf16_playback(mode)
    with torch.no_grad():
        before = lin(x)
    lin.train()
    opt = torch.optim.AdamW(ad.parameters(), lr=1e-2, fused=True)
    lin(x.float().requires_grad_(True)).sum().backward()
    versions = [p._version for p in ad.parameters()]
    opt.step()
    assert [p._version for p in ad.parameters()] == versions  # the premise: no counter moved
    lin.weights_changed()
    lin.eval()
    with torch.no_grad():
        after = lin(x)
        assert torch.equal(after, afresh()) and not torch.equal(after, before)


# ------------------------------------------------------------------------------------------------ playback
def test_saved_adapter_plays_back_identically(tiny_gguf, tmp_path):
    path = tiny_gguf("phi3", GGMLType.Q8_0)
    model = load_model(path)
    aset = attach(model, "qv", rank=4, alpha=8, mode=Mode.DORA, seed=3)
    perturb(aset)
    ids = list(range(5, 25))
    with torch.no_grad():
        trained = model.logits(ids)
    aset.save(tmp_path / "a.bin")
    fresh = load_model(path)
    load_adapters(fresh, [str(tmp_path / "a.bin")])
    with torch.no_grad():
        played = fresh.logits(ids)
    assert torch.equal(trained, played)
    _, entries = read_adapter(tmp_path / "a.bin")
    f = GGUFFile(path)
    assert all(
        e.fingerprint == Fingerprint.of_tensor(f.tensor("blk.0.attn_qkv.weight")) for e in entries if e.layer == 0
    )


def test_several_loras_add_with_their_scales(tiny_gguf, tmp_path):
    path = tiny_gguf("llama", GGMLType.Q4_0)
    ids = list(range(2, 20))
    files = []
    for seed in (1, 2):
        m = load_model(path)
        aset = attach(m, "all", rank=2, alpha=4, seed=seed)
        perturb(aset, seed)
        files.append(aset.save(tmp_path / f"{seed}.bin"))
    model = load_model(path)
    mods = load_adapters(model, [f"{files[0]}:0.5", f"{files[1]}:2"])
    # one linear checked against the formula y = Wx + b + Σ w_i s_i B_i A_i x
    lin = mods["1:wup"]
    x = torch.randn(3, lin.in_features)
    W = lin.base.dequantize_rows(0, lin.out_features)
    expect = x @ W.T
    for w, ad in zip([0.5, 2.0], lin.adapters):
        expect = expect + w * ad.scale * (x @ ad.lora_A.T @ ad.lora_B.T)
    assert torch.allclose(lin(x), expect, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.equal(model.logits(ids), load_model(path).logits(ids))


# ------------------------------------------------------------------------------------------ mismatch policy
@pytest.fixture
def llama_and_adapters(tiny_gguf, tmp_path):
    path = tiny_gguf("llama", GGMLType.Q8_0)
    model = load_model(path)
    lora = attach(model, "qv", rank=2, seed=1)
    lora_path = lora.save(tmp_path / "lora.bin")
    model = load_model(path)
    dora = attach(model, "qv", rank=2, mode=Mode.DORA, seed=1)
    dora_path = dora.save(tmp_path / "dora.bin")
    return path, lora_path, dora_path


def _rewrite(src, dst, change):
    _, entries = read_adapter(src)
    change(entries)
    return write_adapter(dst, entries)


def test_wrong_shape_is_refused_naming_the_entry(llama_and_adapters, tmp_path):
    path, lora_path, _ = llama_and_adapters

    def widen(entries):
        e = entries[0]
        e.A = np.zeros((e.rank, e.in_dim + 1), np.float32)

    bad = _rewrite(lora_path, tmp_path / "bad.bin", widen)
    with pytest.raises(AdapterMismatch, match=r"entry '0:wq'.*does not fit"):
        load_adapters(load_model(path), [str(bad)])


@pytest.mark.parametrize("key,match", [("99:wq", "layer 99 does not exist"), ("0:wx", "expected '<layer>:<target>'")])
def test_unknown_keys_are_refused(llama_and_adapters, tmp_path, key, match):
    path, lora_path, _ = llama_and_adapters

    def rename(entries):
        entries[-1].key = key

    bad = _rewrite(lora_path, tmp_path / "bad.bin", rename)
    with pytest.raises(AdapterMismatch, match=match):
        load_adapters(load_model(path), [str(bad)])


def _other_base(entries):
    for e in entries:
        e.fingerprint = Fingerprint(e.fingerprint.ggml_type, e.fingerprint.dims, bytes(32))


def test_lora_fingerprint_mismatch_warns_and_loads(llama_and_adapters, tmp_path):
    path, lora_path, _ = llama_and_adapters
    other = _rewrite(lora_path, tmp_path / "other.bin", _other_base)
    with pytest.warns(UserWarning, match="fingerprint differs"):
        mods = load_adapters(load_model(path), [str(other)])
    assert len(mods) == 2 * 2


def test_dora_fingerprint_mismatch_is_refused_unless_forced(llama_and_adapters, tmp_path):
    path, _, dora_path = llama_and_adapters
    other = _rewrite(dora_path, tmp_path / "other.bin", _other_base)
    with pytest.raises(AdapterMismatch, match="DoRA"):
        load_adapters(load_model(path), [str(other)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_adapters(load_model(path), [str(other)], force=True)


@pytest.mark.parametrize("specs", [["{dora}:0.5"], ["{dora}", "{lora}"]])
def test_dora_plays_alone_at_scale_one(llama_and_adapters, specs):
    path, lora_path, dora_path = llama_and_adapters
    specs = [s.format(dora=dora_path, lora=lora_path) for s in specs]
    with pytest.raises(AdapterMismatch, match="alone and at scale 1"):
        load_adapters(load_model(path), specs)
