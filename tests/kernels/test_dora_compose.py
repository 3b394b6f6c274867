"""The fused DoRA composition kernels against an fp64 reference: y = g·(base + s·lora) and its gradients.

fp32 inputs: errors are judged relative to the adapter's effect (‖y − y_ref‖ / ‖y_ref − base‖ ≤ 1e-4, and the
same for each gradient against what it would be without the adapter), on data whose effect is large and with g
spread around 1, so a kernel that dropped g or s fails. bf16 inputs: every element within half a bf16 ulp of
the exact value (the rounding of the bf16 output) plus the few fp32 roundings before it.
"""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.kernels.dora import FUSED_INFERENCE, FUSED_TRAINING, compose_path, dora_compose  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24  # unit roundoff of fp32
S = 0.75  # exact in fp32 and fp64: the kernel and the reference scale by the same number

# one row, one column, sizes that are not multiples of any block (tiles are 16 x 256)
SMALL_SHAPES = [(1, 1), (1, 7), (5, 1), (3, 300), (37, 129), (130, 33), (17, 513)]
GPU_SHAPES = [(4096, 8192), (8192, 4096), (4097, 8191)]
SHAPES = SMALL_SHAPES + (GPU_SHAPES if DEVICE == "cuda" else [])


def make_inputs(shape, dtype, lora_dtype=None, seed=0):
    """base, lora `[M, N]`, g `[N]` fp32 in [0.5, 1.5], dy; all on the test device."""
    gen = torch.Generator().manual_seed(seed)
    M, N = shape
    base = torch.randn(M, N, generator=gen)
    lora = torch.randn(M, N, generator=gen)
    g = 1.0 + (torch.rand(N, generator=gen) * 2 - 1) * 0.5
    dy = torch.randn(M, N, generator=gen)
    return (base.to(DEVICE, dtype), lora.to(DEVICE, lora_dtype or dtype), g.to(DEVICE), dy.to(DEVICE, dtype))


def reference(base, lora, g, dy):
    """fp64 y, d_base, d_lora, d_g of the same (rounded) inputs, and inner."""
    b, l, gg, d = (t.double() for t in (base, lora, g, dy))
    inner = b + S * l
    return gg * inner, gg * d, gg * S * d, (inner * d).sum(0), inner


def rel(x, ref, without_adapter):
    return ((x.double() - ref).norm() / (ref - without_adapter).norm()).item()


def run(base, lora, g, dy, grads=(True, True, True)):
    leaves = [t.detach().clone().requires_grad_(w) for t, w in zip((base, lora, g), grads)]
    y = dora_compose(*leaves, S)
    assert compose_path(*leaves) == FUSED_TRAINING
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def test_the_data_makes_a_kernel_ignoring_g_or_s_fail():
    base, lora, g, dy = make_inputs((37, 129), torch.float32)
    y_ref, d_base, d_lora, d_g, inner = reference(base, lora, g, dy)
    b = base.double()
    assert rel(inner, y_ref, b) > 0.1  # g dropped
    assert rel(g.double() * (b + lora.double()), y_ref, b) > 0.1  # s dropped
    assert rel(dy, d_base, dy.double()) > 1 - 1e-9  # d_base without g: the whole effect is missing
    assert ((y_ref - b).norm() / y_ref.norm()).item() > 0.3  # the adapter's effect is not tiny


@pytest.mark.parametrize("shape", SHAPES)
def test_inference_forward_matches_fp64(fused, shape):
    base, lora, g, _ = make_inputs(shape, torch.float32)
    with torch.no_grad():
        assert compose_path(base, lora, g) == FUSED_INFERENCE
        y = dora_compose(base, lora, g, S)
    y_ref = reference(base, lora, g, base)[0]
    assert y.dtype == torch.float32 and y.shape == base.shape
    assert rel(y, y_ref, base.double()) <= 1e-4


@pytest.mark.parametrize("shape", SHAPES)
def test_training_forward_and_backward_match_fp64(fused, shape):
    base, lora, g, dy = make_inputs(shape, torch.float32)
    y, (gb, gl, gg) = run(base, lora, g, dy)
    y_ref, d_base, d_lora, d_g, _ = reference(base, lora, g, dy)
    b, d = base.double(), dy.double()
    assert rel(y, y_ref, b) <= 1e-4
    assert rel(gb, d_base, d) <= 1e-4  # without the adapter d_base would be dy
    assert rel(gl, d_lora, S * d) <= 1e-4  # ... and d_lora s·dy
    assert rel(gg, d_g, (b * d).sum(0)) <= 1e-4  # d_g without the adapter: Σ base·dy
    assert gb.dtype == gl.dtype == gg.dtype == torch.float32


@pytest.mark.parametrize(
    "grads", [(False, True, True), (True, True, False), (False, False, True), (True, False, False)]
)
def test_only_the_wanted_gradients_are_computed(fused, grads):
    base, lora, g, dy = make_inputs((37, 129), torch.float32)
    _, got = run(base, lora, g, dy, grads)
    refs = reference(base, lora, g, dy)[1:4]
    without = (dy.double(), S * dy.double(), (base.double() * dy.double()).sum(0))
    for want, x, ref, w in zip(grads, got, refs, without):
        assert (x is None) != want
        if want:
            assert rel(x, ref, w) <= 1e-4


def half_ulp_bf16(x):
    """Half a bf16 ulp at each |x| (fp64): x = m·2^e with 0.5 ≤ |m| < 1, bf16 keeps 8 significant bits."""
    _, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), e - 9)


def within_bound(x, ref, fp32_err, bf16: bool) -> bool:
    """|x − ref| ≤ (half a bf16 ulp of ref if x is bf16) + the fp32 roundings before it, element by element."""
    bound = fp32_err + (half_ulp_bf16(ref) if bf16 else 0)
    return bool(((x.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_results_are_within_their_rounding(fused, shape, lora_dtype):
    base, lora, g, dy = make_inputs(shape, torch.bfloat16, lora_dtype)
    y, (gb, gl, gg) = run(base, lora, g, dy)
    y_ref, d_base, d_lora, d_g, inner = reference(base, lora, g, dy)
    b, l, gd, d = (t.double() for t in (base, lora, g, dy))
    size = b.abs() + S * l.abs()  # inner = base + s·lora: at most two fp32 roundings of this size
    assert y.dtype == gb.dtype == torch.bfloat16 and gl.dtype == lora_dtype and gg.dtype == torch.float32
    assert within_bound(y, y_ref, 3 * U32 * gd * size, bf16=True)
    assert within_bound(gb, d_base, U32 * d_base.abs(), bf16=True)
    assert within_bound(gl, d_lora, 2 * U32 * d_lora.abs(), bf16=lora_dtype == torch.bfloat16)
    # d_g sums inner·dy over the rows; inner is kept in the wider of base's and lora's dtypes (bf16 here when both
    # are), so each term carries inner's rounding, and the fp32 sum of M terms at most (M+1) roundings of Σ|·|
    inner_bf16 = lora_dtype == torch.bfloat16
    per_term = (half_ulp_bf16(inner) if inner_bf16 else 0) + 2 * U32 * size
    bound = (per_term * d.abs()).sum(0) + (base.shape[0] + 1) * U32 * (inner * d).abs().sum(0)
    assert bool(((gg.double() - d_g).abs() <= bound).all())


def test_d_g_is_deterministic(fused):
    base, lora, g, dy = make_inputs((1000, 300) if DEVICE == "cpu" else (8192, 4096), torch.float32)
    first = run(base, lora, g, dy)[1][2]
    again = run(base, lora, g, dy)[1][2]
    assert torch.equal(first, again)


def test_leading_dimensions_are_kept(fused):
    base, lora, g, dy = make_inputs((24, 33), torch.float32)
    shape = (2, 3, 4, 33)
    y, grads = run(base.reshape(shape), lora.reshape(shape), g, dy.reshape(shape))
    y_ref, d_base, _, d_g, _ = reference(base, lora, g, dy)
    assert y.shape == shape and grads[0].shape == shape and grads[1].shape == shape
    assert rel(y.reshape(24, 33), y_ref, base.double()) <= 1e-4
    assert rel(grads[2], d_g, (base.double() * dy.double()).sum(0)) <= 1e-4


# ------------------------------------------------------------------------ the adapter's product inside the kernel
# (M, N, r): one row, one column, a rank of one, sizes that are not multiples of the tiles (64 × 128 × 64)
XA_SHAPES = [(1, 1, 1), (5, 7, 3), (37, 129, 16), (130, 33, 70), (65, 300, 129)] + (
    [(4096, 8192, 384), (4097, 4095, 16)] if DEVICE == "cuda" else []
)


def xa_inputs(shape, dtype, seed=0):
    """base `[M, N]`, xa `[M, r]`, B `[N, r]` in `dtype` (lora = xa·Bᵀ about as large as base), g fp32 around 1."""
    gen = torch.Generator().manual_seed(seed)
    M, N, r = shape
    base = torch.randn(M, N, generator=gen)
    xa = torch.randn(M, r, generator=gen)
    B = torch.randn(N, r, generator=gen) / r**0.5
    g = 1.0 + (torch.rand(N, generator=gen) * 2 - 1) * 0.5
    return tuple(t.to(DEVICE, dtype) for t in (base, xa, B)) + (g.to(DEVICE),)


@pytest.mark.parametrize("write_inner", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", XA_SHAPES)
def test_compose_forward_xa_matches_fp64(fused, shape, dtype, write_inner):
    """y = g·(base + s·xa·Bᵀ) with the rank product inside the kernel. fp32: within 1e-4 of the adapter's effect
    (fp32 dots, no TF32: a TF32 product would be about 1e-3 off). bf16: every element within half a bf16 ulp plus
    the fp32 roundings of the sum of r exact products and of the two adds; inner likewise."""
    from juno_py.kernels import dora_triton as tk

    base, xa, B, g = xa_inputs(shape, dtype)
    y, inner = tk.compose_forward_xa(base, xa, B, g, S, write_inner=write_inner)
    b, a, bb, gd = (t.double() for t in (base, xa, B, g))
    inner_ref = b + S * a @ bb.T
    y_ref = gd * inner_ref
    assert y.dtype == dtype and y.shape == base.shape and (inner is not None) == write_inner
    assert ((y_ref - gd * b).norm() / y_ref.norm()).item() > 0.2  # the adapter's effect is not tiny
    if dtype == torch.float32:
        assert rel(y, y_ref, gd * b) <= 1e-4
        if write_inner:
            assert rel(inner, inner_ref, b) <= 1e-4
        return
    r = shape[2]
    size = b.abs() + S * a.abs() @ bb.abs().T
    fp32_err = (r + 3) * U32 * size
    assert within_bound(y, y_ref, gd * fp32_err, bf16=True)
    if write_inner:
        assert inner.dtype == torch.bfloat16 and within_bound(inner, inner_ref, fp32_err, bf16=True)


def test_compose_forward_xa_is_compose_forward_of_the_product(fused):
    """The same y as the two-step path (xa·Bᵀ as a GEMM, then `compose_forward`) to fp32 rounding: fp32 inputs."""
    from juno_py.kernels import dora_triton as tk

    base, xa, B, g = xa_inputs((37, 129, 16), torch.float32)
    y, inner = tk.compose_forward_xa(base, xa, B, g, S, write_inner=True)
    y2, inner2 = tk.compose_forward(base, xa @ B.T, g, S, write_inner=True)
    assert torch.allclose(y, y2, rtol=1e-5, atol=1e-5) and torch.allclose(inner, inner2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="xa"):
        tk.compose_forward_xa(base, xa, B.to(torch.bfloat16), g, S)
    # no rank at all: g·base, and inner = base
    y0, inner0 = tk.compose_forward_xa(base, xa[:, :0], B[:, :0], g, S, write_inner=True)
    assert torch.equal(inner0, base) and torch.equal(y0, g * base)


def test_backward_can_leave_d_g_in_its_partial_sums(fused):
    """`reduce_d_g=False` returns the row groups' partial sums `[groups, N]`: summed over the groups they are d_g,
    bit for bit; d_base is the same either way."""
    from juno_py.kernels import dora_triton as tk

    base, lora, g, dy = make_inputs((1000, 300) if DEVICE == "cpu" else (8192, 4096), torch.float32)
    inner = base + S * lora
    d_base, _, d_g = tk.compose_backward(dy, g, inner, S, torch.float32, None)
    d_base2, _, parts = tk.compose_backward(dy, g, inner, S, torch.float32, None, reduce_d_g=False)
    assert parts.dim() == 2 and parts.shape[0] > 1 and parts.shape[1] == g.numel()
    assert torch.equal(parts.sum(dim=0), d_g) and torch.equal(d_base2, d_base)
    _, _, empty = tk.compose_backward(dy[:0], g, inner[:0], S, torch.float32, None, reduce_d_g=False)
    assert empty.shape == (1, g.numel()) and not empty.any()
