"""Merging adapters on experts: a per-expert entry patches its expert's rows of the 3-D tensor, an every-expert
entry all of them; the experts no entry adapts keep their bytes; the merged model equals playback."""

import numpy as np
import pytest
import torch

from juno_py.errors import AdapterMismatch
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.lora import AdapterEntry, attach, read_adapter, write_adapter
from juno_py.merge import merge_model
from juno_py.models import load_model
from juno_py.testing.tiny_models import sample_ids
from tests.merge.helpers import model_logits, playback_logits


def _adapter(base_path, out, targets, experts, seed=1):
    model = load_model(base_path)
    aset = attach(model, targets, rank=3, alpha=6.0, seed=seed, experts=experts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.1, generator=g)
    return aset.save(out)


@pytest.mark.parametrize("experts", ["per-expert", "shared"])
def test_f32_merge_matches_playback(tiny_gguf, tmp_path, experts):
    base_path = tiny_gguf("qwen3moe", GGMLType.Q8_0)
    adapter = _adapter(base_path, tmp_path / "a.bin", "all,router", experts)
    out_path = tmp_path / "merged.gguf"
    merge_model(base_path, out_path, [adapter], requant="f32")
    ids = sample_ids(24)
    expected = playback_logits(base_path, adapter, ids)
    assert (expected - model_logits(base_path, ids)).abs().max() > 0.05
    assert (model_logits(out_path, ids) - expected).abs().max() <= 1e-4
    with GGUFFile(out_path) as out:
        assert out.tensors["blk.0.ffn_up_exps.weight"].shape == (8, 32, 64)


def test_only_the_adapted_experts_are_reencoded(tiny_gguf, tmp_path):
    base_path = tiny_gguf("mixtral", GGMLType.Q8_0)
    full = _adapter(base_path, tmp_path / "all.bin", "experts", "per-expert")
    picked = [e for e in read_adapter(full)[1] if e.key in ("0:wup_exps.1", "0:wup_exps.3", "1:wdown_exps.2")]
    adapter = write_adapter(tmp_path / "some.bin", picked)
    out_path = tmp_path / "merged.gguf"
    report = merge_model(base_path, out_path, [adapter])
    assert sorted(t.name for t in report.tensors) == ["blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"]
    changed = {"blk.0.ffn_up_exps.weight": {1, 3}, "blk.1.ffn_down_exps.weight": {2}}
    size = GGML_BLOCK_SIZES[GGMLType.Q8_0][1]
    with GGUFFile(base_path) as base, GGUFFile(out_path) as out:
        for name, experts in changed.items():
            a, b = base.tensors[name], out.tensors[name]
            assert b.shape == a.shape and b.ggml_type == a.ggml_type
            diff = (np.asarray(a.data).reshape(-1, size) != np.asarray(b.data).reshape(-1, size)).any(axis=1)
            per_expert = diff.reshape(a.shape[0], -1).any(axis=1)
            assert set(np.flatnonzero(per_expert).tolist()) == experts
    ids = sample_ids(24, seed=2)
    assert (model_logits(out_path, ids) - playback_logits(base_path, adapter, ids)).abs().max() <= 0.05


def test_merge_refuses_what_the_base_lacks(tiny_gguf, tmp_path):
    base_path = tiny_gguf("qwen3moe", GGMLType.Q8_0)
    A, B = np.zeros((2, 64), np.float32), np.zeros((32, 2), np.float32)
    for key, msg in (("0:wup_exps.8", "expert 8 does not exist"), ("0:wup", "block 0 of .* has no wup")):
        bad = write_adapter(tmp_path / "bad.bin", [AdapterEntry(key, A, B, 4.0)])
        with pytest.raises(AdapterMismatch, match=msg):
            merge_model(base_path, tmp_path / "out.gguf", [bad])
        assert not (tmp_path / "out.gguf").exists()
