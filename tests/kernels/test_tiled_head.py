"""The tiled loss head (`models.loss.TiledHead`): the output projection's W decoded a tile of rows at a time, each
tile's logits folded into an online softmax (`kernels.online_tile_`), the gradient's product with the same tile
added at once.

The tile kernel against its eager reference (same fp32 arithmetic, other summation order: a few fp32 units; a bf16
output within one bf16 unit); the head's loss and gradient against fp64 cross-entropy over the exact W (fp32
activations and products: fp32 rounding), and against the chunk path through `project` with bf16 activations (the
same bf16 logits: the loss within fp32 rounding, the gradient within bf16 rounding of its factors). On a GPU the
same tests run the compiled kernel and the Triton decoder, and the head runs inside a CUDA graph.
"""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels import online_tile_  # noqa: E402
from juno_py.kernels.cross_entropy_triton import online_tile  # noqa: E402
from juno_py.kernels.dequant import dequantize_reference  # noqa: E402
from juno_py.kernels.reference import LOWEST, online_tile_eager  # noqa: E402
from juno_py.models.loss import TiledHead, chunked_cross_entropy  # noqa: E402
from juno_py.testing.blocks import random_rows  # noqa: E402
from juno_py.weights import FrozenQuantLinear  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

CUDA = DEVICE == "cuda"
DTYPES = [torch.bfloat16, torch.float32]


def fresh_state(n: int) -> tuple[torch.Tensor, ...]:
    full = lambda v: torch.full((n,), v, dtype=torch.float32, device=DEVICE)  # noqa: E731
    return full(LOWEST), full(0.0), full(0.0), full(0.0), full(1.0), full(1.0)


def targets(n: int, vocab: int, seed: int = 0, ignore_index: int = -100) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[::4] = ignore_index
    t[1], t[2] = vocab - 1, 0
    return t.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_tile_kernel_matches_its_eager_reference_over_several_tiles(dtype, cap):
    n, vocab, tile = 21, 700, 300  # three ragged tiles, each several blocks of 64 columns
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(n, vocab, generator=gen) * 4).to(DEVICE, dtype)
    t = targets(n, vocab)
    got, want = fresh_state(n), fresh_state(n)
    for a in range(0, vocab, tile):
        z_kernel, z_eager = logits[:, a : a + tile].clone(), logits[:, a : a + tile].clone()
        online_tile(z_kernel, t, a, got, cap=cap, block=64)
        online_tile_eager(z_eager, t, a, want, cap=cap)
        if dtype == torch.bfloat16:  # one bf16 unit: the two exponentials may round to either side
            torch.testing.assert_close(z_kernel.float(), z_eager.float(), rtol=2.0**-7, atol=1e-30)
        else:
            torch.testing.assert_close(z_kernel, z_eager, rtol=1e-5, atol=1e-30)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    ignored = t == -100
    assert float(got[1][ignored].abs().sum()) == 0.0  # an ignored row gathers nothing


def test_tile_kernel_writes_zero_on_ignored_rows_and_at_the_target():
    n, vocab = 8, 130
    z = torch.randn(n, vocab, device=DEVICE)
    t = targets(n, vocab)
    state = fresh_state(n)
    online_tile(z, t, 0, state, block=64)
    ignored = t == -100
    assert float(z[ignored].abs().sum()) == 0.0
    rows = (~ignored).nonzero().squeeze(1)
    assert float(z[rows, t[rows]].abs().sum()) == 0.0
    assert bool((z[rows] >= 0).all()) and bool((z[rows] <= 1).all())  # exp(c − max c)


def layer_and_w(dtype: torch.dtype, n_out: int = 300, n_in: int = 32, bias: bool = False):
    t = GGMLType.Q8_0
    raw = torch.from_numpy(random_rows(t, n_out, n_in, seed=3))
    b = torch.randn(n_out, generator=torch.Generator().manual_seed(4)) if bias else None
    layer = FrozenQuantLinear(
        raw,
        t,
        n_in,
        b,
        compute_dtype=dtype,
        dequant="triton" if DEVICE == "cpu" else "auto",
    ).to(DEVICE)
    return layer, dequantize_reference(raw, t, n_in, torch.float32).double().to(DEVICE), b


def fp64_reference(x, w, bias, t, cap):
    xr = x.detach().double().requires_grad_(True)
    z = xr @ w.t()
    if bias is not None:
        z = z + bias.double().to(z.device)
    if cap:
        z = cap * torch.tanh(z / cap)
    loss = F.cross_entropy(z, t, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), xr.grad


@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("bias", [False, True])
def test_head_loss_and_gradient_match_fp64_in_fp32(cap, bias):
    layer, w, b = layer_and_w(torch.float32, bias=bias)
    n = 37
    # logits up to about 30: fp32 rounding of larger ones alone moves the gradient past the bound (either path)
    x = (torch.randn(n, 32, generator=torch.Generator().manual_seed(0)) * 0.15).to(DEVICE).requires_grad_(True)
    t = targets(n, 300)
    head = TiledHead(layer, cap, tile_bytes=64 * 16 * 4)  # chunks of 16 positions, tiles of 128 rows (4 per column)
    assert head.tile_rows(16, 4) == 128 and TiledHead(layer, cap, 1 << 20).tile_rows(16, 4) == 300
    loss = chunked_cross_entropy(x, t, None, chunk=16, reduction="sum", head=head)
    loss.backward()
    ref_loss, ref_grad = fp64_reference(x, w, b, t, cap)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * float(ref_loss)
    err = (x.grad.double() - ref_grad).abs().max()
    assert float(err) <= 2e-6 * float(ref_grad.abs().max())
    assert float(x.grad[t == -100].abs().sum()) == 0.0


@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_head_in_bf16_matches_the_logits_path(cap):
    """bf16 activations: the same bf16 logits as the projection through `project` gives; the loss within fp32
    rounding of them, the gradient within bf16 rounding of the factors that multiply W."""
    layer, _, _ = layer_and_w(torch.bfloat16)
    n = 40
    x = (torch.randn(n, 32, generator=torch.Generator().manual_seed(0)) * 2).to(DEVICE, torch.bfloat16)
    t = targets(n, 300)

    def project(h):
        z = layer(h).float()
        return cap * torch.tanh(z / cap) if cap else z

    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    tiled = chunked_cross_entropy(x1, t, None, chunk=16, reduction="sum", head=TiledHead(layer, cap, 64 * 16 * 2))
    plain = chunked_cross_entropy(x2, t, project, chunk=16, reduction="sum")
    (tiled + plain).backward()
    assert abs(float(tiled) - float(plain)) <= 1e-5 * abs(float(plain))
    scale = float(x2.grad.float().abs().max())
    assert float((x1.grad.float() - x2.grad.float()).abs().max()) <= 2.0**-6 * scale


def test_a_target_outside_the_vocabulary_gives_a_nan_loss():
    layer, _, _ = layer_and_w(torch.float32)
    x = torch.randn(4, 32, device=DEVICE)
    t = torch.tensor([1, 300, -7, 2], device=DEVICE)
    loss, _ = TiledHead(layer, 0.0, 64 * 4 * 4).chunk(x, t, -100, want_grad=True)
    assert math.isnan(float(loss))
    loss, _ = TiledHead(layer, 0.0, 64 * 4 * 4).chunk(x[[0, 3]], t[[0, 3]], -100, want_grad=True)
    assert math.isfinite(float(loss))


def test_dispatch_runs_the_eager_reference_where_the_kernels_do_not(monkeypatch):
    monkeypatch.setenv("JUNO_PY_KERNELS", "eager")
    n, vocab = 6, 90
    z = torch.randn(n, vocab, device=DEVICE)
    t = targets(n, vocab)
    a, b = fresh_state(n), fresh_state(n)
    z2 = z.clone()
    online_tile_(z, t, 0, a)
    online_tile_eager(z2, t, 0, b)
    assert torch.equal(z, z2) and all(torch.equal(p, q) for p, q in zip(a, b))


def test_gathered_rows_are_the_decoded_rows():
    layer, w, _ = layer_and_w(torch.float32)
    index = torch.tensor([5, 0, 299, 5, 17], device=DEVICE)
    assert torch.equal(layer.dequantize_gather(index, torch.float32).double(), w[index])
    rows = layer.dequantize_gather(index, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, w[index].to(torch.bfloat16))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_head_runs_inside_a_cuda_graph():
    layer, _, _ = layer_and_w(torch.bfloat16, n_out=50000, n_in=256)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    t = targets(512, 50000)
    head = TiledHead(layer, 0.0, 8 << 20)
    eager_loss, eager_grad = head.chunk(x, t, -100, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        head.chunk(x, t, -100, True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, grad = head.chunk(x, t, -100, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, eager_loss) and torch.equal(grad, eager_grad)
