"""RoPE variants transformers' GGUF loader drops: Phi-3's partial rotary and LongRoPE factors, checked against
transformers' own Phi-3 built from the same weights in memory (its modeling code implements both); and the
two rotary styles against each other through llama's Q/K row permutation."""

import pytest
import torch

from juno_py.gguf import GGMLType, GGUFFile
from juno_py.models import Transformer
from juno_py.models.model import apply_rope, rope_cos_sin, rope_inv_freq
from juno_py.testing.tiny_models import hf_tiny_model, llama_permute, sample_ids

# head_dim 16, half of it rotated; LongRoPE: short factors up to 64 positions, long ones beyond
LONGROPE = dict(
    max_position_embeddings=256,
    original_max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=64,
        short_factor=[1.0, 1.3, 2.0, 3.5],
        long_factor=[2.0, 5.0, 9.0, 17.0],
    ),
)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("n_tokens,n_ctx", [(14, None), (70, 256)], ids=["short-factors", "long-factors"])
def test_phi3_partial_rotary_and_longrope_match_transformers_modeling(tiny_gguf, n_tokens, n_ctx):
    path = tiny_gguf("phi3", GGMLType.F32, config=LONGROPE)
    model = Transformer.from_gguf(GGUFFile(path), n_ctx=n_ctx)
    assert model.args.rope_dim == 8 and model.args.n_ctx_orig == 64 and model.args.rope_attn_factor > 1
    hf = hf_tiny_model("phi3", config=LONGROPE)  # the same weights (F32 file)
    ids = sample_ids(n_tokens, seed=20)
    with torch.no_grad():
        got = model.logits(ids)
    want = _hf_logits(hf, ids)
    assert (got - want).abs().max().item() <= 1e-3
    # and the factors matter: the other choice gives other logits
    other = Transformer.from_gguf(GGUFFile(path), n_ctx=256 if n_ctx is None else 64)
    with torch.no_grad():
        assert (other.logits(ids) - want).abs().max().item() > 1e-2


def test_adjacent_pairs_on_permuted_rows_equal_halves_on_hf_rows():
    """llama.cpp's NORM rotary on the converter's permuted Q rows is Hugging Face's NEOX rotary, reordered."""
    g = torch.Generator().manual_seed(0)
    n_head, head_dim, n_in = 3, 8, 5
    w = torch.randn(n_head * head_dim, n_in, generator=g)
    x = torch.randn(1, 6, n_in, generator=g)
    cos, sin = rope_cos_sin(torch.arange(6).unsqueeze(0), rope_inv_freq(head_dim, 10000.0))
    neox = apply_rope((x @ w.t()).view(1, 6, n_head, head_dim), cos, sin, "neox")
    norm = apply_rope((x @ llama_permute(w, n_head).t()).view(1, 6, n_head, head_dim), cos, sin, "norm")
    perm = llama_permute(torch.arange(head_dim).float().unsqueeze(1), 1).long().squeeze(1)
    assert torch.allclose(norm, neox[..., perm], atol=1e-6)


def _graph(y):
    """Names of the autograd nodes behind y."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "head_dim,rope_dim,layout", [(8, 8, "contiguous"), (16, 8, "contiguous"), (8, 8, "qkv slice"), (6, 6, "odd offset")]
)
def test_adjacent_pairs_as_complex_match_the_real_formulas(dtype, head_dim, rope_dim, layout, device):
    """fp32/fp64 pairs rotate as one complex multiply: the real formulas' values (one rounding each of a product
    and a sum: within 2 ulps, the same bits where the CPU's complex multiply does no fused multiply-add), and their
    gradients, on whole heads, partially rotated heads and strided views (a slice of a fused QKV projection, and one
    whose pairs start at an odd element, which must be copied first); on the CPU and, where there is one, a GPU."""
    g = torch.Generator().manual_seed(1)
    B, T, H = 2, 5, 3
    cos, sin = (t.to(dtype) for t in rope_cos_sin(torch.arange(T).expand(B, T), rope_inv_freq(rope_dim, 10000.0)))
    if layout == "contiguous":
        base = torch.randn(B, T, H, head_dim, generator=g, dtype=dtype)
        take = lambda t: t  # noqa: E731
    elif layout == "qkv slice":
        base = torch.randn(B, T, 3 * H * head_dim, generator=g, dtype=dtype)
        take = lambda t: t[..., H * head_dim : 2 * H * head_dim].view(B, T, H, head_dim)  # noqa: E731
    else:
        base = torch.randn(B, T, H * head_dim + 1, generator=g, dtype=dtype)
        take = lambda t: t[..., 1:].view(B, T, H, head_dim)  # noqa: E731
    dy = torch.randn(B, T, H, head_dim, generator=g, dtype=dtype).to(device)
    base, cos, sin = base.to(device), cos.to(device), sin.to(device)  # on a GPU its complex multiply may fuse
    outs = []
    for complex_pairs in (True, False):
        leaf = base.clone().requires_grad_(True)
        y = apply_rope(take(leaf), cos, sin, "norm", complex_pairs)
        assert ("ViewAsRealBackward0" in _graph(y)) == complex_pairs  # the path asked for is the path taken
        y.backward(dy)
        outs.append((y.detach(), leaf.grad))
    (y, gx), (y_ref, g_ref) = outs
    ulp = torch.finfo(dtype).eps
    assert torch.allclose(y, y_ref, rtol=2 * ulp, atol=4 * ulp)
    assert torch.allclose(gx, g_ref, rtol=2 * ulp, atol=4 * ulp)
    assert not torch.equal(y[..., :rope_dim], take(base)[..., :rope_dim])  # it rotated
    assert torch.equal(y[..., rope_dim:], take(base)[..., rope_dim:])  # the rest passed through
