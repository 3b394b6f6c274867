"""Adapters on frozen quantized linears: LoRA `y = Wx + s·BA·drop(x) + b` and DoRA
`y = g ⊙ (Wx + s·BA·drop(x)) + b` with `g = m / max(‖W + sBA‖_row, 1e-6)` detached.

The trainable/frozen line is in the types: `LoraAdapter` holds only trainable tensors (A, B and, for DoRA,
the magnitude m); `AdaptedLinear` pairs one frozen base with the adapters played on it. DoRA's row norm is
computed in factored form, never materializing B·A (`factored_row_norm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from juno_py import kernels
from juno_py.kernels import norm_rows, norm_rows_gram, split_bf16
from juno_py.kernels.gemm import addmm_out_, mm_out
from juno_py.lora.format import AdapterEntry, Fingerprint, Init, Mode, Scaling
from juno_py.weights.base import has_exact_products

DORA_EPS = 1e-6


@dataclass(frozen=True)
class AdapterConfig:
    rank: int = 8
    alpha: float = 16.0
    mode: Mode = Mode.LORA
    scaling: Scaling = Scaling.STANDARD
    init: Init = Init.KAIMING_UNIFORM
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank {self.rank}: expected >= 1")
        if not math.isfinite(self.alpha):
            raise ValueError(f"alpha {self.alpha}: expected a finite number")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout}: expected 0 <= p < 1")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.scaling == Scaling.RSLORA else self.rank)


# A·Aᵀ with at least this many multiply-adds runs on bf16 tensor cores from a split A (`gram`): fp32's own GEMM
# runs at about 1/15 of the bf16 rate on an H200 (G at r = 384 on an 8192-wide layer: 75 µs in fp32, 0.2 ms on a
# 28672-wide one; benchmarks/dora_step_profile.py)
SPLIT_GRAM_MIN_FMAS = 1 << 30
# DoRA's V = B·G with at least this many multiply-adds (d_out·r²) runs as one bf16 tensor-core GEMM of the split
# operands (`mm_bf16x3`) instead of inside the fused row kernel's 3×TF32 dots. On the H200 at 8192 rows
# (benchmarks/norm_gram_sweep.py, session 9, GPU / CPU µs): r = 768, kernel 263 / 95, GEMM path 96 / 234; r = 384,
# kernel 72 / 76, GEMM path 42 / 318. The GEMM path's ops cost more CPU than the kernel's one or two launches, which
# the layer steps below this size cannot hide (an eager step at r = 384 is partly bound by its host).
NORM_GEMM_MIN_FMAS = 1 << 32
# Device types where the split bf16 products above pay (tensor cores); tests add "cpu" to run those paths in CI.
SPLIT_PRODUCT_DEVICES = ("cuda",)


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


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; t itself when it has it (a no-op `.to` still costs a dispatch: several µs a call on a slow host,
    and a DoRA step made eight of them)."""
    return t if t.dtype == dtype else t.to(dtype)


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


def factored_row_norm(base_sq: torch.Tensor, U: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float,
                      dtype: torch.dtype = torch.float32, eps: float = 0.0,
                      A_split: Optional[torch.Tensor] = None) -> torch.Tensor:
    """‖W + sBA‖ per row (then max(·, eps)) from ‖W‖²_row, U = W·Aᵀ `[d_out, r]` (a transposed view is fine),
    A `[r, d_in]`, B `[d_out, r]`; no `d_out×d_in` matrix.

    ‖W+sBA‖²_row = ‖W‖²_row + 2s·rowsum(B ⊙ U) + s²·rowsum((B·G) ⊙ B) with G = A·Aᵀ, accumulated in `dtype`: G
    (through bf16 tensor cores at fp32 accuracy when large: `gram`), then one fused kernel for V = B·G,
    rowsum(B ⊙ (2s·U + s²·V)), the sum with ‖W‖², the square root and eps (`kernels.norm_rows_gram`). On CUDA with
    d_out·r² ≥ NORM_GEMM_MIN_FMAS, V = B·G runs as one bf16 tensor-core GEMM at fp32 accuracy instead
    (`mm_bf16x3`), and the row kernel `kernels.norm_rows` does the rest; U is only read. `A_split`: A already split
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


class LoraAdapter(nn.Module):
    """Trainable tensors of one adapter on one linear: A `[r, d_in]`, B `[d_out, r]`, and DoRA's m `[d_out]`."""

    def __init__(self, d_in: int, d_out: int, config: AdapterConfig, generator: Optional[torch.Generator] = None,
                 magnitude: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = config
        r = config.rank
        if config.init == Init.KAIMING_UNIFORM:
            bound = 1.0 / math.sqrt(d_in)
            a = torch.empty(r, d_in).uniform_(-bound, bound, generator=generator)
        else:
            a = torch.empty(r, d_in).normal_(0.0, 0.01, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(d_out, r))
        if config.mode == Mode.DORA:
            if magnitude is None:
                raise ValueError("a DoRA adapter needs its initial magnitude (the base's row norms)")
            self.magnitude = nn.Parameter(magnitude.detach().to(torch.float32).clone().reshape(d_out))
        else:
            self.magnitude = None

    @property
    def scale(self) -> float:
        return self.config.scale

    @property
    def is_dora(self) -> bool:
        return self.config.mode == Mode.DORA

    def delta_input(self, x: torch.Tensor) -> torch.Tensor:
        """B·A·drop(x) (unscaled), in fp32 (float64 when x is: exactness checks; bf16 when x is: the GPU's bf16
        activations: the fp32 A and B are cast per call, as under torch autocast)."""
        xa, B = self.delta_parts(x)
        return xa @ B.T

    def delta_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(drop(x)·Aᵀ, B), both in `delta_input`'s dtype: B·A·drop(x) is the first times the second's transpose."""
        dt = x.dtype if x.dtype in (torch.float64, torch.bfloat16) else torch.float32
        x = x.to(dt)
        if self.training and self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, training=True)
        A, B = self.factors(dt)
        return x @ A.T, B

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) in `dtype`. Where no gradient flows through them (inference, playback) a cast is kept while A and B
        are unchanged: each cast is a launch per call and layer, and a playback step on a GPU is bound by its
        launches."""
        A, B = self.lora_A, self.lora_B
        if A.dtype == dtype and B.dtype == dtype:
            return A, B
        if torch.is_grad_enabled() and (A.requires_grad or B.requires_grad):
            return A.to(dtype), B.to(dtype)
        key = (dtype, A.device, id(A), id(B), A._version, B._version, torch.is_inference_mode_enabled())
        kept = self.__dict__.get("_factors_kept")
        if kept is None or kept[0] != key:
            with torch.no_grad():
                kept = (key, A.detach().to(dtype), B.detach().to(dtype))
            self.__dict__["_factors_kept"] = kept
        return kept[1], kept[2]

    def to_entry(self, key: str, fingerprint: Optional[Fingerprint] = None) -> AdapterEntry:
        c = self.config
        mag = self.magnitude.detach().cpu().numpy().copy() if self.magnitude is not None else None
        return AdapterEntry(key, self.lora_A.detach().cpu().numpy().copy(), self.lora_B.detach().cpu().numpy().copy(),
                            float(c.alpha), c.scaling, c.init, c.mode, mag, fingerprint)

    @classmethod
    def from_entry(cls, e: AdapterEntry) -> "LoraAdapter":
        cfg = AdapterConfig(rank=e.rank, alpha=e.alpha, mode=e.mode, scaling=e.scaling, init=e.init)
        mag = torch.from_numpy(e.magnitude.copy()) if e.magnitude is not None else None
        ad = cls(e.in_dim, e.out_dim, cfg, magnitude=mag)
        with torch.no_grad():
            ad.lora_A.copy_(torch.from_numpy(e.A))
            ad.lora_B.copy_(torch.from_numpy(e.B))
        return ad


class AdaptedLinear(nn.Module):
    """A frozen base linear with adapters: several LoRAs summed with playback weights, or one DoRA."""

    def __init__(self, base: nn.Module, adapters: list[LoraAdapter], weights: Optional[list[float]] = None,
                 name: str = ""):
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleList(adapters)
        self.weights = list(weights) if weights is not None else [1.0] * len(adapters)
        self.name = name
        if any(a.is_dora for a in adapters):
            if len(adapters) != 1 or self.weights[0] != 1.0:
                raise ValueError(f"{name or 'linear'}: a DoRA adapter plays alone and at scale 1")
        self._g_cache: Optional[tuple[tuple, torch.Tensor]] = None
        self.norm_held = False  # reuse the cached norm even if A or B change (finite-difference checks)
        self._running_u: Optional[tuple[tuple, torch.Tensor, torch.Tensor]] = None  # (key, U [d_out, r], A_ref)

    # DoRA's training step keeps a running U = W·A_refᵀ and moves it by W·bf16(A − A_ref)ᵀ when A changed
    # (`running_u`): None (the default) on CUDA, where the base's `matmul_with_update` costs two products of W's
    # size per row of A instead of three (a dense W: one instead of two); True also elsewhere (the CPU tests of the
    # device path); False never (every stale norm recomputes U: the benchmarks' comparison).
    track_u: Optional[bool] = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def dora(self) -> Optional[LoraAdapter]:
        # read through the module dicts: ModuleList indexing cost several µs a call, and a step asks five times
        mods = self._modules["adapters"]._modules
        if len(mods) != 1:
            return None
        ad = next(iter(mods.values()))
        return ad if ad.config.mode == Mode.DORA else None

    def base_row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.base.row_norms_sq(dtype)  # frozen: computed once by the base and kept

    def weight_row_norm(self, dtype: torch.dtype = torch.float32, eps: float = 0.0,
                        U: Optional[torch.Tensor] = None, A_split: Optional[torch.Tensor] = None) -> torch.Tensor:
        """‖W + sBA‖_row of the DoRA adapter (then max(·, eps)), factored: U = W·Aᵀ runs A's rows through the
        frozen linear, unless the caller already has it (`U` `[d_out, r]`, e.g. from `matmul_with_exact`, with
        `A_split`, the split A it was computed from, if any: `factored_row_norm`)."""
        ad = self.dora
        with torch.no_grad():
            A = ad.lora_A.detach()
            if U is None:
                # fp32 products over the exact W (a bf16 W or A would cost the norm about 3e-5 relative)
                matmul = getattr(self.base, "matmul_exact", self.base.matmul)
                U, A_split = matmul(A.to(dtype)).T, None
            return factored_row_norm(self.base_row_norms_sq(dtype), U, A, ad.lora_B.detach(), ad.scale, dtype, eps,
                                     A_split)

    def _norm_key(self, dtype: torch.dtype) -> tuple:
        ad = self.dora
        return ad.lora_A._version, ad.lora_B._version, id(ad.lora_A), id(ad.lora_B), dtype

    def norm_is_cached(self, dtype: torch.dtype = torch.float32) -> bool:
        """Whether `dora_norm(dtype)` would return the cached norm (A and B unchanged, or the norm held)."""
        held = self.norm_held and self._g_cache is not None and self._g_cache[0][-1] == dtype
        return held or (self._g_cache is not None and self._g_cache[0] == self._norm_key(dtype))

    def running_u(self, A: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(U, A_ref) of the running U for A (fp32, detached), if this layer keeps one for it: U `[d_out, r]`
        contiguous fp32 with U = W·A_refᵀ to fp32 accuracy over the exact W. None when tracking is off here
        (`track_u`), the base has no `matmul_with_update`, or none was started for this A (`start_running_u`).

        How far it is from W·Aᵀ: the step's update D = bf16(A − A_ref) drops at most 2⁻⁹ of A's change since the
        last update, and that part stays in A − A_ref for the next one instead of being lost, so the error does not
        grow with the steps. After a step in which A changed by a whole A (not an optimizer step: a load into the
        same tensor), U is one bf16 rounding of A off for that step; `reset_running_u` makes the next step exact."""
        if not self._tracks_u(A):
            return None
        run = self._running_u
        if run is None or run[0] != self._running_key(A):
            return None
        return run[1], run[2]

    def start_running_u(self, A: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
        """Keep U = W·Aᵀ `[d_out, r]` (exact, just computed) as this layer's running U for A, if tracking applies
        here. Returns U as kept (or as given, where it is not)."""
        if not self._tracks_u(A):
            return U
        kept = U if U.is_contiguous() and U.dtype == torch.float32 else U.to(torch.float32).contiguous()
        self._running_u = (self._running_key(A), kept, A.detach().to(torch.float32, copy=True))
        return kept

    def weights_changed(self) -> None:
        """Drop what is kept from the adapters' values: DoRA's norm and g, and the playback casts of A and B. They
        are keyed on version counters, which in-place ops bump and torch's fused AdamW (the GPU optimizer) does not.
        The running U needs nothing: its update is computed from A's values."""
        self._g_cache = None
        self.__dict__.pop("_scale_kept", None)
        for ad in self.adapters:
            ad.__dict__.pop("_factors_kept", None)

    def reset_running_u(self) -> None:
        """Forget the running U: the next step with a stale norm computes U = W·Aᵀ afresh."""
        self._running_u = None

    def _tracks_u(self, A: torch.Tensor) -> bool:
        on = self.track_u if self.track_u is not None else A.is_cuda
        return bool(on) and has_exact_products(self.base)

    def _running_key(self, A: torch.Tensor) -> tuple:
        return id(self.dora.lora_A), tuple(A.shape), A.device

    def dora_norm(self, dtype: torch.dtype = torch.float32, U: Optional[torch.Tensor] = None,
                  A_split: Optional[torch.Tensor] = None) -> torch.Tensor:
        """max(‖W + sBA‖_row, 1e-6), detached; recomputed only when A or B changed (or `_g_cache` was cleared), from
        `U` = W·Aᵀ `[d_out, r]` when the caller has it (`DoraLinearFn`: the base product's decode gave it, from the
        split A `A_split`)."""
        if not self.norm_is_cached(dtype):
            self._g_cache = (self._norm_key(dtype), self.weight_row_norm(dtype, eps=DORA_EPS, U=U, A_split=A_split))
        return self._g_cache[1]

    def dora_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """g = m / max(‖W + sBA‖_row, 1e-6), the norm detached. Reused while A and B are unchanged (playback), and g
        itself while the norm and m are, where no gradient flows into m (one division fewer per call)."""
        m = self.dora.magnitude
        norm = self.dora_norm(dtype)
        if torch.is_grad_enabled() and m.requires_grad:
            return m.to(dtype) / norm
        key = (id(m), m._version, dtype, torch.is_inference_mode_enabled())
        kept = self.__dict__.get("_scale_kept")
        if kept is None or kept[0] is not norm or kept[1] != key:  # the norm itself is held: its id stays its own
            with torch.no_grad():
                kept = (norm, key, m.detach().to(dtype) / norm)
            self.__dict__["_scale_kept"] = kept
        return kept[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ad = self.dora
        if ad is not None and self._fused_step(x, ad):
            y = DoraLinearFn.apply(x, ad.lora_A, ad.lora_B, ad.magnitude, self)
        elif ad is not None:
            base_out = self.base.matmul(x)
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            # inference on bf16 activations: the adapter's product xa·Bᵀ is formed inside the composition kernel
            y = kernels.dora_compose_xa(base_out, *ad.delta_parts(x), self.dora_scale(dt), ad.scale)
        else:
            y = self.base.matmul(x)
            for w, a in zip(self.weights, self.adapters):
                y = y + (w * a.scale) * a.delta_input(x).to(y.dtype)
        bias = getattr(self.base, "bias", None)
        return y + bias.to(y.dtype) if bias is not None else y

    def _fused_step(self, x: torch.Tensor, ad: LoraAdapter) -> bool:
        """A training step as one Function (`DoraLinearFn`): where the fused training kernels run, without dropout
        (its mask would have to be kept), on a base that has the transposed product for the input gradient."""
        return ((not self.training or ad.config.dropout == 0) and hasattr(self.base, "matmul_transposed")
                and kernels.layer_training_fused(x, self.out_features, ad.lora_A, ad.lora_B, ad.magnitude))

    def extra_repr(self) -> str:
        kinds = ",".join(("dora" if a.is_dora else "lora") + f"(r={a.config.rank})" for a in self.adapters)
        return f"{self.name}, adapters={kinds}, weights={self.weights}"


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
    def forward(ctx, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, m: torch.Tensor, layer: "AdaptedLinear"):
        tk = kernels.triton_kernels()
        ad = layer.dora
        s = float(ad.scale)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        combined = layer.base.matmul_with_exact if has_exact_products(layer.base) else None
        dt = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32  # as `LoraAdapter.delta_input`
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
        lora = None if dt == torch.bfloat16 and r <= kernels.COMPOSE_XA_MAX_RANK else torch.mm(xa, Bc.T)
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
        tk = kernels.triton_kernels()
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
        d_base, d_lora, d_g_parts = tk.compose_backward(dy2, g, inner if need_m else None, s,
                                                        base_dtype if need_x or (shared and need_lora) else None,
                                                        lora_dtype if need_lora and not shared else None,
                                                        reduce_d_g=False)
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
