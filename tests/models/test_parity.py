"""Forward parity: our logits against transformers loading the same GGUF (dequantized to fp32).

Tiny random models cover every architecture, quant type and fused/split layout; the real SmolLM2-135M and
Gemma-3-270M add greedy continuations (DESIGN §6: max-abs ≤ 1e-3 in fp32).
"""

from pathlib import Path

import pytest
import torch

from juno_py import load_model
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.models import Transformer
from juno_py.models.generate import generate
from juno_py.testing.tiny_models import sample_ids, transformers_logits

BOUND = 1e-3

TINY_CASES = [
    ("llama", GGMLType.F32),
    ("llama", GGMLType.Q8_0),
    ("llama", GGMLType.Q4_0),
    ("qwen2", GGMLType.F32),
    ("qwen2", GGMLType.Q8_0),
    ("qwen2", GGMLType.F16),
    ("qwen3", GGMLType.F32),
    ("qwen3", GGMLType.Q8_0),
    ("qwen3", GGMLType.BF16),
    ("phi3", GGMLType.F32),
    ("phi3", GGMLType.Q8_0),
    ("phi3", GGMLType.Q4_1),
    ("gemma3", GGMLType.F32),
    ("gemma3", GGMLType.Q8_0),
    ("gemma3", GGMLType.Q5_0),
]


def ours(path, **kw) -> Transformer:
    return Transformer.from_gguf(GGUFFile(path), **kw)


@pytest.mark.parametrize("arch,qtype", TINY_CASES, ids=[f"{a}-{t.name}" for a, t in TINY_CASES])
def test_tiny_logits_match_transformers(tiny_gguf, arch, qtype):
    path = tiny_gguf(arch, qtype)
    ids = sample_ids(14, seed=1)  # longer than gemma3's window of 4: sliding layers really slide
    with torch.no_grad():
        got = ours(path).logits(ids)
    want = transformers_logits(path, ids)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert want.abs().max() > 1.0  # the logits carry signal, so the bound means something
    assert (got - want).abs().max().item() <= BOUND


# fused files transformers cannot read (llama, qwen2 with attn_qkv) or split ones of an arch that fuses (phi3):
# compared with transformers on the architecture's own layout of the same weights
FUSED_CASES = [
    ("llama", dict(fuse_qkv=True, fuse_gate_up=True), GGMLType.F32),
    ("llama", dict(fuse_qkv=True, fuse_gate_up=True), GGMLType.Q8_0),
    ("qwen2", dict(fuse_qkv=True), GGMLType.Q8_0),
    ("gemma3", dict(fuse_qkv=True, fuse_gate_up=True), GGMLType.Q4_0),
    ("phi3", dict(fuse_qkv=False, fuse_gate_up=False), GGMLType.Q8_0),
]


@pytest.mark.parametrize(
    "arch,knobs,qtype",
    FUSED_CASES,
    ids=[f"{a}-{'-'.join(f'{k}={v}' for k, v in kn.items())}-{t.name}" for a, kn, t in FUSED_CASES],
)
def test_fused_and_split_layouts_match_transformers(tiny_gguf, arch, knobs, qtype):
    variant, natural = tiny_gguf(arch, qtype, **knobs), tiny_gguf(arch, qtype)
    ids = sample_ids(10, seed=2)
    with torch.no_grad():
        got, same = ours(variant).logits(ids), ours(natural).logits(ids)
    assert (got - same).abs().max().item() <= 1e-5
    assert (got - transformers_logits(natural, ids)).abs().max().item() <= BOUND


def test_fused_layout_maps_targets_to_row_ranges(tiny_gguf):
    model = ours(tiny_gguf("llama", fuse_qkv=True, fuse_gate_up=True))
    a = model.args
    refs = {(r.layer, r.target): r for r in model.targets()}
    assert len(refs) == 7 * a.n_layer
    q, kv = a.q_dim, a.kv_dim
    assert refs[1, "wq"].tensor == "blk.1.attn_qkv.weight" and refs[1, "wq"].rows == (0, q)
    assert refs[1, "wk"].rows == (q, q + kv) and refs[1, "wv"].rows == (q + kv, q + 2 * kv)
    assert refs[0, "wgate"].tensor == refs[0, "wup"].tensor == "blk.0.ffn_up.weight"
    assert refs[0, "wgate"].rows == (0, a.n_ff) and refs[0, "wup"].rows == (a.n_ff, 2 * a.n_ff)
    assert refs[0, "wdown"].tensor == "blk.0.ffn_down.weight"
    assert refs[0, "wq"].module is model.blocks[0].linears["wq"]
    assert refs[0, "wq"].module.out_features == q


# --- real models -------------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a little robot"]


class _Pair:
    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.ours = load_model(path, weights_cache="fp32")
        self.hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        self.hf.eval()

    def ids(self, prompt):
        return self.ours.tokenizer.encode(prompt)

    def hf_logits(self, ids):
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0]

    def hf_greedy(self, ids, n):
        out, cache, step = [], None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(n):
                res = self.hf(step, cache=cache, use_cache=True)
                cache = res.cache
                out.append(int(res.logits[0, -1].argmax()))
                step = torch.tensor([[out[-1]]])
        return out


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return _Pair(smollm2_path)


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return _Pair(gemma3_path)


def _check_logits(pair):
    worst = 0.0
    for prompt in PROMPTS:
        ids = pair.ids(prompt)
        with torch.no_grad():
            got = pair.ours.logits(ids)
        worst = max(worst, (got - pair.hf_logits(ids)).abs().max().item())
    assert worst <= BOUND, worst


def _check_greedy(pair, n=32):
    for prompt in PROMPTS[:2]:
        ids = pair.ids(prompt)
        assert generate(pair.ours, ids, n) == pair.hf_greedy(ids, n), prompt


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    _check_logits(smollm2)


@pytest.mark.slow
def test_smollm2_greedy_continuations_match_transformers(smollm2):
    _check_greedy(smollm2)


@pytest.mark.slow
def test_gemma3_logits_match_transformers(gemma3):
    _check_logits(gemma3)


@pytest.mark.slow
def test_gemma3_greedy_continuations_match_transformers(gemma3):
    _check_greedy(gemma3)


@pytest.mark.slow
def test_streaming_weights_give_the_cached_logits(smollm2_path, smollm2):
    ids = smollm2.ids(PROMPTS[0])
    with torch.no_grad():
        streamed = load_model(smollm2_path, weights_cache="none").logits(ids)
        assert (streamed - smollm2.ours.logits(ids)).abs().max().item() <= 1e-4
