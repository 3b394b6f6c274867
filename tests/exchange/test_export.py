"""PEFT and GGUF-LoRA exports: transformers + PEFT reproduce our playback, llama.cpp's file format and scale
rules hold (read back with the `gguf` package), and our importers round-trip both exactly."""

import json

import numpy as np
import pytest
import torch

from juno_py.errors import JunoError
from juno_py.exchange import export_gguf_lora, export_peft, import_gguf_lora, import_peft
from juno_py.exchange.gguf_lora import llama_cpp_scale
from juno_py.exchange.peft import gguf_rows, hf_rows
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.lora import Mode, Scaling, read_adapter
from juno_py.lora.format import sort_key
from juno_py.merge.targets import ModelTargets
from juno_py.testing.tiny_models import llama_permute, sample_ids
from tests.merge.helpers import combine, make_adapter, playback_logits


def same_entries(a, b):
    _, ea = read_adapter(a)
    _, eb = read_adapter(b)
    assert [e.key for e in ea] == [e.key for e in eb]
    for x, y in zip(ea, eb):
        assert np.array_equal(x.A, y.A) and np.array_equal(x.B, y.B), x.key
        assert (x.alpha, x.scaling, x.init, x.mode) == (y.alpha, y.scaling, y.init, y.mode)
        assert x.fingerprint == y.fingerprint
        assert (x.magnitude is None and y.magnitude is None) or np.array_equal(x.magnitude, y.magnitude)


def peft_logits(base_path, folder, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base_path.parent), gguf_file=base_path.name, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(folder)).eval()
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0]


def test_llama_row_permutation_inverts_the_converter():
    w = torch.randn(4 * 16, 3)
    assert np.array_equal(hf_rows(llama_permute(w, 4).numpy(), 4), w.numpy())
    assert np.array_equal(gguf_rows(w.numpy(), 4), llama_permute(w, 4).numpy())


@pytest.mark.parametrize(
    "arch,mode,targets,knobs",
    [
        ("qwen2", Mode.DORA, "all", {}),  # biases, DoRA
        ("phi3", Mode.LORA, "qv", {}),  # q and v inside the fused qkv_proj
        ("phi3", Mode.DORA, "qv", {}),
        ("llama", Mode.LORA, "all", {}),  # Q/K row permutation
        ("llama", Mode.DORA, "attn", {}),
        ("gemma3", Mode.LORA, "all", {}),
    ],
)
def test_peft_export_reproduces_playback_and_round_trips(tiny_gguf, tmp_path, arch, mode, targets, knobs):
    base = tiny_gguf(arch, GGMLType.Q8_0, **knobs)
    adapter = make_adapter(base, tmp_path / "a.bin", targets=targets, mode=mode)
    folder = export_peft(base, adapter, tmp_path / "peft")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["use_dora"] == (mode == Mode.DORA) and cfg["use_rslora"] is False and cfg["peft_type"] == "LORA"
    ids = sample_ids(20)
    expected = playback_logits(base, adapter, ids)
    assert (peft_logits(base, folder, ids) - expected).abs().max() <= 1e-3
    same_entries(adapter, import_peft(base, folder, tmp_path / "back.bin"))


def test_peft_mixed_ranks_and_scales_use_patterns_and_bake_fused_parts(tiny_gguf, tmp_path):
    base = tiny_gguf("phi3", GGMLType.Q8_0)
    q = make_adapter(base, tmp_path / "q.bin", targets="wq", rank=4, alpha=8, seed=1)
    v = make_adapter(base, tmp_path / "v.bin", targets="wv", rank=2, alpha=8, seed=2)  # other rank and scale
    o = make_adapter(
        base, tmp_path / "o.bin", targets="wo", rank=3, alpha=5, seed=3, scaling=Scaling.RSLORA, layers=[1]
    )
    adapter = combine(tmp_path / "a.bin", q, v, o)
    folder = export_peft(base, adapter, tmp_path / "peft")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(
        ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj"]
    )
    assert cfg["r"] == 6 and cfg["rank_pattern"] == {"model.layers.1.self_attn.o_proj": 3}
    ids = sample_ids(20)
    assert (peft_logits(base, folder, ids) - playback_logits(base, adapter, ids)).abs().max() <= 1e-3
    back = import_peft(base, folder, tmp_path / "back.bin")
    original = sorted(read_adapter(adapter)[1], key=lambda e: sort_key(e.key))
    for x, y in zip(original, read_adapter(back)[1]):  # baked parts: B within an ulp
        assert x.key == y.key and np.array_equal(x.A, y.A) and x.alpha == y.alpha and x.scaling == y.scaling
        np.testing.assert_allclose(y.B, x.B, rtol=2e-7, atol=0)


@pytest.mark.parametrize("arch,mode", [("llama", "LORA"), ("phi3", "LORA"), ("qwen2", "DORA")])
def test_foreign_peft_adapter_imports_onto_playback(tiny_gguf, tmp_path, arch, mode):
    """An adapter PEFT made itself (no juno-py record): our playback of the import equals PEFT's output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = tiny_gguf(arch, GGMLType.F32)
    hf = AutoModelForCausalLM.from_pretrained(str(base.parent), gguf_file=base.name, dtype=torch.float32)
    modules = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj"]}.get(arch, ["q_proj", "k_proj", "v_proj", "up_proj"])
    cfg = LoraConfig(
        r=4,
        lora_alpha=6,
        target_modules=modules,
        use_dora=mode == "DORA",
        rank_pattern={f"model.layers.1.self_attn.{modules[0]}": 2},
        alpha_pattern={"model.layers.0.*": 3},
    )
    model = get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=g)
            elif "magnitude" in name:
                p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(tmp_path / "peft"))
    ids = sample_ids(20)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    back = import_peft(base, tmp_path / "peft", tmp_path / "back.bin")
    assert (playback_logits(base, back, ids) - expected).abs().max() <= 1e-3


# --------------------------------------------------------------------------------------------------- GGUF-LoRA
def read_with_gguf_package(path):
    import gguf

    r = gguf.GGUFReader(str(path))
    fields = {f.name: f for f in r.fields.values()}
    alpha = fields["adapter.lora.alpha"]
    assert alpha.types == [gguf.GGUFValueType.FLOAT32]
    meta = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (list(map(int, t.shape)), np.asarray(t.data, np.float32)) for t in r.tensors}
    return meta, tensors


def llama_cpp_deltas(path, base):
    """ΔW per model tensor as llama.cpp computes it from the file: scale(alpha, b.ne[0]) · B · A."""
    meta, tensors = read_with_gguf_package(path)
    out = {}
    for name, (ne, a) in tensors.items():
        if name.endswith(".lora_a"):
            tensor = name[: -len(".lora_a")]
            b_ne, b = tensors[tensor + ".lora_b"]
            assert ne[1] == b_ne[0], "a.ne[1] must equal b.ne[0] (the rank)"
            scale = llama_cpp_scale(meta["adapter.lora.alpha"], b_ne[0])
            out[tensor] = scale * b.astype(np.float64) @ a.astype(np.float64)
    return out


def our_deltas(base, adapter):
    out = {}
    with GGUFFile(base) as g:
        layout = ModelTargets(g).layout
        for e in read_adapter(adapter)[1]:
            slot = layout.blocks[e.layer].targets[e.target]
            d = out.setdefault(slot.tensor, np.zeros(g.tensors[slot.tensor].shape))
            d[slot.rows[0] : slot.rows[1]] += e.scale * e.B.astype(np.float64) @ e.A.astype(np.float64)
    return out


@pytest.mark.parametrize(
    "arch,targets,scaling,expect_alpha",
    [
        ("llama", "all", Scaling.STANDARD, 8.0),
        ("llama", "all", Scaling.RSLORA, 16.0),  # alpha / sqrt(r) = alpha' / r  with alpha' = alpha · sqrt(r)
        ("phi3", "qv", Scaling.STANDARD, 16.0),  # one rank-8 pair over attn_qkv: alpha' / 8 = 8 / 4
        ("phi3", "all", Scaling.STANDARD, 0.0),  # pairs of rank 4, 8 and 12: no single alpha, scales baked into B
    ],
)
def test_gguf_lora_format_and_llama_cpp_scale(tiny_gguf, tmp_path, arch, targets, scaling, expect_alpha):
    base = tiny_gguf(arch, GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets=targets, scaling=scaling, rank=4, alpha=8)
    out = export_gguf_lora(base, adapter, tmp_path / "a.lora.gguf")
    meta, tensors = read_with_gguf_package(out)
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["general.architecture"] == arch
    assert meta["adapter.lora.alpha"] == pytest.approx(expect_alpha)
    with GGUFFile(base) as g:
        for name, (ne, _) in tensors.items():
            tensor, _, kind = name.rpartition(".")
            model_ne = list(g.tensors[tensor].ne)
            if kind == "lora_a":
                assert ne[0] == model_ne[0]  # a.ne = [n_in, r]
            else:
                assert kind == "lora_b" and ne[1] == model_ne[1]  # b.ne = [r, n_out]
    theirs, ours = llama_cpp_deltas(out, base), our_deltas(base, adapter)
    assert sorted(theirs) == sorted(ours)
    for name in ours:
        np.testing.assert_allclose(theirs[name], ours[name], rtol=1e-6, atol=1e-9)
    back = import_gguf_lora(base, out, tmp_path / "back.bin")
    if expect_alpha:
        same_entries(adapter, back)
    else:
        for x, y in zip(read_adapter(adapter)[1], read_adapter(back)[1]):
            assert x.key == y.key and np.array_equal(x.A, y.A)
            np.testing.assert_allclose(y.B, x.B, rtol=2e-7, atol=0)


def test_gguf_lora_half_precision_and_foreign_files(tiny_gguf, tmp_path):
    """A file without our record (another tool's): each fused target gets the pair's A and its rows of B."""
    from juno_py.gguf import GGUFWriter

    base = tiny_gguf("phi3", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    f16 = export_gguf_lora(base, adapter, tmp_path / "h.gguf", dtype="f16")
    with GGUFFile(f16) as f:
        assert {t.ggml_type for t in f.tensors.values()} == {GGMLType.F16}
        foreign = tmp_path / "foreign.gguf"
        with GGUFWriter(foreign) as w:
            w.copy_fields(f, skip=["juno_py.adapter_parts"])
            for name in f.tensors:
                w.copy_tensor(f, name)
    back = read_adapter(import_gguf_lora(base, foreign, tmp_path / "back.bin"))[1]
    assert [e.key for e in back] == ["0:wq", "0:wv", "1:wq", "1:wv"]  # k rows of B are zero: no entry
    assert all(e.rank == 8 and e.alpha == 16.0 and e.scale == 2.0 for e in back)
    ours = our_deltas(base, adapter)
    theirs = our_deltas(base, tmp_path / "back.bin")
    for name in ours:
        np.testing.assert_allclose(theirs[name], ours[name], rtol=2e-3, atol=2e-5)  # F16 rounding


def test_gguf_lora_import_rejects_what_llama_cpp_rejects(tiny_gguf, tmp_path):
    from juno_py.gguf import GGUFWriter, ValueType

    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="wq", layers=[0])
    good = export_gguf_lora(base, adapter, tmp_path / "a.lora.gguf")

    def variant(name, alpha_type=ValueType.FLOAT32, arch="llama", extra=None):
        path = tmp_path / name
        with GGUFFile(good) as f, GGUFWriter(path) as w:
            w.copy_fields(f)
            w.add_field("adapter.lora.alpha", 8, alpha_type)
            w.add_field("general.architecture", arch, ValueType.STRING)
            for t in f.tensors:
                w.copy_tensor(f, t)
            if extra:
                w.add_tensor(extra, np.zeros(4, np.float32), GGMLType.F32, (4,))
        return path

    for path, message in [
        (variant("int.gguf", ValueType.UINT32), "expected FLOAT32"),
        (variant("arch.gguf", arch="qwen2"), "does not match"),
        (variant("suffix.gguf", extra="blk.0.attn_q.weight.lora_c"), "unexpected suffix"),
        (base, "not a LoRA adapter"),
    ]:
        with pytest.raises(JunoError, match=message):
            import_gguf_lora(base, path, tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists()


def test_llama_cpp_runs_merged_files_and_gguf_lora(tiny_gguf, tmp_path):
    """llama.cpp (llama-cpp-python, not a dependency) on F32 tiny models: merged files and GGUF-LoRA exports give
    our playback's logits. Skipped where llama_cpp is not installed."""
    pytest.importorskip("llama_cpp")
    from tests.golden.check_llamacpp import compare_tiny

    for arch, targets, scaling in [
        ("llama", "all", Scaling.RSLORA),
        ("phi3", "qv", Scaling.STANDARD),
        ("phi3", "all", Scaling.STANDARD),
        ("qwen2", "all", Scaling.STANDARD),
    ]:
        res = compare_tiny(arch, targets, scaling, tmp_path / f"{arch}-{targets}-{scaling.name}")
        assert res["effect"] > 0.05
        assert res["merged_max_abs"] <= 1e-3 and res["lora_max_abs"] <= 1e-3, res
