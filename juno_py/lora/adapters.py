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
from torch.nn import functional as F

from juno_py.kernels import dora_compose, norm_assemble
from juno_py.lora.format import AdapterEntry, Fingerprint, Init, Mode, Scaling

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


def factored_row_norm(base_sq: torch.Tensor, U: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """‖W + sBA‖ per row from ‖W‖²_row, U = W·Aᵀ `[d_out, r]`, A `[r, d_in]`, B `[d_out, r]`; no `d_out×d_in`.

    ‖W+sBA‖²_row = ‖W‖²_row + 2s·rowsum(B ⊙ U) + s²·rowsum((B·G) ⊙ B) with G = A·Aᵀ; accumulated in `dtype`.
    """
    A, B, U = A.to(dtype), B.to(dtype), U.to(dtype)
    G = A @ A.T
    cross = (B * U).sum(dim=1)
    ba_sq = ((B @ G) * B).sum(dim=1)
    return norm_assemble(base_sq.to(dtype), cross, ba_sq, s)  # fused kernel on CUDA, eager reference elsewhere


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
        dt = x.dtype if x.dtype in (torch.float64, torch.bfloat16) else torch.float32
        x = x.to(dt)
        if self.training and self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, training=True)
        return (x @ self.lora_A.T.to(dt)) @ self.lora_B.T.to(dt)

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

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def dora(self) -> Optional[LoraAdapter]:
        return self.adapters[0] if len(self.adapters) == 1 and self.adapters[0].is_dora else None

    def base_row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.base.row_norms_sq(dtype)  # frozen: computed once by the base and kept

    def weight_row_norm(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """‖W + sBA‖_row of the DoRA adapter, factored: U = W·Aᵀ runs A's rows through the frozen linear."""
        ad = self.dora
        with torch.no_grad():
            A = ad.lora_A.detach()
            # fp32 products over the exact W (a bf16 W or A would cost the norm about 3e-5 relative)
            matmul = getattr(self.base, "matmul_exact", self.base.matmul)
            U = matmul(A.to(dtype)).T
            return factored_row_norm(self.base_row_norms_sq(dtype), U, A, ad.lora_B.detach(), ad.scale, dtype)

    def dora_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """g = m / max(‖W + sBA‖_row, 1e-6), the norm detached. Reused while A and B are unchanged (playback)."""
        ad = self.dora
        key = (ad.lora_A._version, ad.lora_B._version, id(ad.lora_A), id(ad.lora_B), dtype)
        held = self.norm_held and self._g_cache is not None and self._g_cache[0][-1] == dtype
        if not held and (self._g_cache is None or self._g_cache[0] != key):
            self._g_cache = (key, self.weight_row_norm(dtype).clamp_min(DORA_EPS))
        return ad.magnitude.to(dtype) / self._g_cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base_out = self.base.matmul(x)
        ad = self.dora
        if ad is not None:
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            y = dora_compose(base_out, ad.delta_input(x), self.dora_scale(dt), ad.scale)
        else:
            y = base_out
            for w, a in zip(self.weights, self.adapters):
                y = y + (w * a.scale) * a.delta_input(x).to(y.dtype)
        bias = getattr(self.base, "bias", None)
        return y + bias.to(y.dtype) if bias is not None else y

    def extra_repr(self) -> str:
        kinds = ",".join(("dora" if a.is_dora else "lora") + f"(r={a.config.rank})" for a in self.adapters)
        return f"{self.name}, adapters={kinds}, weights={self.weights}"
