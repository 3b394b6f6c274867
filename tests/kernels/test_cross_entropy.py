"""The fused cross-entropy kernel of the loss chunk against an fp64 reference: per-row loss m + log Σ exp(z − m) − z_t
and gradient softmax(z) − onehot(t), zero on ignored rows; its dispatch; the chunked loss through it.

Loss: within fp32 rounding of the fp64 value (a few units of fp32 roundoff of the terms |m|, |log Σ|, |z_t|, plus
one per block of the online sum). Gradient: within the fp32 arithmetic's error plus, for bf16, half a bf16 ulp (the
output's rounding, to nearest even: a truncating store fails). On a GPU the same tests run compiled, at real sizes
(1024 × 128256 bf16), and the kernel is captured in a CUDA graph and replayed.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from juno_py.kernels import EAGER, FUSED, cross_entropy_grad_, cross_entropy_grad_eager, cross_entropy_path  # noqa: E402
from juno_py.kernels.cross_entropy_triton import BLOCK, cross_entropy_grad  # noqa: E402
from juno_py.models.loss import chunked_cross_entropy  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24  # unit roundoff of fp32
CUDA = DEVICE == "cuda"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (compiled kernels at real sizes)")

# one row, one column, vocabularies that are not multiples of the block, several blocks with a ragged last one
# (block 64/128: the interpreter runs many blocks quickly), one over the default block
SMALL_CASES = [
    ((1, 1), None),
    ((1, 7), None),
    ((3, 300), None),
    ((37, 129), None),
    ((37, 129), 64),
    ((7, 1000), 128),
    ((5, BLOCK + 1), None),
]
GPU_CASES = [((1024, 128256), None), ((4097, 1000), None), ((3, 128256), None)]
CASES = SMALL_CASES + (GPU_CASES if CUDA else [])
DTYPES = [torch.bfloat16, torch.float32]


def make_logits(shape, dtype, scale=3.0, seed=0, ignore_every=4, ignore_index=-100):
    """Logits `[n, V]` on the test device (values rounded to dtype), targets with every `ignore_every`-th row ignored
    and the first and last columns among the targets."""
    gen = torch.Generator().manual_seed(seed)
    n, V = shape
    z = (torch.randn(n, V, generator=gen) * scale).to(DEVICE, dtype)
    t = torch.randint(0, V, (n,), generator=gen)
    t[1::5] = V - 1
    t[2::7] = 0
    if ignore_every:
        t[::ignore_every] = ignore_index
    return z, t.to(DEVICE)


def reference(z, t, ignore_index=-100):
    """fp64 per-row loss, gradient, and the row maximum and log-sum-exp's parts for the error bounds."""
    z64 = z.double()
    valid = t != ignore_index
    at = torch.where(valid, t, 0)
    m = z64.amax(dim=1)
    log_sum = torch.logsumexp(z64 - m[:, None], dim=1)
    z_t = z64.gather(1, at[:, None])[:, 0]
    loss = torch.where(valid, m + log_sum - z_t, 0.0)
    p = torch.softmax(z64, dim=1)
    g = p.scatter_add(1, at[:, None], -valid.double()[:, None])
    g[~valid] = 0
    return loss, g, m, log_sum, z_t, p


def blocks_of(V, block):
    return math.ceil(V / min(block or BLOCK, 1 << max(V - 1, 0).bit_length()))


def loss_bound(V, block, m, log_sum, z_t):
    """A few fp32 roundings of each term and of the arguments of exp (≤ log V on average), one per block of the
    lanes' running sums and one per level of the lanes' sum."""
    terms = m.abs() + log_sum.abs() + z_t.abs()
    return 8 * U32 * (terms + blocks_of(V, block) + math.log2(V) + math.log(V) + 4)


def half_ulp_bf16(x):
    """Half a bf16 ulp at each |x| (fp64): x = m·2^e with 0.5 ≤ |m| < 1, bf16 keeps 8 significant bits."""
    _, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), e - 9)


def grad_bound(z, g_ref, p, m, V, block, bf16):
    """Per element: fp32 error of p = exp(z − m)/S (the exponential's argument, the sum S, the reciprocal) and of the
    target's p − 1, plus half a bf16 ulp of the value when the output is bf16."""
    dist = (m[:, None] - z.double()).nan_to_num(posinf=0.0)
    e32 = torch.where(p == 0, 0.0, U32 * p * (8 + 2 * dist + 4 * blocks_of(V, block) + math.log2(V)))
    e32 = e32 + 2 * U32 * (g_ref < 0) + 2.0**-126  # values below fp32's normal range may flush to 0 (GPU)
    return e32 + (half_ulp_bf16(g_ref.abs() + e32) if bf16 else 0)


def check_against_fp64(z, t, ignore_index=-100, block=None):
    kw = {} if block is None else dict(block=block)
    loss, g = cross_entropy_grad(z, t, ignore_index, in_place=False, **kw)
    ref_loss, ref_g, m, log_sum, z_t, p = reference(z, t, ignore_index)
    V = z.shape[1]
    assert loss.dtype == torch.float32 and loss.shape == (z.shape[0],)
    assert g.dtype == z.dtype and g.shape == z.shape
    lb = loss_bound(V, block, m, log_sum, z_t)
    assert bool(((loss.double() - ref_loss).abs() <= lb).all()), (loss.double() - ref_loss).abs().max().item()
    gb = grad_bound(z, ref_g, p, m, V, block, z.dtype == torch.bfloat16)
    err = (g.double() - ref_g).abs()
    assert bool((err <= gb).all()), (err - gb).max().item()
    return loss, g, ref_loss, ref_g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", CASES)
def test_loss_and_gradient_match_fp64(shape, block, dtype):
    z, t = make_logits(shape, dtype)
    loss, g, _, _ = check_against_fp64(z, t, block=block)
    valid = t != -100
    assert float(loss[~valid].abs().sum()) == 0.0 and float(g[~valid].abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ignore_index", [0, 7, -1])
def test_ignore_index_elsewhere_than_minus_100(ignore_index, dtype):
    z, t = make_logits((23, 41), dtype, ignore_every=0)
    t[::3] = ignore_index
    loss, g, _, _ = check_against_fp64(z, t, ignore_index, block=16)
    ignored = t == ignore_index
    assert bool(ignored.any()) and bool((~ignored).any())
    assert float(loss[ignored].abs().sum()) == 0.0 and float(g[ignored].abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_rows_ignored_give_zero_loss_and_gradient_even_over_nan_logits(dtype):
    z, t = make_logits((9, 300), dtype, ignore_every=1)
    z[3] = float("nan")  # an ignored row is not read
    loss, g = cross_entropy_grad(z, t, -100, block=64)
    assert float(loss.abs().sum()) == 0.0 and float(g.abs().sum()) == 0.0
    total, g2 = cross_entropy_grad_eager(z, t, -100)
    assert float(total) == 0.0 and float(g2.abs().sum()) == 0.0  # the reference agrees


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e4, 1e-30, 100.0])
def test_very_large_and_very_small_logits(scale, dtype):
    z, t = make_logits((19, 333), dtype, scale=scale)
    check_against_fp64(z, t, block=64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_confident_rows_and_minus_infinity_logits(dtype):
    z, t = make_logits((11, 200), dtype)
    valid = (t != -100).nonzero().squeeze(1)
    z[valid[:3], t[valid[:3]]] = 40.0  # p_target = 1 to fp32: loss ~ 0, gradient ~ 0 everywhere
    z[:, 150:170] = float("-inf")  # a masked part of the vocabulary
    t[valid[3]] = 10
    loss, g, _, _ = check_against_fp64(z, t, block=64)
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(g).all())
    assert float(g[:, 150:170].abs().sum()) == 0.0


def test_bf16_gradient_is_the_fp32_one_rounded_to_nearest_even():
    """The same arithmetic in both (the loads widen bf16 exactly): only the store differs, and it rounds as torch."""
    z, t = make_logits((13, 515), torch.bfloat16)
    _, g16 = cross_entropy_grad(z, t, -100, block=128)
    _, g32 = cross_entropy_grad(z.float(), t, -100, block=128)
    assert torch.equal(g16.view(torch.int16), g32.to(torch.bfloat16).view(torch.int16))


def test_a_target_outside_the_vocabulary_gives_nan_not_a_stray_read():
    z, t = make_logits((4, 50), torch.float32, ignore_every=0)
    t[1], t[2] = 50, -3
    loss, g = cross_entropy_grad(z, t, -100, block=16)
    assert math.isnan(float(loss[1])) and math.isnan(float(loss[2]))
    assert bool(torch.isfinite(loss[[0, 3]]).all())
    torch.testing.assert_close(g[1].double(), torch.softmax(z[1].double(), 0), rtol=1e-5, atol=1e-7)


# ---- buffers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_writes_the_gradient_into_the_logits_buffer(fused, dtype):
    z, t = make_logits((17, 300), dtype)
    expect_loss, expect_g = cross_entropy_grad_(z.clone(), t, -100, in_place=False)
    ptr = z.data_ptr()
    loss, g = cross_entropy_grad_(z, t, -100, in_place=True)
    assert g.data_ptr() == ptr and g.dtype == dtype and torch.equal(z, g)
    assert torch.equal(g, expect_g) and torch.equal(loss, expect_loss)


@pytest.mark.parametrize("dtype", DTYPES)
def test_not_in_place_leaves_the_logits_alone(fused, dtype):
    z, t = make_logits((17, 300), dtype)
    before = z.clone()
    _, g = cross_entropy_grad_(z, t, -100, in_place=False)
    assert torch.equal(z, before) and g.data_ptr() != z.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_logits_in_place_touch_only_their_view(dtype):
    """A view with a row stride wider than V (columns of a larger buffer), written in place: only its columns
    change; a transposed view (column stride ≠ 1) reads correctly into a new buffer."""
    z, t = make_logits((21, 130), dtype)
    wide = torch.full((21, 160), 5.0, dtype=dtype, device=DEVICE)
    wide[:, 10:140] = z
    view = wide[:, 10:140]
    _, g = cross_entropy_grad(view, t, -100, in_place=True, block=32)
    _, g_ref = cross_entropy_grad(z, t, -100, block=32)
    assert torch.equal(view, g_ref) and g.data_ptr() == view.data_ptr()
    assert bool((wide[:, :10] == 5).all()) and bool((wide[:, 140:] == 5).all())
    transposed = z.t().contiguous().t()
    assert transposed.stride() == (1, 21)
    _, g_t = cross_entropy_grad(transposed, t, -100, block=32)
    assert torch.equal(g_t, g_ref)


# ---- dispatch ---------------------------------------------------------------------------------------------------


def test_paths(monkeypatch):
    z = torch.zeros(4, 8, device=DEVICE)
    monkeypatch.setenv("JUNO_PY_KERNELS", "auto")
    assert cross_entropy_path(z) == (FUSED if CUDA else EAGER)  # CPU: eager in auto mode, even under the interpreter
    assert cross_entropy_path(z.double()) == EAGER
    assert cross_entropy_path(z.half()) == EAGER
    monkeypatch.setenv("JUNO_PY_KERNELS", "eager")
    assert cross_entropy_path(z) == EAGER
    monkeypatch.setenv("JUNO_PY_KERNELS", "fused")
    assert cross_entropy_path(z) == FUSED
    assert cross_entropy_path(z.to(torch.bfloat16)) == FUSED
    assert cross_entropy_path(z.double()) == EAGER  # fp64 (exactness checks) is eager in every mode


def test_auto_on_cpu_is_the_eager_reference_bit_for_bit(monkeypatch):
    monkeypatch.setenv("JUNO_PY_KERNELS", "auto")
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(29, 77, generator=gen) * 4
    t = torch.randint(0, 77, (29,), generator=gen)
    t[::3] = -100
    loss, g = cross_entropy_grad_(z.clone(), t, -100, in_place=True)
    ref_loss, ref_g = cross_entropy_grad_eager(z.clone(), t, -100, in_place=True)
    assert torch.equal(loss, ref_loss) and torch.equal(g, ref_g)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_eager_reference_matches_fp64_and_keeps_its_buffer_contract(dtype):
    z, t = make_logits((13, 97), dtype)
    z = z.cpu()
    t = t.cpu()
    ref_loss, ref_g = reference(z, t)[:2]
    loss, g = cross_entropy_grad_eager(z.clone(), t, -100, in_place=False)
    assert g.dtype == dtype and loss.dtype == torch.promote_types(dtype, torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert abs(float(loss) - float(ref_loss.sum())) <= tol * float(ref_loss.abs().sum())
    assert float((g.double() - ref_g).abs().max()) <= (tol if dtype != torch.bfloat16 else 2**-8)
    own = z.clone()
    _, g_in = cross_entropy_grad_eager(own, t, -100, in_place=True)
    assert g_in.data_ptr() == own.data_ptr() and torch.equal(g_in, g)


# ---- the chunked loss through the kernel ------------------------------------------------------------------------


def _loss_and_hidden_grad(hidden, targets, project, chunk):
    h = hidden.clone().requires_grad_(True)
    loss = chunked_cross_entropy(h, targets, project, chunk=chunk, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad


@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_cross_entropy_through_the_kernel_equals_the_eager_path(monkeypatch, dtype, cap):
    gen = torch.Generator().manual_seed(1)
    n, d, vocab = 53, 32, 301
    w = (torch.randn(vocab, d, generator=gen) / d**0.5 * 3).to(DEVICE, dtype)
    hidden = torch.randn(n, d, generator=gen).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen).to(DEVICE)
    targets[::4] = -100

    def project(h):  # like Transformer.project: logits in the activations' dtype, then the soft cap (Gemma)
        logits = h @ w.t()
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    monkeypatch.setenv("JUNO_PY_KERNELS", "eager")
    loss_e, grad_e = _loss_and_hidden_grad(hidden, targets, project, chunk=16)
    monkeypatch.setenv("JUNO_PY_KERNELS", "fused")
    loss_f, grad_f = _loss_and_hidden_grad(hidden, targets, project, chunk=16)
    assert grad_f.dtype == grad_e.dtype == dtype
    assert abs(float(loss_f) - float(loss_e)) <= 1e-5 * abs(float(loss_e))
    rel = float((grad_f.double() - grad_e.double()).norm() / grad_e.double().norm())
    # fp32: the two paths' fp32 roundings; bf16: the logits' gradient is rounded to bf16 on both paths and the
    # projection's backward runs in bf16, so an fp32 difference that moves a rounding moves a bf16 product
    assert rel <= (1e-5 if dtype == torch.float32 else 1e-2), rel
    assert float(grad_f[::4].abs().max()) == 0.0


# ---- on a GPU ---------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_eager_at_llama_vocabulary(dtype):
    z, t = make_logits((1024, 128256), dtype, scale=4.0)
    loss_e, g_e = cross_entropy_grad_eager(z.clone(), t, -100, in_place=True)
    loss_f, g_f = cross_entropy_grad(z.clone(), t, -100, in_place=True)
    assert abs(float(loss_f.sum()) - float(loss_e)) <= 1e-5 * abs(float(loss_e))
    # both are fp32 computations within fp32 rounding of the exact gradient (then rounded to bf16): within the sum of
    # the two bounds of each (eager's exp is accurate to an ulp, its sum is a tree like the kernel's lanes)
    ref_g, m, p = (reference(z, t)[i] for i in (1, 2, 5))
    bound = 2 * grad_bound(z, ref_g, p, m, z.shape[1], None, dtype == torch.bfloat16)
    assert bool(((g_f.double() - g_e.double()).abs() <= bound).all())


@needs_cuda
def test_kernel_runs_inside_a_cuda_graph():
    n, V = 1046, 128256
    z_static, t_static = make_logits((n, V), torch.bfloat16, seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, direct-launch cache) outside the capture, as torch advises
        cross_entropy_grad_(z_static.clone(), t_static, -100, in_place=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_static, g_static = cross_entropy_grad_(z_static, t_static, -100, in_place=True)
    assert g_static.data_ptr() == z_static.data_ptr()
    for seed in (1, 2):
        z, t = make_logits((n, V), torch.bfloat16, seed=seed, ignore_every=3)
        z_static.copy_(z)
        t_static.copy_(t)
        graph.replay()
        loss, g = cross_entropy_grad_(z.clone(), t, -100, in_place=True)
        assert torch.equal(loss_static, loss) and torch.equal(g_static, g)


@needs_cuda
def test_chunked_loss_on_the_gpu_takes_the_kernel_and_equals_eager(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    n, d, vocab = 2100, 1024, 128256
    w = (torch.randn(vocab, d, generator=gen) / d**0.5 * 3).to("cuda", torch.bfloat16)
    hidden = torch.randn(n, d, generator=gen).to("cuda", torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), generator=gen).cuda()
    targets[::5] = -100
    project = lambda h: h @ w.t()  # noqa: E731
    assert cross_entropy_path(project(hidden[:4])) == FUSED
    loss_f, grad_f = _loss_and_hidden_grad(hidden, targets, project, chunk=1046)
    monkeypatch.setenv("JUNO_PY_KERNELS", "eager")
    loss_e, grad_e = _loss_and_hidden_grad(hidden, targets, project, chunk=1046)
    assert abs(float(loss_f) - float(loss_e)) <= 1e-5 * abs(float(loss_e))
    assert float((grad_f.double() - grad_e.double()).norm() / grad_e.double().norm()) <= 1e-2
