"""The fused DoRA norm assembly sqrt(max(‖W‖² + 2s·cross + s²·‖BA‖², 0)) against fp64, and the factored norm on it."""

import pytest
import torch

pytest.importorskip("triton")

from juno_py.gguf import GGMLType  # noqa: E402
from juno_py.kernels.dora import factored_row_norm, norm_assemble  # noqa: E402
from juno_py.kernels.reference import norm_assemble_eager  # noqa: E402
from juno_py.testing.blocks import random_rows  # noqa: E402
from tests.kernels.conftest import DEVICE  # noqa: E402

U32 = 2.0**-24
SIZES = [1, 7, 1000, 1025, 4099] + ([8192, 28672, 1 << 20] if DEVICE == "cuda" else [])


def parts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base_sq = torch.rand(n, generator=gen) * 4 + 1.0
    cross = (torch.rand(n, generator=gen) * 2 - 1) * 0.35  # 2s·|cross| < base_sq: every total is positive
    ba_sq = torch.rand(n, generator=gen)
    return [t.to(DEVICE) for t in (base_sq, cross, ba_sq)]


@pytest.mark.parametrize("s", [0.5, 2.0 / 3.0])
@pytest.mark.parametrize("n", SIZES)
def test_norm_assembly_matches_fp64(fused, n, s):
    base_sq, cross, ba_sq = parts(n)
    got = norm_assemble(base_sq, cross, ba_sq, s)
    s32 = float(torch.tensor(s, dtype=torch.float32))  # the kernel's s
    terms = (base_sq.double(), 2 * s32 * cross.double(), s32 * s32 * ba_sq.double())
    total = sum(terms)
    ref = total.sqrt()
    # the fp32 sum rounds at most 5 times (2s, s², two products, two sums) relative to Σ|terms|; sqrt_rn once more
    bound = 0.5 * (5 * U32 * sum(t.abs() for t in terms)) / total * ref + U32 * ref
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert bool(((got.double() - ref).abs() <= bound).all())


def test_negative_totals_clamp_to_zero(fused):
    base_sq = torch.tensor([0.0, 1.0, 4.0, 0.0], device=DEVICE)
    cross = torch.tensor([-1.0, -1.0, 0.0, 0.0], device=DEVICE)
    ba_sq = torch.tensor([0.0, 0.0, 0.0, 0.0], device=DEVICE)
    got = norm_assemble(base_sq, cross, ba_sq, 1.0)
    assert got.tolist() == [0.0, 0.0, 2.0, 0.0]


def test_eager_reference_keeps_fp64(fused):
    base_sq, cross, ba_sq = (t.double() for t in parts(10))
    got = norm_assemble(base_sq, cross, ba_sq, 0.5)
    assert got.dtype == torch.float64
    assert torch.equal(got, norm_assemble_eager(base_sq, cross, ba_sq, 0.5))


def test_factored_norm_on_the_fused_assembly_equals_the_dense_norm(fused):
    from juno_py.gguf import quants

    n_out, n_in, r, s = 300, 512, 16, 2.0
    W = quants.dequantize(GGMLType.Q4_K, random_rows(GGMLType.Q4_K, n_out, n_in, 0), n_in).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    A = (torch.randn(r, n_in, generator=gen) * 0.05).to(DEVICE)
    B = (torch.randn(n_out, r, generator=gen) * 0.05).to(DEVICE)
    dense = (W.double() + s * B.double() @ A.double()).norm(dim=1)
    U = W.double() @ A.double().T  # exact pieces: only the assembly rounds (fp32)
    got = factored_row_norm((W.double() ** 2).sum(1).float(), U.float(), A, B, s, torch.float32)
    assert got.dtype == torch.float32
    assert ((got.double() - dense).abs() / dense).max().item() <= 1e-6
