"""Mixture-of-experts blocks (qwen3moe, llama files with experts as Mixtral writes them): logits against
transformers' Qwen3MoeForCausalLM and MixtralForCausalLM holding the same weights, dequantized by the gguf package;
the router as llama.cpp computes it; the experts kept quantized and decoded once per forward; bad files refused."""

import pytest
import torch

from juno_py.errors import GGUFFormatError
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.gguf import quants as quants_mod
from juno_py.models import Transformer
from juno_py.models.moe import WEIGHTS_SUM_MIN, route
from juno_py.testing.tiny_models import hf_model_from_gguf, sample_ids
from juno_py.weights.frozen import FrozenQuantLinear

BOUND = 1e-4

CASES = [
    ("qwen3moe", GGMLType.F32),
    ("qwen3moe", GGMLType.Q8_0),
    ("qwen3moe", GGMLType.Q4_0),
    ("mixtral", GGMLType.F32),
    ("mixtral", GGMLType.Q8_0),
    ("mixtral", GGMLType.Q4_1),
]


def ours(path, **kw) -> Transformer:
    return Transformer.from_gguf(GGUFFile(path), **kw)


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{t.name}" for a, t in CASES])
def test_moe_logits_match_transformers(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch, qtype)
    ids = sample_ids(16, seed=3)
    model = ours(path)
    with torch.no_grad():
        got = model.logits(ids)
        want = hf_model_from_gguf(path, arch)(torch.tensor([ids])).logits[0]
    assert got.shape == want.shape and got.dtype == torch.float32
    assert want.abs().max() > 1.0
    assert (got - want).abs().max().item() <= BOUND
    load = model.expert_load()
    assert sorted(load) == [0, 1]
    for counts in load.values():  # every token went to top-k experts
        assert int(counts.sum()) == len(ids) * model.args.n_expert_used


def test_moe_layout_and_metadata(tiny_gguf):
    model = ours(tiny_gguf("qwen3moe", GGMLType.Q8_0))
    a = model.args
    assert (a.n_expert, a.n_expert_used, a.n_ff_exp) == (8, 2, 32)
    bl = model.layout.blocks[1]
    assert set(bl.targets) == {"wq", "wk", "wv", "wo", "wrouter"}
    assert bl.experts["wup_exps"].tensor == "blk.1.ffn_up_exps.weight"
    experts = model.blocks[1].moe.experts
    assert len(experts["wdown_exps"]) == 8
    down = experts["wdown_exps"][5]
    assert isinstance(down, FrozenQuantLinear) and (down.in_features, down.out_features) == (32, 64)
    # expert 5's slice of the 3-D tensor, decoded on its own, is the file's rows for that expert
    full = GGUFFile(model.gguf.path).dequantize("blk.1.ffn_down_exps.weight")
    assert torch.equal(down.dequantize_rows(0, 64), full[5])
    mixtral = ours(tiny_gguf("mixtral"))
    assert mixtral.args.architecture == "llama" and mixtral.args.n_ff_exp == mixtral.args.n_ff == 64
    refs = [r for r in mixtral.targets(("wgate", "wup_exps"))]
    assert [(r.layer, r.expert) for r in refs] == [(layer, e) for layer in (0, 1) for e in range(4)]


def test_router_is_llama_cpp_softmax_topk_renormalised():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 8, generator=g, dtype=torch.float64)
    w, e = route(logits, 3)
    probs = torch.softmax(logits, -1)
    want_e = probs.argsort(-1, descending=True)[:, :3]
    assert torch.equal(e, want_e)
    picked = probs.gather(-1, want_e)
    assert torch.allclose(w, picked / picked.sum(-1, keepdim=True), rtol=0, atol=1e-15)
    assert torch.allclose(w.sum(-1), torch.ones(6, dtype=torch.float64))
    # the clamp: a sum below the smallest normal fp16 is not divided by
    tiny = torch.full((1, 4), -1e4, dtype=torch.float64)
    tiny[0, 0] = 0.0  # one expert takes all; the three others' probabilities underflow to zero
    w, _ = route(tiny, 1)
    assert w.item() == 1.0 and WEIGHTS_SUM_MIN == 2.0**-14


def test_each_used_expert_is_decoded_once_per_forward(tiny_gguf, monkeypatch):
    model = ours(tiny_gguf("qwen3moe", GGMLType.Q8_0))
    decoded: list[str] = []
    real = quants_mod.dequantize

    def counting(ggml_type, raw, n_cols, *a, what="", **kw):
        decoded.append(what)
        return real(ggml_type, raw, n_cols, *a, what=what, **kw)

    monkeypatch.setattr(quants_mod, "dequantize", counting)
    ids = torch.tensor([sample_ids(24, seed=5), sample_ids(24, seed=6)])
    with torch.no_grad():
        model.logits(ids)
    for layer, counts in model.expert_load().items():
        for e, n in enumerate(counts.tolist()):
            for part in ("gate", "up", "down"):
                calls = decoded.count(f"blk.{layer}.ffn_{part}_exps.weight[{e}]")
                assert calls == (1 if n else 0), (layer, e, part, n, calls)


def _write(tmp_path, arch, **knobs):
    from juno_py.testing.tiny_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, **knobs)


def test_bad_moe_files_are_refused(tmp_path):
    path = _write(tmp_path, "qwen3moe", metadata={"qwen3moe.expert_count": None})
    with pytest.raises(GGUFFormatError, match=r"qwen3moe.expert_count' is missing"):
        ours(path)
    path = _write(tmp_path, "qwen3moe", metadata={"qwen3moe.expert_used_count": 9})
    with pytest.raises(GGUFFormatError, match=r"expert_used_count is 9, expected 1..8"):
        ours(path)
    path = _write(tmp_path, "mixtral", extra={"blk.0.ffn_up_exps.weight": torch.zeros(4, 32, 64)})
    with pytest.raises(
        GGUFFormatError, match=r"'blk.0.ffn_up_exps.weight' has shape \(4, 32, 64\), expected \(4, 64, 64\)"
    ):
        ours(path)
    # a llama file without expert_count holding expert tensors: a variant we would silently ignore
    path = _write(tmp_path, "mixtral", metadata={"llama.expert_count": None})
    with pytest.raises(GGUFFormatError, match=r"'blk.0.ffn_up.weight' is missing"):
        ours(path)


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_greedy_generation_with_the_kv_cache_matches_transformers(tiny_gguf, arch):
    from juno_py.models.generate import generate

    path = tiny_gguf(arch, GGMLType.Q8_0)
    ids = sample_ids(6, seed=9)
    got = generate(ours(path), ids, 12)
    hf = hf_model_from_gguf(path, arch)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert got == out[0, len(ids) :].tolist()


def test_checkpointed_blocks_give_the_same_gradients(tiny_gguf):
    from juno_py.lora import attach

    tokens = torch.tensor([sample_ids(10, seed=1), sample_ids(10, seed=2)])
    grads = []
    for checkpointed in (False, True):
        model = ours(tiny_gguf("qwen3moe", GGMLType.Q8_0))
        model.checkpoint_blocks = checkpointed
        aset = attach(model, "all,router", rank=2, alpha=4, seed=0)
        with torch.no_grad():
            for ad in aset.adapters.values():
                ad.lora_B.fill_(0.05)
        model.loss(tokens, tokens.roll(-1, 1)).backward()
        grads.append({n: p.grad for n, p in aset.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-5, atol=1e-7), name


def test_a_reset_returns_the_counts_and_zeroes_them_in_place(tiny_gguf):
    """The router load is counted into tensors that outlive a step (a replayed CUDA graph adds into them): a reset
    hands out copies and zeroes the same tensors, which the next forward counts into again."""
    model = ours(tiny_gguf("qwen3moe", GGMLType.Q8_0))
    ids = sample_ids(16, seed=3)
    with torch.no_grad():
        model.logits(ids)
    held = model.expert_load()
    taken = model.expert_load(reset=True)
    k = model.args.n_expert_used
    assert sorted(taken) == sorted(held) == [0, 1]
    for layer, counts in taken.items():
        assert int(counts.sum()) == len(ids) * k and counts is not held[layer]
        assert int(held[layer].abs().sum()) == 0  # zeroed where it lies
    with torch.no_grad():
        model.logits(ids)
    again = model.expert_load()
    for layer, counts in again.items():
        assert counts is held[layer] and torch.equal(counts, taken[layer])  # the same routing, the same tensors


def test_a_load_counted_under_inference_mode_is_replaced_not_written(tiny_gguf):
    model = ours(tiny_gguf("qwen3moe", GGMLType.Q8_0))
    ids = sample_ids(8, seed=4)
    with torch.inference_mode():
        model.logits(ids)
    assert all(v.is_inference() for v in model.expert_load().values())
    model.expert_load(reset=True)  # an inference tensor cannot be zeroed outside inference mode: dropped instead
    with torch.no_grad():
        model.logits(ids)
    assert all(int(v.sum()) == len(ids) * model.args.n_expert_used for v in model.expert_load().values())
