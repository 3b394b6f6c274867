"""gpt-oss: logits against transformers' GptOssForCausalLM holding the same weights (dequantized by the gguf
package) on rows longer than the sliding window; attention sinks on every path against the dense reference in
float64; the clamped SwiGLU and YaRN against transformers' own; playback through the general decode path."""

import math
import warnings

import pytest
import torch

from juno_py.errors import GGUFFormatError
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.models import Transformer
from juno_py.models.attention import (
    AttentionMask,
    attend,
    attention_settings,
    sink_attention_dense,
    sink_renormalise,
)
from juno_py.models.decode import NativeDecoder
from juno_py.models.generate import generate
from juno_py.models.model import yarn_inv_freq
from juno_py.models.moe import swiglu_oai
from juno_py.testing.tiny_models import hf_model_from_gguf, sample_ids, write_tiny_gguf

BOUND = 1e-4


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.Q8_0, GGMLType.MXFP4], ids=lambda t: t.name)
def test_logits_match_transformers(tiny_gguf, qtype):
    path = tiny_gguf("gpt-oss", qtype)
    model = Transformer.from_gguf(GGUFFile(path))
    assert [b.window for b in model.blocks] == [4, 0, 4]  # even layers slide
    ids = sample_ids(20, seed=3)  # five windows long
    with torch.no_grad():
        got = model.logits(ids)
        want = hf_model_from_gguf(path, "gpt-oss")(torch.tensor([ids])).logits[0]
    assert want.abs().max() > 1.0
    assert (got - want).abs().max().item() <= BOUND
    f64 = model.set_activation_dtype(torch.float64)
    with torch.no_grad():
        assert (f64.logits(ids).float() - want).abs().max().item() <= BOUND


def _mask(t, window=0, b=2):
    pos = torch.arange(t).expand(b, t)
    return AttentionMask(pos, pos, window, by_index=True)


def test_sink_renormalisation_equals_the_dense_reference_float64():
    g = torch.Generator().manual_seed(0)
    b, h, hkv, t, d = 2, 4, 2, 11, 8
    q, k, v = (torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2
    for window in (0, 3):
        mask = _mask(t, window, b)
        want = sink_attention_dense(q, k, v, mask, 0.3, sinks)
        # attention without sinks and its log-sum-exp, as flex_attention returns them
        kk, vv = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        scores = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~mask.dense(), float("-inf"))
        out = torch.softmax(scores, -1) @ vv
        got = sink_renormalise(out, scores.logsumexp(-1), sinks)
        assert (got - want).abs().max().item() <= 1e-12
        # and the sinks matter: without them the rows differ
        assert (out - want).abs().max().item() > 1e-3


def test_sink_paths_agree_forward_and_backward_float64():
    g = torch.Generator().manual_seed(1)
    b, h, hkv, t, d = 1, 4, 1, 13, 8
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    base = [torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)]
    results = []
    for settings in (dict(), dict(dense_limit=40, force="chunked"), dict(dense_limit=40)):
        q, k, v = (x.clone().requires_grad_(True) for x in base)
        with attention_settings(**settings):
            y = attend(q, k, v, _mask(t, 5, b), 0.35, enable_gqa=True, sinks=sinks)
            (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        results.append((y.detach(), q.grad, k.grad, v.grad))
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert (a - c).abs().max().item() <= 1e-12


def test_swiglu_oai_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=1))
    gate = torch.linspace(-12, 12, 97, dtype=torch.float64, requires_grad=True)
    up = torch.linspace(11, -11, 97, dtype=torch.float64, requires_grad=True)
    want = experts._apply_gate(torch.stack((gate, up), -1).flatten())
    got = swiglu_oai(gate, up)
    assert (got - want).abs().max().item() <= 1e-12
    assert (gate > 7).any() and (up.abs() > 7).any()  # the clamps are exercised
    (gw,) = torch.autograd.grad(want.sum(), gate)
    (gg,) = torch.autograd.grad(got.sum(), gate)
    assert torch.allclose(gg, gw, atol=1e-12, rtol=0)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers_rope_init(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=truncate,
        original_max_position_embeddings=4096,
    )
    cfg = GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256, rope_parameters=rope)
    want, attn = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got = yarn_inv_freq(64, 150000.0, 1 / 32.0, 4096, 32.0, 1.0, 1.0, truncate)
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)
    assert attn == pytest.approx(1 + 0.1 * math.log(32.0))


def test_yarn_attention_factor_scales_cos_and_sin(tiny_gguf):
    model = Transformer.from_gguf(GGUFFile(tiny_gguf("gpt-oss")))
    assert model.args.rope_scaling == "yarn" and model.args.n_ctx_orig == 32
    assert model._rope_attn == [pytest.approx(1 + 0.1 * math.log(4.0))]  # one table: sliding layers scale too


def test_playback_decodes_through_the_model_forward(tiny_gguf):
    model = Transformer.from_gguf(GGUFFile(tiny_gguf("gpt-oss", GGMLType.Q8_0)))
    reason = NativeDecoder.unsupported(model)
    assert reason is not None and "attention sinks" in reason
    prompt = sample_ids(6, seed=5)
    out = generate(model, prompt, max_new_tokens=8)
    ids = list(prompt)
    with torch.no_grad():  # greedy by hand, every step a full forward
        for _ in range(8):
            ids.append(int(model.logits(ids)[-1].argmax()))
    assert list(out) == ids[len(prompt) :]


@pytest.mark.parametrize(
    "knobs,match",
    [
        (dict(drop=["blk.1.attn_sinks.weight"]), r"tensor 'blk.1.attn_sinks.weight' is missing"),
        (dict(drop=["blk.0.ffn_up_exps.bias"]), r"tensor 'blk.0.ffn_up_exps.bias' is missing"),
        (dict(drop=["blk.0.attn_output.bias"]), r"gpt-oss requires a bias on wo"),
        (dict(metadata={"gpt-oss.attention.sliding_window": None}), r"attention.sliding_window' is missing"),
    ],
)
def test_bad_files_are_refused(tmp_path, knobs, match):
    path = write_tiny_gguf(tmp_path / "bad.gguf", "gpt-oss", **knobs)
    with pytest.raises(GGUFFormatError, match=match):
        Transformer.from_gguf(GGUFFile(path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention with sinks needs CUDA")
@pytest.mark.parametrize("window", [0, 64])
def test_flex_sinks_match_the_dense_reference_on_cuda(window):
    g = torch.Generator().manual_seed(2)
    b, h, hkv, t, d = 2, 8, 2, 300, 64
    base = [torch.randn(b, n, t, d, generator=g) for n in (h, hkv, hkv)]
    sinks = torch.randn(h, generator=g).cuda()
    grads = []
    for force in ("flex", "chunked"):
        q, k, v = (x.cuda().requires_grad_(True) for x in base)
        pos = torch.arange(t, device="cuda").expand(b, t)
        with attention_settings(force=force):
            y = attend(q, k, v, AttentionMask(pos, pos, window, by_index=True), d**-0.5, True, sinks)
        y.square().sum().backward()
        grads.append((y.detach(), q.grad, k.grad, v.grad))
    for a, c in zip(*grads):
        assert (a - c).abs().max().item() <= 2e-3 * max(1.0, c.abs().max().item())


def test_flex_lse_renormalised_equals_the_sinks_reference_on_cpu_float64():
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():  # eager flex on the CPU (forward only) warns that it is unfused
        warnings.simplefilter("ignore")
        out, aux = flex_attention(q, k, v, scale=0.5, return_aux=AuxRequest(lse=True))
    zeros = torch.zeros(1, 8, dtype=torch.long)  # every key visible to every query, as flex saw it
    want = sink_attention_dense(q, k, v, AttentionMask(zeros, zeros), 0.5, sinks)
    assert (sink_renormalise(out, aux.lse, sinks) - want).abs().max().item() <= 1e-12
