"""DoRA's numerics, read top-down along one activation through a DoRA layer, with every dispatch threshold.

A DoRA layer computes `y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) + b` with `g = m / max(‖W + sBA‖_row, DORA_EPS)`, the norm
detached (`juno_py.lora.adapters.AdaptedLinear` holds the modules and the norm's cache):

1. Which path a layer's training step takes (`layer_training_fused`): the fused training step `DoraLinearFn` (one
   autograd node that orders the GPU work) where the Triton kernels run and the problem is at least
   `FUSED_TRAIN_MIN_ELEMENTS`; else the composition functions of 4.
2. `DoraLinearFn`: the base GEMM, the adapter's x·Aᵀ, the norm (3.), g, the fused composition; its backward.
3. The row norm ‖W + sBA‖ in factored form, never materializing B·A (`factored_row_norm`): G = A·Aᵀ (`gram`, on
   bf16 tensor cores from the split A at or above `SPLIT_GRAM_MIN_FMAS`), V = B·G (`mm_bf16x3` at or above
   `NORM_GEMM_MIN_FMAS`, else inside the row kernel), then the row kernels (`norm_rows`, `norm_rows_gram`,
   `norm_assemble`).
4. The composition `g·(base + s·lora)` outside the training step (`dora_compose`, `dora_compose_xa`,
   `compose_path`): the fused training kernels (`DoraComposeFn`) when a gradient is wanted on CUDA and the problem is
   at least `FUSED_TRAIN_MIN_ELEMENTS`; the fused inference kernel when no gradient is wanted on CUDA (with bf16
   activations up to `COMPOSE_XA_MAX_RANK`, forming xa·Bᵀ inside the kernel); the eager torch reference on CPU,
   without Triton, below the crossover, or for dtypes the kernels do not take (fp64 exactness checks, fp16).

`JUNO_PY_KERNELS=fused|eager|auto` forces a path (`juno_py.kernels.kernel_mode`); fused on CPU tensors needs
`TRITON_INTERPRET=1`. The kernels are in `juno_py.kernels.dora_triton`, their eager references in
`juno_py.kernels.reference`; `docs/kernels.md` has the measurements.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch.autograd.function import once_differentiable

from juno_py.kernels import EAGER, FUSED_DTYPES, fused_kernels, kernel_mode, split_bf16, triton_kernels
from juno_py.kernels.gemm import addmm_out_, mm_out
from juno_py.kernels.reference import compose_eager, norm_assemble_eager, norm_rows_eager, norm_rows_gram_eager
from juno_py.weights.base import has_exact_products

# ------------------------------------------------------------------------------------------------ thresholds
# the floor of DoRA's row norm: g = m / max(‖W + sBA‖_row, DORA_EPS)
DORA_EPS = 1e-6

# Elements of base ([tokens, d_out]) from which the fused training kernels beat eager torch on the H200 (fwd+bwd,
# wall time per call): below it both are launch-bound and Triton's launches cost more than torch's; see
# docs/kernels.md for the sweep.
FUSED_TRAIN_MIN_ELEMENTS = 1 << 24

# Up to this rank the bf16 composition forms the adapter's product xa·Bᵀ inside its kernel (`compose_forward_xa`)
# instead of after a GEMM that writes it out. On the H200 (benchmarks/compose_xa_sweep.py, GPU µs, with inner): 61
# against 93 at 8192 × 4096, r = 16; 100 against 114 at 4096 × 8192, r = 384; but 157 against 142 at r = 768, where
# the kernel's dots (about half of cuBLAS's rate there) cost more than the traffic they save.
COMPOSE_XA_MAX_RANK = 512

# Device types where the split bf16 products below pay (tensor cores); tests add "cpu" to run those paths in CI.
SPLIT_PRODUCT_DEVICES = ("cuda",)
# A·Aᵀ with at least this many multiply-adds runs on bf16 tensor cores from a split A (`gram`): fp32's own GEMM
# runs at about 1/15 of the bf16 rate on an H200 (G at r = 384 on an 8192-wide layer: 75 µs in fp32, 0.2 ms on a
# 28672-wide one; benchmarks/dora_step_profile.py)
SPLIT_GRAM_MIN_FMAS = 1 << 30
# DoRA's V = B·G with at least this many multiply-adds (d_out·r²) runs as one bf16 tensor-core GEMM of the split
# operands (`mm_bf16x3`) instead of inside the fused row kernel's 3×TF32 dots. On the H200 at 8192 rows
# (benchmarks/norm_gram_sweep.py, GPU / CPU µs): r = 768, kernel 263 / 95, GEMM path 96 / 234; r = 384,
# kernel 72 / 76, GEMM path 42 / 318. The GEMM path's ops cost more CPU than the kernel's one or two launches, which
# the layer steps below this size cannot hide (an eager step at r = 384 is partly bound by its host).
NORM_GEMM_MIN_FMAS = 1 << 32

FUSED_INFERENCE, FUSED_TRAINING = "fused-inference", "fused-training"


# ------------------------------------------------------------------------------------- 1. which path a step takes
def layer_training_fused(x: torch.Tensor, n_out: int, *params: torch.Tensor) -> bool:
    """Whether a DoRA layer's training step on input x (output `[..., n_out]`) takes the fused training path: the
    same rule as `compose_path` giving FUSED_TRAINING for the layer's base and lora outputs (fp32/bf16, a gradient
    wanted through x or a parameter, kernels on x's device, at least `FUSED_TRAIN_MIN_ELEMENTS` in auto).

    `AdaptedLinear` then runs the whole step as one autograd Function (`DoraLinearFn`), which orders the GEMMs so
    the GPU runs them while the CPU issues the small work. Raises KernelUnavailable like `compose_path`."""
    mode = kernel_mode()
    if mode == "eager" or x.dtype not in FUSED_DTYPES or x.dim() < 1:
        return False
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        return False
    if fused_kernels(x.device, mode) is None:
        return False
    return mode == "fused" or (x.numel() // max(x.shape[-1], 1)) * n_out >= FUSED_TRAIN_MIN_ELEMENTS


# ----------------------------------------------------------------------------------- 2. the fused training step
class DoraLayer(Protocol):
    """What `DoraLinearFn` asks of the layer it runs (`juno_py.lora.adapters.AdaptedLinear`): its frozen base, its
    DoRA adapter (A, B, m, the scale s) and the norm it keeps."""

    @property
    def base(self) -> Any: ...  # matmul, matmul_transposed; where it has them matmul_with_exact, matmul_with_update

    @property
    def dora(self) -> Any: ...

    def norm_is_cached(self, dtype: torch.dtype = torch.float32) -> bool: ...

    def running_u(self, A: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]: ...

    def start_running_u(self, A: torch.Tensor, U: torch.Tensor) -> torch.Tensor: ...

    def dora_norm(
        self,
        dtype: torch.dtype = torch.float32,
        U: Optional[torch.Tensor] = None,
        A_split: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...


class DoraLinearFn(torch.autograd.Function):
    """One DoRA layer's training step, `y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ)` with `g = m / max(‖W + sBA‖_row, 1e-6)`
    (the norm detached), as one autograd node, so the order of the GPU work is ours and not autograd's:

    - forward: the base GEMM first (the GPU runs it while the CPU issues the rest), the adapter's GEMM x·Aᵀ, the
      norm (recomputed when A or B changed: `AdaptedLinear.dora_norm`), g, then the fused composition, writing
      inner = base + s·lora when m trains: with bf16 activations (rank ≤ `COMPOSE_XA_MAX_RANK`)
      `compose_forward_xa`, which forms lora = (x·Aᵀ)·Bᵀ
      in the kernel (no [tokens, d_out] lora array written and read back), else a second GEMM and
      `compose_forward`. When the norm is recomputed and the base has `matmul_with_exact`, the base product and the
      norm's U = W·Aᵀ come from that one call (a quantized W is decoded once for both), A split once into its bf16
      parts for U, the norm's Gram matrix and bf16(A). Where the layer keeps a running U (`running_u`: on CUDA),
      only the first such step does; the later ones move U by W·bf16(A − A_ref)ᵀ in the base's
      `matmul_with_update`, one product of W's size per row of A fewer;
    - backward: the fused kernel for d_base = g·dy and the partial sums of Σ_tokens inner·dy (d_lora = s·d_base is
      not written: s is the alpha of the adapter's GEMMs, unless base and lora differ in dtype), then at once the
      input gradient's big GEMM `d_base·W` (`base.matmul_transposed`; autograd would run it last), then the
      adapter's GEMMs while it runs, `dx += d_xa·A` accumulated in place, `d_m = d_g / norm` (d_g's partial sums
      added last).

    Gradients of A and B come out of the GEMMs in fp32 (bf16 operands, fp32 accumulation, no bf16 rounding).
    Saved: x, x·Aᵀ `[tokens, r]`, the adapter's A and B in the activations' dtype (with a fresh norm and bf16
    activations A is a view of the split A, so its `[2r, d_in]` bf16 stays alive: r·d_in·2 bytes more, r/tokens of
    what x takes), g, the norm and (when m trains) inner; nothing the size of W.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, layer: DoraLayer):
        tk = triton_kernels()
        ad = layer.dora
        s = float(ad.scale)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        combined = layer.base.matmul_with_exact if has_exact_products(layer.base) else None
        dt = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32  # as `LoraAdapter.delta_parts`
        U = A_split = None
        if combined is not None and not layer.norm_is_cached(torch.float32):
            # the norm needs U = W·Aᵀ: one pass over W gives it with the base product (a quantized W decoded once);
            # A is split into its bf16 parts once (after the base GEMM is issued), for U, for the norm's Gram matrix
            # and (bf16(A)) for the adapter. Where the layer keeps a running U, that pass moves it to A instead.
            A32 = _as(A.detach(), torch.float32)
            run = layer.running_u(A32)
            if run is not None:
                U, A_ref = run
                base_out, A_split = layer.base.matmul_with_update(x2, A32, A_ref, U, return_split=True)
            else:
                base_out, U, A_split = combined(x2, A32, return_split=True)
                U = layer.start_running_u(A32, U.T)
        else:
            base_out = layer.base.matmul(x2)  # first: the big GEMM
        xc = _as(x2, dt)
        r = A.shape[0]
        Ac = A_split[:r] if A_split is not None and dt == torch.bfloat16 else A.detach().to(dt)
        Bc = B.detach().to(dt)
        xa = torch.mm(xc, Ac.T)
        # bf16 up to COMPOSE_XA_MAX_RANK: lora = xa·Bᵀ is formed inside the composition kernel
        lora = None if dt == torch.bfloat16 and r <= COMPOSE_XA_MAX_RANK else torch.mm(xa, Bc.T)
        norm = layer.dora_norm(torch.float32, U=U, A_split=A_split)
        g = torch.div(m.detach(), norm)
        want_inner = ctx.needs_input_grad[3]
        if lora is None:
            y, inner = tk.compose_forward_xa(base_out, xa, Bc, g, s, write_inner=want_inner)
        else:
            y, inner = tk.compose_forward(base_out, lora, g, s, write_inner=want_inner)
        ctx.save_for_backward(xc, Ac, Bc, xa, g, norm, inner)
        ctx.layer, ctx.s, ctx.x_shape, ctx.x_dtype = layer, s, x.shape, x.dtype
        ctx.dtypes = (base_out.dtype, dt)  # dt: the adapter's product's dtype (lora's, where it is written)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        tk = triton_kernels()
        xc, Ac, Bc, xa, g, norm, inner = ctx.saved_tensors
        need_x, need_A, need_B, need_m = ctx.needs_input_grad[:4]
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        dx = dA = dB = d_m = None
        need_lora = need_x or need_A or need_B
        base_dtype, lora_dtype = ctx.dtypes
        s = ctx.s
        # d_lora = s·d_base: where both have one dtype, the kernel writes d_base alone and s goes into the adapter's
        # GEMMs (their alpha), one [tokens, d_out] tensor fewer to write
        shared = base_dtype == lora_dtype
        # d_g's partial sums, added up at the end: the big GEMM is issued first
        d_base, d_lora, d_g_parts = tk.compose_backward(
            dy2,
            g,
            inner if need_m else None,
            s,
            base_dtype if need_x or (shared and need_lora) else None,
            lora_dtype if need_lora and not shared else None,
            reduce_d_g=False,
        )
        scale = s if shared else 1.0
        if shared:
            d_lora = d_base
        if need_x:  # the big GEMM first: the GPU runs it while the CPU issues the adapter's small GEMMs
            dx = _as(ctx.layer.base.matmul_transposed(d_base), ctx.x_dtype)
        del d_base
        if need_B:
            dB = mm_fp32(d_lora.T, xa, scale)
        if need_x or need_A:
            d_xa = _mm_scaled(d_lora, Bc, scale)
            if need_A:
                dA = mm_fp32(d_xa.T, xc)
            if need_x:
                if dx.dtype == d_xa.dtype and dx.dim() == 2 and dx.is_contiguous():
                    dx.addmm_(d_xa, Ac)
                else:
                    dx = dx + torch.mm(d_xa, Ac).to(dx.dtype)
                if dx.shape != ctx.x_shape:
                    dx = dx.reshape(ctx.x_shape)
        if need_m:
            d_m = d_g_parts.sum(dim=0).div_(norm)
        return dx, dA, dB, d_m, None


def _mm_scaled(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha·(a·b) in a's dtype, alpha applied by the GEMM (fp32, before the result's rounding)."""
    if alpha == 1.0:
        return torch.mm(a, b)
    return torch.addmm(torch.empty((), dtype=a.dtype, device=a.device), a, b, beta=0, alpha=alpha)


# ------------------------------------------------------------------------------------------------ 3. the row norm
def factored_row_norm(
    base_sq: torch.Tensor,
    U: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    s: float,
    dtype: torch.dtype = torch.float32,
    eps: float = 0.0,
    A_split: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """‖W + sBA‖ per row (then max(·, eps)) from ‖W‖²_row, U = W·Aᵀ `[d_out, r]` (a transposed view is fine),
    A `[r, d_in]`, B `[d_out, r]`; no `d_out×d_in` matrix.

    ‖W+sBA‖²_row = ‖W‖²_row + 2s·rowsum(B ⊙ U) + s²·rowsum((B·G) ⊙ B) with G = A·Aᵀ, accumulated in `dtype`: G
    (through bf16 tensor cores at fp32 accuracy when large: `gram`), then one fused kernel for V = B·G,
    rowsum(B ⊙ (2s·U + s²·V)), the sum with ‖W‖², the square root and eps (`norm_rows_gram`). On CUDA with
    d_out·r² ≥ NORM_GEMM_MIN_FMAS, V = B·G runs as one bf16 tensor-core GEMM at fp32 accuracy instead
    (`mm_bf16x3`), and the row kernel `norm_rows` does the rest; U is only read. `A_split`: A already split
    into its two bf16 parts (`split_bf16`, `[2r, d_in]`, what the step's U was computed from): where `gram` would
    split A, the half Gram matrix of these parts `[2r, r]` (`half_gram`) goes to the kernel as it is instead of
    splitting A again.
    """
    A, B, base_sq = _as(A, dtype), _as(B, dtype), _as(base_sq, dtype)
    split = A_split is not None and _splits_gram(A)
    G = half_gram(A_split) if split else gram(A)
    n, r = B.shape
    if B.device.type in SPLIT_PRODUCT_DEVICES and dtype == torch.float32 and n * r * r >= NORM_GEMM_MIN_FMAS:
        return norm_rows(base_sq, B, _as(U, dtype), mm_bf16x3(B, gram_of_half(G) if split else G), s, eps)
    return norm_rows_gram(base_sq, B, _as(U, dtype), G, s, eps, split=split)  # fused on CUDA, else eager


def gram(A: torch.Tensor) -> torch.Tensor:
    """G = A·Aᵀ `[r, r]` in A's dtype. Large fp32 A on CUDA: from A's bf16 parts A_hi = bf16(A) and
    A_lo = bf16(A − A_hi) (together within about 2⁻¹⁷ of A), the half Gram matrix P = [A_hi; A_lo]·A_hiᵀ `[2r, r]`
    in one bf16 GEMM with fp32 accumulation (`half_gram`), then G = P_top + P_bot + P_botᵀ (`gram_of_half`): an fp32
    GEMM's accuracy at the bf16 rate, with 2r²·d_in products where the full [A_hi; A_lo] Gram matrix takes 4r²·d_in
    (G is symmetric, so A_hi·A_loᵀ is the transpose of A_lo·A_hiᵀ; A_lo·A_loᵀ, at most 2⁻¹⁸ of |A|² a term, is left
    out)."""
    if not _splits_gram(A):
        return A @ A.T
    return gram_of_half(half_gram(split_bf16(A)))


def half_gram(A_split: torch.Tensor) -> torch.Tensor:
    """P = [A_hi; A_lo]·A_hiᵀ `[2r, r]` fp32 from the split A `[2r, d_in]` (`split_bf16`): one bf16 GEMM, fp32
    result. G = A·Aᵀ is P_top + P_bot + P_botᵀ to about 2⁻¹⁸ (`gram_of_half`; `norm_rows_gram(split=True)` takes P
    as it is)."""
    r = A_split.shape[0] // 2
    return mm_fp32(A_split, A_split[:r].T)


def gram_of_half(P: torch.Tensor) -> torch.Tensor:
    """G `[r, r]` = P_top + P_bot + P_botᵀ from the half Gram matrix P `[2r, r]` (`half_gram`)."""
    r = P.shape[1]
    G = torch.add(P[:r], P[r:])
    return G.add_(P[r:].T)


def mm_bf16x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b `[n, m]` fp32 for fp32 a `[n, k]` and b `[k, m]`, to about fp32 accuracy in one bf16 GEMM with fp32
    accumulation: with v_hi = bf16(v) and v_lo = bf16(v − v_hi) (together within about 2⁻¹⁷ of v),
    [a_hi | a_hi | a_lo]·[b_hi; b_lo; b_hi] adds a_hi·b_hi + a_hi·b_lo + a_lo·b_hi over its inner dimension 3k. What
    it leaves out, a_lo·b_lo and the parts' own residues, is about 3·2⁻¹⁶ of |a|·|b|. Scratch: the split operands,
    `[n, 3k]` and `[3k, m]` bf16, one launch each on CUDA (`split_bf16`)."""
    return mm_out(split_bf16(a, "hhl", side=True), split_bf16(b, "hlh"), torch.float32)


def _splits_gram(A: torch.Tensor) -> bool:
    """Whether `gram(A)` runs on the split A (fp32 A on CUDA, `SPLIT_PRODUCT_DEVICES`, with at least
    SPLIT_GRAM_MIN_FMAS multiply-adds)."""
    r, k = A.shape
    return A.device.type in SPLIT_PRODUCT_DEVICES and A.dtype == torch.float32 and r * r * k >= SPLIT_GRAM_MIN_FMAS


def mm_fp32(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """alpha·(a·b) with an fp32 result: fp32 operands as they are, bf16 operands with fp32 accumulation and no
    rounding of the result to bf16 (cuBLAS's fp32 output; on the CPU the exact bf16 values multiplied in fp32).
    alpha ≠ 1 is the GEMM's own alpha (one kernel)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return _mm_scaled(a, b, alpha)
    if not a.is_cuda:
        return _mm_scaled(a.float(), b.float(), alpha)
    if alpha == 1.0:
        return mm_out(a, b, torch.float32)
    return addmm_out_(torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device), a, b, alpha, beta=0)


def norm_assemble(base_sq: torch.Tensor, cross: torch.Tensor, ba_sq: torch.Tensor, s: float) -> torch.Tensor:
    """‖W + sBA‖_row = sqrt(max(base_sq + 2s·cross + s²·ba_sq, 0)): the fused kernel on CUDA (fp32 or bf16 inputs,
    result fp32), else the eager reference (which keeps fp64 for fp64 inputs). Same JUNO_PY_KERNELS rules."""
    kernels = _norm_kernels(base_sq.device, base_sq, cross, ba_sq)
    if kernels is None:
        return norm_assemble_eager(base_sq, cross, ba_sq, s)
    return kernels.norm_assemble(base_sq, cross, ba_sq, s)


def norm_rows(
    base_sq: torch.Tensor, B: torch.Tensor, U: torch.Tensor, V: Optional[torch.Tensor], s: float, eps: float = 0.0
) -> torch.Tensor:
    """max(‖W + sBA‖_row, eps) = max(sqrt(max(‖W‖² + Σ_j B_ij·(2s·U_ij + s²·V_ij), 0)), eps) with U = W·Aᵀ and
    V = B·(A·Aᵀ) `[n, r]` (V None: no s² term, the caller folded it into U): one fused kernel on CUDA (fp32 or bf16
    inputs, result fp32), else the eager reference (which keeps fp64 for fp64 inputs). Same JUNO_PY_KERNELS rules
    as `norm_assemble`."""
    kernels = _norm_kernels(B.device, base_sq, B, U, V)
    if kernels is None:
        return norm_rows_eager(base_sq, B, U, V, s, eps)
    return kernels.norm_rows(base_sq, B, U, V, s, eps)


def norm_rows_gram(
    base_sq: torch.Tensor,
    B: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor,
    s: float,
    eps: float = 0.0,
    split: bool = False,
) -> torch.Tensor:
    """`norm_rows` with V = B·G formed inside one fused kernel on CUDA: G = A·Aᵀ fp32 `[r, r]`, or with `split` the
    fp32 half Gram matrix P = [A_hi; A_lo]·A_hiᵀ `[2r, r]` of the split A (`split_bf16`), G = P_top + P_bot + P_botᵀ.
    Else the eager reference (fp64 stays fp64). Same JUNO_PY_KERNELS rules as `norm_assemble`."""
    kernels = _norm_kernels(B.device, base_sq, B, U, G=G)
    if kernels is None:
        return norm_rows_gram_eager(base_sq, B, U, G, s, eps, split)
    return kernels.norm_rows_gram(base_sq, B, U, G, s, eps, split)


def _norm_kernels(device: torch.device, *tensors: Optional[torch.Tensor], G: Optional[torch.Tensor] = None):
    """The kernel module a norm function runs on (fp32/bf16 tensors, an fp32 G if any, CUDA or JUNO_PY_KERNELS=fused),
    or None for its eager reference; KernelUnavailable as `fused_kernels`."""
    mode = kernel_mode()
    narrow = all(t.dtype in FUSED_DTYPES for t in tensors if t is not None)
    if mode == "eager" or not narrow or (G is not None and G.dtype != torch.float32):
        return None
    return fused_kernels(device, mode)


# ----------------------------------------------------------------------------------------- 4. the composition
def dora_compose_xa(base: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
    """`dora_compose(base, xa·Bᵀ, g, s)` given the adapter's input product xa = x·Aᵀ `[..., r]` and B `[N, r]`.
    Where no gradient is wanted (inference, playback), xa and B are bf16 on a fused path and the rank is at most
    COMPOSE_XA_MAX_RANK, one kernel forms xa·Bᵀ in fp32 inside the composition (`compose_forward_xa`: no
    [tokens, N] lora array written and read back, lora not rounded to bf16); everywhere else
    `dora_compose(base, lora, g, s)` with lora = xa @ B.T, which on CUDA without a gradient, up to that rank, is
    also left in fp32 (cuBLAS's fp32 output of the bf16 product, `mm_out`): the eager path then computes what the
    kernel does, up to the order of fp32 sums. Rounding lora to bf16 there had put the eager playback of a trained
    tiny model 1.04 % of the adapter's effect away from the fused one (the GPU acceptance allows 1 %), all of it
    the eager side's rounding."""
    mode = kernel_mode()
    N, r = B.shape
    if (
        mode != "eager"
        and r <= COMPOSE_XA_MAX_RANK
        and xa.dtype == B.dtype == torch.bfloat16
        and base.dtype in FUSED_DTYPES
        and base.dim() >= 1
        and base.shape[-1] == N
        and xa.shape[:-1] == base.shape[:-1]
        and xa.shape[-1] == r
        and g.numel() == N
        and g.dtype in FUSED_DTYPES
        and base.device == xa.device == B.device == g.device
        and not _wants_grad(base, xa, B, g)
        and fused_kernels(base.device, mode) is not None
    ):
        y, _ = triton_kernels().compose_forward_xa(
            base.reshape(-1, N), xa.reshape(-1, r), B, g.reshape(-1).to(torch.float32), float(s)
        )
        return y.reshape(base.shape)
    if (
        xa.is_cuda
        and r <= COMPOSE_XA_MAX_RANK
        and xa.dtype == B.dtype == torch.bfloat16
        and not _wants_grad(base, xa, B, g)
    ):
        lora = mm_out(xa.reshape(-1, r), B.t(), torch.float32).reshape(*xa.shape[:-1], N)
    else:
        lora = xa @ B.T
    return dora_compose(base, lora, g, s)


def dora_compose(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor, s: float) -> torch.Tensor:
    """Autograd-aware `g·(base + s·lora)`, g broadcast over the last dimension, arithmetic in fp32.

    The result has base's dtype (fp32 stays fp32; on the eager path fp64 inputs give fp64)."""
    path = compose_path(base, lora, g)
    if path == EAGER:
        return compose_eager(base, lora, g, s)
    kernels = triton_kernels()
    g32 = g.reshape(-1).to(torch.float32)
    if path == FUSED_TRAINING:
        return kernels.DoraComposeFn.apply(base, lora, g32, float(s))
    N = base.shape[-1]
    y, _ = kernels.compose_forward(base.reshape(-1, N), lora.reshape(-1, N), g32, float(s))
    return y.reshape(base.shape)


def compose_path(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor) -> str:
    """Which path `dora_compose` takes for these tensors now: EAGER, FUSED_INFERENCE or FUSED_TRAINING.

    Raises KernelUnavailable when JUNO_PY_KERNELS=fused cannot be honoured (no triton; CPU tensors without
    TRITON_INTERPRET=1)."""
    mode = kernel_mode()
    if mode == "eager" or not _fusable(base, lora, g) or fused_kernels(base.device, mode) is None:
        return EAGER
    if not _wants_grad(base, lora, g):
        return FUSED_INFERENCE
    if mode == "auto" and base.numel() < FUSED_TRAIN_MIN_ELEMENTS:
        return EAGER
    return FUSED_TRAINING


def _fusable(base: torch.Tensor, lora: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the kernels take these tensors at all: fp32/bf16 base and lora of one shape, g one value per column."""
    return (
        base.dtype in FUSED_DTYPES
        and lora.dtype in FUSED_DTYPES
        and g.dtype in FUSED_DTYPES
        and base.shape == lora.shape
        and base.dim() >= 1
        and g.numel() == base.shape[-1]
        and base.device == lora.device == g.device
    )


def _wants_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


# ----------------------------------------------------------------------------------------------------- helpers
def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; t itself when it has it (a no-op `.to` still costs a dispatch: several µs a call on a slow host,
    and a DoRA step made eight of them)."""
    return t if t.dtype == dtype else t.to(dtype)
