"""FrozenQuantLinear: streaming forward and transpose against the dequantized weight, row ranges, bias,
bf16 compute, caches, and autograd that yields the input gradient only."""

import pickle

import numpy as np
import pytest
import torch

from juno_py.gguf import GGMLType
from juno_py.testing.blocks import (
    ALL_TYPES,
    FUSED,
    FUSED_BIAS,
    FUSED_SHAPE,
    LAYER_SHAPE,
    layer_name,
    random_rows,
)
from juno_py.weights import BF16_MIN_TOKENS, FrozenQuantLinear

CHUNK = 7  # smaller than every test layer and not a divisor of it: several chunks and a ragged last one


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def layer(f, ggml_type, **kw) -> FrozenQuantLinear:
    return FrozenQuantLinear.from_gguf(f, layer_name(ggml_type), **kw)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_streaming_transpose_is_adjoint_of_forward(layers_gguf, ggml_type):
    lin = layer(layers_gguf, ggml_type, chunk_rows=CHUNK)
    w64 = layers_gguf.dequantize(layer_name(ggml_type)).double()
    n_out, n_in = LAYER_SHAPE
    gen = torch.Generator().manual_seed(int(ggml_type))
    x = torch.randn(3, n_in, generator=gen)
    v = torch.randn(3, n_out, generator=gen)

    # fp64 references from the dequantized values: <W x, v> and <x, W^T v>
    wx_ref, wtv_ref = x.double() @ w64.T, v.double() @ w64
    scale = float(wx_ref.norm() * v.double().norm())
    ref = float((wx_ref * v.double()).sum())
    assert abs(float((x.double() * wtv_ref).sum()) - ref) <= 1e-12 * scale

    # the fp32 streaming forward and transpose each agree with it, so with each other
    fwd = float((lin(x).double() * v.double()).sum())
    adj = float((x.double() * lin.matmul_transposed(v).double()).sum())
    assert abs(fwd - ref) <= 1e-6 * scale
    assert abs(adj - ref) <= 1e-6 * scale
    assert abs(fwd - adj) <= 1e-6 * scale

    # in fp64 the streamed products are the references up to fp64 rounding
    assert rel(lin(x.double()), wx_ref) <= 1e-12
    assert rel(lin.matmul_transposed(v.double()), wtv_ref) <= 1e-12


@pytest.mark.parametrize(
    "ggml_type", [GGMLType.F16, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name
)
@pytest.mark.parametrize("chunk_rows", [None, 1, CHUNK])
def test_forward_matches_dense_matmul(layers_gguf, ggml_type, chunk_rows):
    lin = layer(layers_gguf, ggml_type, chunk_rows=chunk_rows)
    w = layers_gguf.dequantize(layer_name(ggml_type))
    x = torch.randn(2, 5, LAYER_SHAPE[1], generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert y.shape == (2, 5, LAYER_SHAPE[0]) and y.dtype == torch.float32
    assert rel(y, x @ w.T) <= 1e-5
    g = torch.randn(2, 5, LAYER_SHAPE[0])
    assert rel(lin.matmul_transposed(g), g @ w) <= 1e-5
    assert torch.equal(lin.dequantize_rows(3, 11), w[3:11])


def test_shape_type_and_raw_bytes_are_the_memory_map(layers_gguf):
    info = layers_gguf.tensor(layer_name(GGMLType.Q5_K))
    lin = layer(layers_gguf, GGMLType.Q5_K)
    assert (lin.in_features, lin.out_features, lin.ggml_type) == (LAYER_SHAPE[1], LAYER_SHAPE[0], GGMLType.Q5_K)
    assert lin.raw.data_ptr() == info.raw.ctypes.data  # a view of the mapped file, not a copy
    assert list(lin.parameters()) == [] and lin.state_dict() == {}
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(lin)


def test_row_ranges_of_a_fused_tensor_are_slices_of_the_whole(layers_gguf):
    bias = layers_gguf.dequantize(FUSED_BIAS)
    whole = FrozenQuantLinear.from_gguf(layers_gguf, FUSED, bias=bias)
    w = layers_gguf.dequantize(FUSED)
    x = torch.randn(4, FUSED_SHAPE[1], generator=torch.Generator().manual_seed(2))
    y = whole(x)
    assert rel(y, x @ w.T + bias) <= 1e-5
    q, k, v = slice(0, 64), slice(64, 80), slice(80, 96)  # GQA-like: q wider than k and v
    for rows in (q, k, v):
        part = FrozenQuantLinear.from_gguf(layers_gguf, FUSED, rows=rows, bias=bias, chunk_rows=5)
        assert part.out_features == rows.stop - rows.start and part.name == f"{FUSED}[{rows.start}:{rows.stop}]"
        assert torch.equal(part.dequantize_rows(0, part.out_features), w[rows])
        assert rel(part(x), y[:, rows]) <= 1e-6
        # the range's own bias, or the bias tensor's name in the file, do the same
        same = FrozenQuantLinear.from_gguf(layers_gguf, FUSED, rows=rows, bias=bias[rows].clone())
        named = FrozenQuantLinear.from_gguf(layers_gguf, FUSED, rows=rows, bias=FUSED_BIAS)
        assert torch.equal(same(x), named(x))
        assert rel(same(x), y[:, rows]) <= 1e-6
    with pytest.raises(ValueError, match="bias has 7 values"):
        FrozenQuantLinear.from_gguf(layers_gguf, FUSED, rows=k, bias=torch.zeros(7))


def test_bias_is_added_and_frozen(layers_gguf):
    bias = torch.randn(LAYER_SHAPE[0])
    plain = layer(layers_gguf, GGMLType.Q4_0)
    biased = layer(layers_gguf, GGMLType.Q4_0, bias=bias)
    x = torch.randn(3, LAYER_SHAPE[1], requires_grad=True)
    assert torch.allclose(biased(x), plain(x) + bias, atol=1e-6, rtol=0)
    assert torch.equal(biased.matmul(x), plain(x))  # matmul never adds the bias (DoRA's U = W Aᵀ)
    biased(x).sum().backward()
    assert biased.bias.grad is None and not biased.bias.requires_grad


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_1, GGMLType.Q4_K], ids=lambda t: t.name)
def test_bf16_compute_is_close_within_bf16_tolerance(layers_gguf, ggml_type):
    w = layers_gguf.dequantize(layer_name(ggml_type))
    exact = layer(layers_gguf, ggml_type, chunk_rows=CHUNK)
    lin = layer(layers_gguf, ggml_type, compute_dtype=torch.bfloat16, chunk_rows=CHUNK)
    x = torch.randn(BF16_MIN_TOKENS, LAYER_SHAPE[1], generator=torch.Generator().manual_seed(3))
    g = torch.randn(BF16_MIN_TOKENS, LAYER_SHAPE[0], generator=torch.Generator().manual_seed(4))
    y, gx = lin(x), lin.matmul_transposed(g)
    assert y.dtype == torch.float32 and gx.dtype == torch.float32
    assert 0 < rel(y, x @ w.T) <= 1e-2  # bf16 really ran (not bit-equal), within a few bf16 ulps
    assert 0 < rel(gx, g @ w) <= 1e-2
    # a single token (decode) falls back to the exact fp32 path
    assert torch.equal(lin(x[:1]), exact(x[:1]))


@pytest.mark.parametrize("cache", ["fp32", "bf16"])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_resident_cache_matches_streaming(layers_gguf, cache, compute_dtype):
    stream = layer(layers_gguf, GGMLType.Q5_0, chunk_rows=CHUNK)
    cached = layer(layers_gguf, GGMLType.Q5_0, cache=cache, compute_dtype=compute_dtype, chunk_rows=CHUNK)
    assert cached.weight_cache.shape == LAYER_SHAPE and cached.state_dict() == {}
    x = torch.randn(BF16_MIN_TOKENS, LAYER_SHAPE[1], generator=torch.Generator().manual_seed(5))
    g = torch.randn(BF16_MIN_TOKENS, LAYER_SHAPE[0], generator=torch.Generator().manual_seed(6))
    tol = 1e-6 if cache == "fp32" and compute_dtype == torch.float32 else 1e-2
    assert rel(cached(x), stream(x)) <= tol
    assert rel(cached.matmul_transposed(g), stream.matmul_transposed(g)) <= tol
    # exact rows and norms always come from the bytes, whatever the cache holds
    assert torch.equal(cached.dequantize_rows(0, 5), stream.dequantize_rows(0, 5))
    assert torch.equal(cached.row_norms_sq(), stream.row_norms_sq())


def test_gradcheck_in_float64_and_no_weight_gradient():
    rows = random_rows(GGMLType.Q4_0, 9, 64, seed=11)
    lin = FrozenQuantLinear(rows, GGMLType.Q4_0, 64, bias=torch.randn(9), chunk_rows=4)
    x = torch.randn(2, 3, 64, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lin, (x,), eps=1e-6, atol=1e-7)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        x32 = torch.randn(5, 64, requires_grad=True)
        y = lin(x32)
    assert saved == []  # backward keeps neither x nor any dequantized block
    dy = torch.randn_like(y)
    y.backward(dy)
    w = lin.dequantize_rows(0, 9)
    assert rel(x32.grad, dy @ w) <= 1e-6
    assert list(lin.parameters()) == []
    assert all(b is None or b.grad is None for b in lin.buffers())


def test_row_norms_sq_are_the_exact_row_norms(layers_gguf):
    lin = layer(layers_gguf, GGMLType.Q3_K, chunk_rows=CHUNK)
    w = layers_gguf.dequantize(layer_name(GGMLType.Q3_K)).double()
    norms = lin.row_norms_sq()
    assert norms.dtype == torch.float32 and norms.shape == (LAYER_SHAPE[0],)
    assert rel(norms, (w * w).sum(1)) <= 1e-7


def test_dora_factored_product_is_matmul_transposed(layers_gguf):
    # U = W Aᵀ for a small A [r, n_in], through the streaming layer (documented on FrozenQuantLinear.matmul)
    lin = layer(layers_gguf, GGMLType.IQ4_NL, chunk_rows=CHUNK, bias=torch.ones(LAYER_SHAPE[0]))
    a = torch.randn(4, LAYER_SHAPE[1])
    w = layers_gguf.dequantize(layer_name(GGMLType.IQ4_NL))
    assert rel(lin.matmul(a).T, w @ a.T) <= 1e-5


def test_bad_arguments_are_refused(layers_gguf):
    raw = random_rows(GGMLType.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="not a positive multiple"):
        FrozenQuantLinear(raw, GGMLType.Q4_K, 128)
    with pytest.raises(ValueError, match="cache 'fp16'"):
        FrozenQuantLinear(raw, GGMLType.Q4_K, 256, cache="fp16")
    with pytest.raises(ValueError, match="input has 3 features, expected 256"):
        FrozenQuantLinear(raw, GGMLType.Q4_K, 256)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="expected a 2-D weight"):
        FrozenQuantLinear.from_gguf(layers_gguf, FUSED_BIAS)
    assert np.array_equal(raw, random_rows(GGMLType.Q4_K, 4, 256))  # constructing never writes the bytes


@pytest.mark.slow
def test_real_smollm2_projection_matches_dense(smollm2_path):
    from juno_py.gguf import GGUFFile

    with GGUFFile(smollm2_path) as f:
        name = "blk.0.ffn_up.weight"  # Q4_1, 1536 x 576
        lin = FrozenQuantLinear.from_gguf(f, name, chunk_rows=100)
        w = f.dequantize(name)
        x = torch.randn(8, w.shape[1], generator=torch.Generator().manual_seed(8))
        assert lin.ggml_type == GGMLType.Q4_1 and lin.chunk_rows < lin.out_features
        assert rel(lin(x), x @ w.T) <= 1e-5
        g = torch.randn(8, w.shape[0])
        assert rel(lin.matmul_transposed(g), g @ w) <= 1e-5
