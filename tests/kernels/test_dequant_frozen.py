"""FrozenQuantLinear's device path (Triton tiles and the fused matvec; on the GPU, or forced with
dequant="triton" under the interpreter) against its eager CPU path and fp64 references: forward, transpose,
autograd, the bf16 cache, row norms, and the torch-codec fallback for types without a kernel.

Bounds are the fp32 accumulation bound of an n-term dot product, n·u·(|x|·|W|), on top of the exact result over
the operands the path multiplies (bf16-rounded x and W with bf16 compute), so a path that dropped a tile, used
the wrong rows, or rounded an fp32 accumulator to bf16 fails.
"""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.gguf.constants import GGML_BLOCK_SIZES  # noqa: E402
from juno_py.kernels import dequant as device_dequant  # noqa: E402
from juno_py.kernels import split_bf16  # noqa: E402
from juno_py.kernels.dequant import dequantize_reference  # noqa: E402
from juno_py.testing.blocks import random_rows  # noqa: E402
from juno_py.weights import FrozenQuantLinear  # noqa: E402
from juno_py.weights.resident import MATVEC_MAX_TOKENS  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24
U_BF16 = 2.0**-8  # unit roundoff of bf16
KERNEL_TYPES = [
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q8_0,
    GGMLType.Q2_K,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
    GGMLType.IQ4_NL,
    GGMLType.IQ4_XS,
]
# every type has a kernel: FALLBACK stands for a type without one (taken out of TRITON_TYPES in this module; its
# kernel is tested in test_dequant_triton.py), decoded by the torch codec on the CPU, then moved
FALLBACK = GGMLType.Q3_K


@pytest.fixture(autouse=True)
def _fallback_has_no_kernel(monkeypatch):
    monkeypatch.setattr(device_dequant, "TRITON_TYPES", device_dequant.TRITON_TYPES - {FALLBACK})


def layer_shape(t: GGMLType) -> tuple[int, int]:
    big = DEVICE == "cuda"
    if GGML_BLOCK_SIZES[t][0] == 256:
        return (4097, 4096) if big else (37, 512)
    return (4097, 2080) if big else (37, 288)


def make(t: GGMLType, compute: torch.dtype, tiles: int = 5, **kw):
    """The device-path layer (scratch sized so forward and transpose each take about `tiles` ragged tiles) and
    the eager CPU layer over the same bytes, and W (fp32, exact)."""
    n_out, n_in = layer_shape(t)
    raw = torch.from_numpy(random_rows(t, n_out, n_in, seed=int(t)))
    scratch = 2 * max(n_in, n_out) * (max(n_out, n_in) // tiles + 1)
    dev = FrozenQuantLinear(
        raw,
        t,
        n_in,
        compute_dtype=compute,
        dequant="triton" if DEVICE == "cpu" else "auto",
        device_scratch_bytes=scratch,
        **kw,
    ).to(DEVICE)
    eager = FrozenQuantLinear(raw, t, n_in, compute_dtype=torch.float32, dequant="torch")
    return dev, eager, dequantize_reference(raw, t, n_in, torch.float32)


def operands(x: torch.Tensor, w: torch.Tensor, compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if compute == torch.bfloat16:
        return x.bfloat16().double(), w.bfloat16().double()
    return x.double(), w.double()


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, compute: torch.dtype, out_bf16: bool = False) -> None:
    """got ≈ x·wᵀ: exact over the multiplied operands within the fp32 accumulation bound (plus bf16 output
    rounding when the result is bf16)."""
    xo, wo = operands(x, w, compute)
    ref = xo @ wo.T
    bound = w.shape[1] * U32 * (xo.abs() @ wo.abs().T) + (U_BF16 * ref.abs() if out_bf16 else 0)
    got = got.detach().cpu().double()
    assert got.shape == ref.shape
    assert bool(((got - ref).abs() <= bound).all()), float(((got - ref).abs() - bound).max())


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES + [FALLBACK], ids=lambda t: t.name)
def test_forward_and_transpose_match_reference(ggml_type, compute):
    dev, eager, w = make(ggml_type, compute)
    n_out, n_in = w.shape
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, MATVEC_MAX_TOKENS, MATVEC_MAX_TOKENS + 5):  # fused matvec, then decode-and-multiply
        x = torch.randn(tokens, n_in, generator=gen)
        y = dev(x.to(DEVICE))
        assert y.dtype == torch.float32 and y.device.type == DEVICE
        check(y, x, w, compute)
        g = torch.randn(tokens, n_out, generator=gen)
        dx = dev.matmul_transposed(g.to(DEVICE))
        check(dx, g, w.T, compute)
        if compute == torch.float32:  # the eager CPU path computes the same products, within the same bound
            check(eager(x), x, w, compute)
    xb = torch.randn(2, 3, n_in, generator=gen).bfloat16()  # bf16 activations in, bf16 out
    yb = dev(xb.to(DEVICE))
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, n_out)
    check(yb.reshape(6, n_out), xb.reshape(6, n_in).float(), w, compute, out_bf16=True)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_1, GGMLType.Q4_K], ids=lambda t: t.name)
def test_autograd_gives_input_gradient_through_device_transpose(ggml_type):
    dev, _, w = make(ggml_type, torch.bfloat16)
    x = torch.randn(11, w.shape[1], generator=torch.Generator().manual_seed(1)).to(DEVICE).requires_grad_(True)
    g = torch.randn(11, w.shape[0], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    dev(x).backward(g)
    assert torch.equal(x.grad, dev.matmul_transposed(g))
    check(x.grad, g.cpu(), w.T, torch.bfloat16)
    assert list(dev.parameters()) == []


@pytest.mark.parametrize("ggml_type", [GGMLType.Q5_0, GGMLType.Q6_K, FALLBACK], ids=lambda t: t.name)
def test_bf16_cache_is_decoded_on_the_device_and_used(ggml_type):
    dev, _, w = make(ggml_type, torch.bfloat16)
    dev.set_weights_cache("bf16")
    assert dev.weight_cache.device.type == DEVICE
    assert torch.equal(dev.weight_cache.cpu().view(torch.int16), w.bfloat16().view(torch.int16))
    x = torch.randn(20, w.shape[1], generator=torch.Generator().manual_seed(3))
    check(dev(x.to(DEVICE)), x, w, torch.bfloat16)
    g = torch.randn(20, w.shape[0], generator=torch.Generator().manual_seed(4))
    check(dev.matmul_transposed(g.to(DEVICE)), g, w.T, torch.bfloat16)
    dev.set_weights_cache("none")
    assert dev.weight_cache is None


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K, FALLBACK], ids=lambda t: t.name)
def test_row_norms_and_rows_on_the_device(ggml_type):
    dev, eager, w = make(ggml_type, torch.bfloat16)
    norms = dev.row_norms_sq()
    assert norms.device.type == DEVICE and norms.dtype == torch.float32
    ref = w.double().square().sum(dim=1)
    assert bool(((norms.cpu().double() - ref).abs() <= w.shape[1] * U32 * ref).all())
    assert dev.row_norms_sq() is not None and dev._row_norms_sq is dev._row_norms_sq  # cached
    assert torch.equal(dev.dequantize_rows(3, 9).cpu(), w[3:9])
    assert torch.equal(dev.dequantize_tile((2, 30), (5, 77)).cpu(), w[2:30, 5:77])
    a = torch.randn(12, w.shape[1], generator=torch.Generator().manual_seed(6))
    check(dev.matmul_exact(a.to(DEVICE)), a, w, torch.float32)  # fp32 operands whatever the compute dtype


def test_dora_factored_norm_on_the_device_path():
    """‖W + sBA‖_row from U = W·Aᵀ run through the device path (`matmul_exact`: W and A each split into two bf16 parts) and the
    fp32 row norms, against fp64 on the exact W, for an adapter the size of a trained one (‖sBA‖ = 5 % of ‖W‖,
    norms moved by about 1e-3): within 1e-5 relative (the DoRA norm target) and 1 % of the adapter's effect.
    (With bf16 operands for U this data gives 3.3e-5: that is why U is computed in fp32.)"""
    from juno_py.lora.adapters import AdaptedLinear, AdapterConfig, LoraAdapter, Mode

    dev, _, w = make(GGMLType.Q4_K, torch.bfloat16)
    n_out, n_in = w.shape
    gen = torch.Generator().manual_seed(5)
    ad = LoraAdapter(
        n_in, n_out, AdapterConfig(rank=8, alpha=8.0, mode=Mode.DORA), generator=gen, magnitude=torch.ones(n_out)
    )
    B = torch.randn(n_out, 8, generator=gen, dtype=torch.float64)
    delta = ad.scale * B @ ad.lora_A.detach().double()
    B *= 0.05 * w.double().norm() / delta.norm()
    with torch.no_grad():
        ad.lora_B.copy_(B)
    lin = AdaptedLinear(dev, [ad.to(DEVICE)])
    got = lin.weight_row_norm().cpu().double()
    base = w.double().norm(dim=1)
    ref = (w.double() + ad.scale * ad.lora_B.detach().cpu().double() @ ad.lora_A.detach().cpu().double()).norm(dim=1)
    assert float(((ref - base) / base).abs().max()) > 1e-4  # the adapter moves the norms
    assert float(((got - ref).abs() / ref).max()) <= 1e-5
    assert float((got - ref).norm()) <= 1e-2 * float((ref - base).norm())


def _count_decodes(monkeypatch) -> list:
    """Record every Triton tile decode the frozen linear launches."""
    from juno_py.kernels import dequant as device_dequant

    calls, real = [], device_dequant.dequantize_tile

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(device_dequant, "dequantize_tile", counted)
    return calls


def _count_split_decodes(monkeypatch) -> tuple[list, list]:
    """Record the frozen linear's plain and split tile decodes."""
    from juno_py.kernels import dequant as device_dequant

    plain, split = [], []
    real_plain, real_split = device_dequant.dequantize_tile, device_dequant.dequantize_split_tile

    def counted_plain(*a, **kw):
        plain.append(1)
        return real_plain(*a, **kw)

    def counted_split(*a, **kw):
        split.append(1)
        return real_split(*a, **kw)

    monkeypatch.setattr(device_dequant, "dequantize_tile", counted_plain)
    monkeypatch.setattr(device_dequant, "dequantize_split_tile", counted_split)
    return plain, split


def _rel_fp64(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().cpu().double() - ref).norm() / ref.norm())


COMBINED_TYPES = [GGMLType.Q4_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


@pytest.mark.parametrize("ggml_type", COMBINED_TYPES, ids=lambda t: t.name)
def test_matmul_with_exact_decodes_each_tile_once(ggml_type, monkeypatch):
    """`matmul_with_exact(x, A)`: one split decode per forward tile and no other decode; the base product
    bit-identical to `matmul` (fp32 and bf16 activations, 3-D x) and U = A·Wᵀ equal to `matmul_exact`'s or within
    2⁻¹⁶ relative of fp64 (and the fp32 accumulation bound of every element)."""
    dev, _, w = make(ggml_type, torch.bfloat16)
    n_out, n_in = w.shape
    if DEVICE == "cpu":  # several ragged tiles at the interpreter's sizes (37 rows: 8, 8, 8, 8, 5)
        dev.device_scratch_bytes = 2 * n_in * 8
    gen = torch.Generator().manual_seed(9)
    A = ((torch.rand(6, n_in, generator=gen) * 2 - 1) / n_in**0.5).to(DEVICE)
    ref_u = A.cpu().double() @ w.double().T
    today = dev.matmul_exact(A)
    xs = (torch.randn(MATVEC_MAX_TOKENS + 7, n_in, generator=gen), torch.randn(2, 5, n_in, generator=gen).bfloat16())
    for x in xs:
        x = x.to(DEVICE)
        plain, split = _count_split_decodes(monkeypatch)
        y, U = dev.matmul_with_exact(x, A)
        tiles = -(-n_out // dev._forward_step(x.to(torch.bfloat16)))
        assert (len(plain), len(split)) == (0, tiles)
        monkeypatch.undo()
        assert tiles > 1 or DEVICE == "cuda"
        want = dev.matmul(x)
        assert y.dtype == want.dtype and y.shape == want.shape and torch.equal(y, want)
        assert U.dtype == torch.float32 and U.shape == (6, n_out)
        assert torch.equal(U, today) or _rel_fp64(U, ref_u) <= max(2.0**-16, _rel_fp64(today, ref_u))
        check(U, A.cpu(), w, torch.float32)
        # A split inside (after the first tile's base product) or by the caller: the same bits, and the split back
        y2, U2, A_split = dev.matmul_with_exact(x, A, return_split=True)
        assert torch.equal(A_split, split_bf16(A)) and torch.equal(y2, y) and torch.equal(U2, U)
        y3, U3, given = dev.matmul_with_exact(x, A, A_split=A_split, return_split=True)
        assert given is A_split and torch.equal(y3, y) and torch.equal(U3, U)


def test_matmul_with_exact_elsewhere_runs_the_two_products():
    """Where one decode cannot serve both (fp32 compute, a resident bf16 cache, matvec token counts, a type without
    a kernel, fp64) the pair is exactly `matmul` and `matmul_exact`."""
    gen = torch.Generator().manual_seed(10)
    for t, compute, cache, tokens in (
        (GGMLType.Q4_K, torch.float32, "none", 9),
        (GGMLType.Q8_0, torch.bfloat16, "bf16", 9),
        (GGMLType.Q6_K, torch.bfloat16, "none", MATVEC_MAX_TOKENS),
        (FALLBACK, torch.bfloat16, "none", 9),
    ):
        dev, _, w = make(t, compute)
        dev.set_weights_cache(cache)
        x = torch.randn(tokens, w.shape[1], generator=gen).to(DEVICE)
        A = torch.randn(3, w.shape[1], generator=gen).to(DEVICE)
        assert not dev._fuses_exact(x, A)
        y, U = dev.matmul_with_exact(x, A)
        assert torch.equal(y, dev.matmul(x)) and torch.equal(U, dev.matmul_exact(A))
        y2, U2, A_split = dev.matmul_with_exact(x, A, return_split=True)
        assert torch.equal(y2, y) and torch.equal(U2, U) and torch.equal(A_split, split_bf16(A))
    dev, _, w = make(GGMLType.Q4_K, torch.bfloat16)
    x64, A64 = torch.randn(9, w.shape[1], dtype=torch.float64), torch.randn(2, w.shape[1], dtype=torch.float64)
    y, U = dev.matmul_with_exact(x64.to(DEVICE), A64.to(DEVICE))
    assert y.dtype == U.dtype == torch.float64


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_matmul_with_update_moves_u_by_the_rounded_difference(ggml_type, monkeypatch):
    """`matmul_with_update(x, A, A_ref, U)` on the fused path: one split decode per forward tile and no other; the
    base bit-identical to `matmul`; A_ref moved by D = bf16(A − A_ref) exactly as `track_delta` moves it; U moved
    by W·Dᵀ over the exact W (within the fp32 accumulation bound of fp64, W_lo included: bf16(W)·D alone misses
    by more than 8 times its error); the split A returned as `split_bf16` gives it. A running U of the wrong shape
    is refused."""
    from juno_py.kernels import track_delta

    dev, _, w = make(ggml_type, torch.bfloat16)
    n_out, n_in = w.shape
    if DEVICE == "cpu":
        dev.device_scratch_bytes = 2 * n_in * 8
    gen = torch.Generator().manual_seed(12)
    A_ref = ((torch.rand(5, n_in, generator=gen) * 2 - 1) / n_in**0.5).to(DEVICE)
    A = A_ref + 0.01 * torch.randn(5, n_in, generator=gen).to(DEVICE) / n_in**0.5
    U0 = (A_ref.double().cpu() @ w.double().T).float().T.contiguous().to(DEVICE)  # [n_out, r]
    x = torch.randn(2, 7, n_in, generator=gen).bfloat16().to(DEVICE)
    U, R = U0.clone(), A_ref.clone()
    plain, split = _count_split_decodes(monkeypatch)
    y, As = dev.matmul_with_update(x, A, R, U, return_split=True)
    tiles = -(-n_out // dev._forward_step(x.to(torch.bfloat16)))
    assert (len(plain), len(split)) == (0, tiles) and (tiles > 1 or DEVICE == "cuda")
    monkeypatch.undo()
    assert torch.equal(y, dev.matmul(x)) and torch.equal(As, split_bf16(A))
    R_want = A_ref.clone()
    D = track_delta(A, R_want).float().cpu()
    assert torch.equal(R, R_want)
    want = U0.double().cpu() + w.double() @ D.double().T
    bound = U32 * (n_in + 2) * (U0.double().cpu().abs() + w.double().abs() @ D.double().abs().T)
    assert ((U.double().cpu() - want).abs() <= bound).all()
    hi_only = U0.double().cpu() + w.bfloat16().double() @ D.double().T  # what W_hi alone would give
    assert (hi_only - want).norm() > 8 * (U.double().cpu() - want).norm()
    with pytest.raises(ValueError, match="running U"):
        dev.matmul_with_update(x, A, R, U.T)


def test_matmul_with_update_elsewhere_recomputes_u():
    """Where `matmul_with_exact` cannot fuse (fp32 compute, a resident cache), `matmul_with_update` is `matmul` and U
    = (A·Wᵀ)ᵀ by `matmul_exact`, A_ref = A: the exact U, not an update."""
    gen = torch.Generator().manual_seed(13)
    for t, compute, cache in ((GGMLType.Q4_K, torch.float32, "none"), (GGMLType.Q8_0, torch.bfloat16, "bf16")):
        dev, _, w = make(t, compute)
        dev.set_weights_cache(cache)
        x = torch.randn(9, w.shape[1], generator=gen).to(DEVICE)
        A = torch.randn(3, w.shape[1], generator=gen).to(DEVICE)
        R = torch.zeros_like(A)
        U = torch.full((w.shape[0], 3), float("nan"), device=DEVICE)
        y = dev.matmul_with_update(x, A, R, U)
        assert torch.equal(y, dev.matmul(x)) and torch.equal(U, dev.matmul_exact(A).T) and torch.equal(R, A)


def test_dora_norm_from_the_combined_product_meets_the_target():
    """The DoRA norm built from `matmul_with_exact`'s U (what a training step computes when A or B changed) within
    1e-5 relative of fp64 over the exact W and 1 % of the adapter's effect, as the norm from `matmul_exact`'s U."""
    from juno_py.lora.adapters import AdaptedLinear, AdapterConfig, LoraAdapter, Mode

    dev, _, w = make(GGMLType.Q4_K, torch.bfloat16)
    n_out, n_in = w.shape
    if DEVICE == "cpu":
        dev.device_scratch_bytes = 2 * n_in * 8
    gen = torch.Generator().manual_seed(5)
    ad = LoraAdapter(
        n_in, n_out, AdapterConfig(rank=8, alpha=8.0, mode=Mode.DORA), generator=gen, magnitude=torch.ones(n_out)
    )
    B = torch.randn(n_out, 8, generator=gen, dtype=torch.float64)
    B *= 0.05 * w.double().norm() / (ad.scale * B @ ad.lora_A.detach().double()).norm()
    with torch.no_grad():
        ad.lora_B.copy_(B)
    lin = AdaptedLinear(dev, [ad.to(DEVICE)])
    x = torch.randn(MATVEC_MAX_TOKENS + 3, n_in, generator=gen).to(DEVICE, torch.bfloat16)
    _, U = dev.matmul_with_exact(x, ad.lora_A.detach())
    got = lin.weight_row_norm(U=U.T).cpu().double()
    base = w.double().norm(dim=1)
    ref = (w.double() + ad.scale * B @ ad.lora_A.detach().cpu().double()).norm(dim=1)
    assert float(((ref - base) / base).abs().max()) > 1e-4
    assert float(((got - ref).abs() / ref).max()) <= 1e-5
    assert float((got - ref).norm()) <= 1e-2 * float((ref - base).norm())


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decoded_once_for_many_products(compute, monkeypatch):
    """Inside `decoded()` W is decoded once for any number of forward and transpose products (each within the
    bound over the same operands); after it the copy is gone and the layer decodes tiles per call again."""
    dev, _, w = make(GGMLType.Q4_K, compute)
    n_out, n_in = w.shape
    gen = torch.Generator().manual_seed(7)
    calls = _count_decodes(monkeypatch)
    with dev.decoded():
        assert dev.weight_cache is not None and dev.weight_cache.dtype == compute
        for tokens in (MATVEC_MAX_TOKENS + 5, 20, 33):
            x = torch.randn(tokens, n_in, generator=gen)
            check(dev(x.to(DEVICE)), x, w, compute)
            g = torch.randn(tokens, n_out, generator=gen)
            check(dev.matmul_transposed(g.to(DEVICE)), g, w.T, compute)
    assert len(calls) == 1
    assert dev.weight_cache is None
    dev(torch.randn(20, n_in, generator=gen).to(DEVICE))
    assert len(calls) > 1  # tiles again


def test_chunked_loss_decodes_the_output_once(tiny_gguf, monkeypatch):
    """The chunked loss through `project` over many chunks of positions decodes a quantized output weight once
    (`hold=` the layer's `decoded()`), and gives the loss and hidden-state gradient of the per-chunk path. The
    model's own loss takes its tiled head instead, which decodes W a tile at a time: its `output_decoded()` holds
    nothing decoded."""
    from juno_py.models import load_model
    from juno_py.models.loss import chunked_cross_entropy

    path = tiny_gguf("llama", GGMLType.Q8_0)
    if DEVICE == "cuda":
        model = load_model(path, device="cuda", compute_dtype="bf16")
    else:
        model = load_model(path, compute_dtype="bf16")
        for lin in model.frozen_linears():
            lin.dequant = "triton"
    out = model.output
    assert isinstance(out, FrozenQuantLinear)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(48, out.in_features, generator=gen).to(DEVICE).bfloat16()
    targets = torch.randint(0, out.out_features, (48,), generator=gen).to(DEVICE)
    with model.output_decoded():
        assert out.weight_cache is None
    results = []
    for hold in (None, out.decoded()):
        h = hidden.clone().requires_grad_(True)
        calls = _count_decodes(monkeypatch)
        loss = chunked_cross_entropy(h, targets, model.project, chunk=16, reduction="sum", hold=hold)
        loss.backward()
        results.append((loss.detach().cpu().double(), h.grad.cpu().double(), len(calls)))
        monkeypatch.undo()
    (l0, g0, n0), (l1, g1, n1) = results
    assert n0 >= 6 and n1 == 1  # 3 chunks, each forward and gradient, against one decode
    assert out.weight_cache is None
    assert float((l1 - l0).abs()) <= 1e-5 * float(l0.abs())
    assert float((g1 - g0).norm()) <= 1e-3 * float(g0.norm())  # bf16 gradients of the same products
