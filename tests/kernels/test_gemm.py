"""`juno_py.kernels.gemm`: GEMMs with an fp32 result from bf16 operands (`mm_out`, `addmm_out_`) against fp64 of the
same bf16 values. bf16 × bf16 products are exact in fp32, so the only error is the fp32 accumulation: at most about
k·2⁻²⁴ of Σ|a||b| per element. On the CPU, and on a GPU (cuBLAS with out_dtype) when there is one."""

import pytest
import torch

from juno_py.kernels.gemm import addmm_out_, mm_out
from tests.kernels.conftest import DEVICE

U32 = 2.0**-24


def _operands(n, k, m, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(k, m, generator=gen).bfloat16()
    return a.to(DEVICE), b.to(DEVICE)


def _bound(a, b):
    return (a.shape[1] + 2) * U32 * (a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("n,k,m", [(1, 1, 1), (7, 300, 33), (64, 1024, 130)])
def test_mm_out_is_the_fp32_accumulation_of_the_bf16_values(n, k, m):
    a, b = _operands(n, k, m)
    y = mm_out(a, b, torch.float32)
    ref = a.double() @ b.double()
    assert y.dtype == torch.float32 and y.shape == (n, m)
    assert bool(((y.double() - ref).abs() <= _bound(a, b)).all())
    if k > 1:  # not a result rounded to bf16 (which would be 2⁻⁹ off, beyond the bound)
        assert not bool((((a @ b).double() - ref).abs() <= _bound(a, b)).all())


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("alpha", [1.0, -0.75])
def test_addmm_out_accumulates_in_place(alpha, beta):
    a, b = _operands(37, 260, 19, seed=1)
    C0 = torch.randn(37, 19, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    C = C0.clone()
    if beta == 0:
        C[0, 0] = float("nan")  # beta = 0: C is not read, a NaN in it does not come through
    out = addmm_out_(C, a, b, alpha=alpha, beta=beta)
    assert out.data_ptr() == C.data_ptr()
    ref = (0 if beta == 0 else beta * C0.double()) + alpha * (a.double() @ b.double())
    bound = abs(alpha) * _bound(a, b) + 2 * U32 * ref.abs() + 1e-30
    assert bool(((C.double() - ref).abs() <= bound).all())


def test_addmm_out_into_a_slice_of_rows():
    """The quantized DoRA step writes U by tiles of rows: a contiguous row slice takes the product, the rest stays."""
    a, b = _operands(16, 64, 8, seed=3)
    U = torch.full((40, 8), 7.0, device=DEVICE)
    addmm_out_(U[10:26], a, b, beta=0)
    assert bool((U[:10] == 7).all()) and bool((U[26:] == 7).all())
    assert bool(((U[10:26].double() - a.double() @ b.double()).abs() <= _bound(a, b)).all())


def test_addmm_out_refuses_what_it_cannot_write_in_place():
    a, b = _operands(4, 8, 6)
    with pytest.raises(ValueError, match="contiguous float32"):
        addmm_out_(torch.zeros(6, 4, device=DEVICE).T, a, b)
    with pytest.raises(ValueError, match="contiguous float32"):
        addmm_out_(torch.zeros(4, 6, device=DEVICE, dtype=torch.bfloat16), a, b)
