"""Adapters on frozen quantized linears, the module side: LoRA `y = Wx + s·BA·drop(x) + b` and DoRA
`y = g ⊙ (Wx + s·BA·drop(x)) + b` with `g = m / max(‖W + sBA‖_row, 1e-6)` detached.

The trainable/frozen line is in the types: `LoraAdapter` holds only trainable tensors (A, B and, for DoRA,
the magnitude m); `AdaptedLinear` pairs one frozen base with the adapters played on it and keeps DoRA's norm (and
its running U) between calls; `AdapterSet`, the adapters attached to one model, is the `Trainable` the training
loop trains. DoRA's numerics (the factored row norm, the fused training step, the composition and every dispatch
threshold) are in `juno_py.kernels.dora`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol, Union, cast

import torch
from torch import nn
from torch.nn import functional as F

from juno_py.kernels.dequant import lora_xa
from juno_py.kernels.dora import DORA_EPS, DoraLinearFn, dora_compose_xa, factored_row_norm, layer_training_fused
from juno_py.lora import bf16_step
from juno_py.lora.format import (
    AdapterEntry,
    Fingerprint,
    Init,
    Mode,
    Scaling,
    encode_adapter,
    parse_entry_key,
    sort_key,
    write_adapter,
)
from juno_py.train.state import FORMAT as STATE_FORMAT
from juno_py.train.trainable import StepNote, Trainable
from juno_py.weights.base import has_exact_products


class BaseLinear(Protocol):
    """What an adapted layer asks of every frozen base linear (`juno_py.weights`); the optional products it uses
    where a base has them (`matmul_exact`, `matmul_with_exact`, `matmul_with_update`, `matmul_transposed`) and a
    `bias` are looked up on the base."""

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


@dataclass(frozen=True)
class AdapterConfig:
    rank: int = 8
    alpha: float = 16.0
    mode: Mode = Mode.LORA
    scaling: Scaling = Scaling.STANDARD
    init: Init = Init.KAIMING_UNIFORM
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank {self.rank}: expected >= 1")
        if not math.isfinite(self.alpha):
            raise ValueError(f"alpha {self.alpha}: expected a finite number")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout}: expected 0 <= p < 1")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.scaling == Scaling.RSLORA else self.rank)


def initial_A(d_in: int, config: AdapterConfig, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A fresh adapter's A `[r, d_in]` on the CPU: kaiming-uniform U(±1/√d_in) or the legacy N(0, 0.01²), drawn from
    `generator`."""
    a = torch.empty(config.rank, d_in)
    if config.init == Init.KAIMING_UNIFORM:
        bound = 1.0 / math.sqrt(d_in)
        return a.uniform_(-bound, bound, generator=generator)
    return a.normal_(0.0, 0.01, generator=generator)


def initial_magnitude(config: AdapterConfig, d_out: int, magnitude: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A fresh DoRA adapter's m `[d_out]` (fp32, its own copy of the base's row norms `magnitude`); None for LoRA."""
    if config.mode != Mode.DORA:
        return None
    if magnitude is None:
        raise ValueError("a DoRA adapter needs its initial magnitude (the base's row norms)")
    return magnitude.detach().to(torch.float32).clone().reshape(d_out)


class LoraAdapter(nn.Module):
    """Trainable tensors of one adapter on one linear: A `[r, d_in]`, B `[d_out, r]`, and DoRA's m `[d_out]`.

    Typed as tensors, not parameters: an expert's adapter (`ExpertAdapter`) holds views of stacked parameters."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    magnitude: Optional[torch.Tensor]

    def __init__(
        self,
        d_in: int,
        d_out: int,
        config: AdapterConfig,
        generator: Optional[torch.Generator] = None,
        magnitude: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.config = config
        self.lora_A = nn.Parameter(initial_A(d_in, config, generator))
        self.lora_B = nn.Parameter(torch.zeros(d_out, config.rank))
        mag = initial_magnitude(config, d_out, magnitude)
        self.magnitude = None if mag is None else nn.Parameter(mag)

    @property
    def scale(self) -> float:
        return self.config.scale

    @property
    def is_dora(self) -> bool:
        return self.config.mode == Mode.DORA

    @property
    def identity(self) -> tuple[int, ...]:
        """What names this adapter's A and B for as long as they are the same tensors, whatever their values (a layer
        keys what it keeps on it with their version counters: DoRA's norm, its running U): the tensors themselves."""
        return id(self.lora_A), id(self.lora_B)

    def delta_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(drop(x)·Aᵀ, B): the unscaled B·A·drop(x) is the first times the second's transpose. Both in fp32 (float64
        when x is: exactness checks; bf16 when x is: the GPU's bf16 activations: the fp32 A and B are cast per call,
        as under torch autocast)."""
        dt = x.dtype if x.dtype in (torch.float64, torch.bfloat16) else torch.float32
        x = x.to(dt)
        if self.training and self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, training=True)
        A, B = self.factors(dt)
        if x.numel() == x.shape[-1] and not (torch.is_grad_enabled() and (x.requires_grad or A.requires_grad)):
            # one token in playback: a small kernel where one runs (`lora_xa`), not a split-K GEMM and its reduction
            return lora_xa(x.reshape(1, -1), A).reshape(*x.shape[:-1], A.shape[0]), B
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
        # A and B themselves are held, not their ids: an expert's rows are views made anew when its stack changes,
        # and a new view may take a freed one's id
        key = (dtype, A.device, A._version, B._version, torch.is_inference_mode_enabled())
        kept = self.__dict__.get("_factors_kept")
        if kept is None or kept[0] != key or kept[3] is not A or kept[4] is not B:
            with torch.no_grad():
                kept = (key, A.detach().to(dtype), B.detach().to(dtype), A, B)
            self.__dict__["_factors_kept"] = kept
        return kept[1], kept[2]

    def to_entry(
        self, key: str, fingerprint: Optional[Fingerprint] = None, values: Optional[dict[str, torch.Tensor]] = None
    ) -> AdapterEntry:
        """The adapter as an adapter.bin entry; `values`: the whole tensors by parameter name ("lora_A", "lora_B",
        "magnitude") where the module holds only a shard of them (sharded training gathers them first)."""
        c = self.config
        given = values or {}

        def array(name: str) -> Any:
            t = given[name] if name in given else getattr(self, name)
            return t.detach().cpu().numpy().copy()

        mag = array("magnitude") if c.mode == Mode.DORA else None
        return AdapterEntry(
            key,
            array("lora_A"),
            array("lora_B"),
            float(c.alpha),
            c.scaling,
            c.init,
            c.mode,
            mag,
            fingerprint,
        )

    @classmethod
    def from_entry(cls, e: AdapterEntry) -> "LoraAdapter":
        cfg = AdapterConfig(rank=e.rank, alpha=e.alpha, mode=e.mode, scaling=e.scaling, init=e.init)
        mag = torch.from_numpy(e.magnitude.copy()) if e.magnitude is not None else None
        ad = cls(e.in_dim, e.out_dim, cfg, magnitude=mag)
        with torch.no_grad():
            ad.lora_A.copy_(torch.from_numpy(e.A))
            ad.lora_B.copy_(torch.from_numpy(e.B))
        return ad


class ExpertStack(nn.Module):
    """The per-expert adapters of one expert projection of one block (`<layer>:<target>.<e>`, all of one config) as
    three tensors: A `[E, r, d_in]`, B `[E, d_out, r]` and DoRA's m `[E, d_out]`, row e expert e's.

    Held apart, a model of 48 layers and 128 experts has some 37,000 such tensors, and every training step pays for
    each on the host: the grouped expert path stacks them for its grouped matmuls, backward accumulates a gradient
    into each, and the gradient norm, clipping, the optimizer and zero_grad loop over them. Stacked, all of that sees
    three tensors per projection and block, and the grouped path multiplies the stacks themselves
    (`juno_py.models.moe`). Each expert's `ExpertAdapter` reads its row through `rows()`, so playback, the per-expert
    loop, DoRA, merging and adapter.bin see one adapter per expert.

    The stack is registered once in the model (`MoEFeedForward.adapter_stacks`), so the model's parameters, device
    moves, DDP and FSDP see its tensors once; the expert adapters hold it outside their module tree."""

    magnitude: Optional[nn.Parameter]

    def __init__(
        self, config: AdapterConfig, lora_A: torch.Tensor, lora_B: torch.Tensor, magnitude: Optional[torch.Tensor]
    ):
        super().__init__()
        self.config = config
        self.n_expert = int(lora_A.shape[0])
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)
        self.magnitude = None if magnitude is None else nn.Parameter(magnitude)
        self._generation = 0
        self._rows: Optional[tuple[tuple[Any, ...], _Rows]] = None

    def rows(self) -> _Rows:
        """Every expert's (A, B, m) as views of the stacked tensors, from one `unbind` per tensor, kept while the
        tensors, their values (version counters, `weights_changed`) and the grad mode are those they were made under.

        One `unbind` is one gradient node for all the experts: its backward stacks their gradients once. A view per
        expert (`A[e]`) would be a node each, whose backward writes a whole zero stack with its row in it, E² work for
        a backward through every expert. Made afresh when the values changed in place: a view kept across such a
        change would replay itself as an as_strided view, with that same whole-stack backward."""
        tensors = [t for t in (self.lora_A, self.lora_B, self.magnitude) if t is not None]
        key = (
            self._generation,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            *((id(t), t.data_ptr(), t._version, t.requires_grad) for t in tensors),
        )
        kept = self._rows
        if kept is None or kept[0] != key:
            m = self.magnitude
            kept = (key, (self.lora_A.unbind(0), self.lora_B.unbind(0), None if m is None else m.unbind(0)))
            self._rows = kept
        return kept[1]

    def weights_changed(self) -> None:
        """The values changed where the version counters may not show it (torch's fused AdamW): the experts' views
        are made afresh, so what their layers keep keyed on a view (the playback casts, DoRA's norm) is recomputed."""
        self._generation += 1
        self._rows = None

    def _apply(self, fn: Any, recurse: bool = True) -> ExpertStack:
        # a device or dtype move: the kept views would hold the tensors it replaces
        self._rows = None
        return cast(ExpertStack, super()._apply(fn, recurse))  # type: ignore[no-untyped-call]  # torch leaves _apply unannotated

    def adapters(self) -> list[ExpertAdapter]:
        """One adapter per expert, each viewing its row."""
        return [ExpertAdapter(self, e) for e in range(self.n_expert)]

    def extra_repr(self) -> str:
        kind = "dora" if self.config.mode == Mode.DORA else "lora"
        return f"{self.n_expert} experts, {kind}(r={self.config.rank})"


# per expert: A, B and (DoRA) m
_Rows = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], Optional[tuple[torch.Tensor, ...]]]


class ExpertAdapter(LoraAdapter):
    """Expert `index`'s adapter in an `ExpertStack`: A, B and m are its rows of the stack's tensors (`rows()`), so
    it trains, plays and saves like a LoraAdapter of its own, while the optimizer sees only the stack. It has no
    parameters of its own."""

    stack: ExpertStack

    def __init__(self, stack: ExpertStack, index: int):
        nn.Module.__init__(self)
        self.config = stack.config
        self.__dict__["stack"] = stack  # not a submodule: the stack's tensors are registered once, where it lives
        self.index = index

    @property
    def lora_A(self) -> torch.Tensor:  # type: ignore[override]  # a read-only view
        return self.stack.rows()[0][self.index]

    @property
    def lora_B(self) -> torch.Tensor:  # type: ignore[override]  # a read-only view
        return self.stack.rows()[1][self.index]

    @property
    def magnitude(self) -> Optional[torch.Tensor]:  # type: ignore[override]  # a read-only view
        m = self.stack.rows()[2]
        return None if m is None else m[self.index]

    @property
    def identity(self) -> tuple[int, ...]:
        """The stack's tensors and the row, not the row's views, which are made anew whenever the stack changes or
        the grad mode does (`ExpertStack.rows`)."""
        return id(self.stack.lora_A), id(self.stack.lora_B), self.index

    def extra_repr(self) -> str:
        return f"expert {self.index} of a stack"


def _add_lora(y: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, alpha: float) -> torch.Tensor:
    """y + alpha·xa·Bᵀ: one `addmm` (the scale as its alpha) where the dtypes agree, else the product, scaled and
    added in y's dtype."""
    if xa.dtype != y.dtype:
        return y + alpha * (xa @ B.T).to(y.dtype)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), B.T, alpha=alpha)
    return out.reshape(y.shape)


class SharedInputPlay:
    """Playback of linears that read one input (a block's q, k and v; its gate and up), each an AdaptedLinear with
    one LoRA: their x·Aᵀ as ONE product over the A's concatenated once, here, then each base's product with its
    slice (inside the base's own kernel where it has one, `matmul_lora`). A decode step on a GPU is bound by its
    launches: this is one launch instead of one per linear. `build` returns None where the linears do not all
    fit (DoRA, several or no adapters, dropout in training); the caller then calls each linear. The concatenated A
    is a copy: build again after the adapters change."""

    def __init__(self, A: torch.Tensor, parts: list[tuple[Any, int, int, torch.Tensor, float]]):
        self.A, self.parts = A, parts
        # the parts whose bases' products can run as one grouped launch (`matmul_group`: one GGML type), by type
        kinds: dict[Any, list[int]] = {}
        for i, (m, *_) in enumerate(parts):
            if hasattr(m.base, "matmul_group"):
                kinds.setdefault(getattr(m.base, "ggml_type", None), []).append(i)
        self.groups = [idx for idx in kinds.values() if len(idx) > 1]

    @staticmethod
    def build(modules: list[nn.Module], dtype: torch.dtype) -> Optional["SharedInputPlay"]:
        As, parts, lo = [], [], 0
        for m in modules:
            if not isinstance(m, AdaptedLinear) or m.dora is not None or len(m.adapters) != 1:
                return None
            a = cast(LoraAdapter, m.adapters[0])
            if a.training and a.config.dropout > 0:
                return None
            with torch.no_grad():
                A, B = a.factors(dtype)
            As.append(A)
            parts.append((m, lo, lo + A.shape[0], B, m.weights[0] * a.scale))
            lo += A.shape[0]
        if not parts or len({A.shape[1] for A in As}) != 1:
            return None
        return SharedInputPlay(torch.cat(As).contiguous(), parts)

    def __call__(self, x: torch.Tensor, xa: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Each linear's output for x `[..., d]` (no autograd), as its own forward gives it. `xa`: x·Aᵀ `[tokens, R]`
        where the caller computed it (the decode step, in the launch that normalized x)."""
        xa = self._xa(x, xa)
        ys: list[Optional[torch.Tensor]] = [None] * len(self.parts)
        for idx in self.groups:  # one launch for the parts of one GGML type (`matmul_group`)
            parts = [self.parts[i] for i in idx]
            bases = [m.base for m, *_ in parts]
            y = type(bases[0]).matmul_group(bases, x, [(xa[:, lo:hi], B, c) for _, lo, hi, B, c in parts])
            if y is not None:
                at = 0
                for i, b in zip(idx, bases):
                    ys[i], at = y[..., at : at + b.out_features], at + b.out_features
        outs = []
        for (m, lo, hi, B, coef), y in zip(self.parts, ys):
            if y is None:
                xa_m = xa[:, lo:hi]
                fused = getattr(m.base, "matmul_lora", None)
                y = fused(x, xa_m, B, coef) if fused is not None else None
                if y is None:
                    y = _add_lora(m.base.matmul(x), xa_m.reshape(*x.shape[:-1], hi - lo), B, coef)
            bias: Optional[torch.Tensor] = getattr(m.base, "bias", None)
            outs.append(y + bias.to(y.dtype) if bias is not None else y)
        return outs

    def gated(self, x: torch.Tensor, act: str, xa: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """act(gate)·up of a gate and an up (the two parts, in that order) in one grouped launch with their LoRA
        terms (`matmul_group`'s gated mode: the bits of the two products and `elementwise.gated`), or None where it
        does not apply; the caller then calls this play and the activation."""
        if len(self.parts) != 2 or self.groups != [[0, 1]]:
            return None
        xa = self._xa(x, xa)
        bases = [m.base for m, *_ in self.parts]
        loras = [(xa[:, lo:hi], B, c) for _, lo, hi, B, c in self.parts]
        y: Optional[torch.Tensor] = type(bases[0]).matmul_group(bases, x, loras, act=act)
        return y

    def _xa(self, x: torch.Tensor, xa: Optional[torch.Tensor]) -> torch.Tensor:
        if xa is not None:
            return xa
        x2 = x.reshape(-1, x.shape[-1])
        return lora_xa(x2, self.A) if x2.shape[0] == 1 else x2 @ self.A.T


class AdaptedLinear(nn.Module):
    """A frozen base linear with adapters: several LoRAs summed with playback weights, or one DoRA."""

    base: BaseLinear

    def __init__(
        self, base: BaseLinear, adapters: list[LoraAdapter], weights: Optional[list[float]] = None, name: str = ""
    ):
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleList(adapters)
        self.weights = list(weights) if weights is not None else [1.0] * len(adapters)
        self.name = name
        if any(a.is_dora for a in adapters):
            if len(adapters) != 1 or self.weights[0] != 1.0:
                raise ValueError(f"{name or 'linear'}: a DoRA adapter plays alone and at scale 1")
        self._g_cache: Optional[tuple[tuple[Any, ...], torch.Tensor]] = None
        self._running_u: Optional[tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = None  # (key, U, A_ref)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def dora(self) -> Optional[LoraAdapter]:
        # read through the module dicts: ModuleList indexing cost several µs a call, and a step asks five times
        mods = self._modules["adapters"]._modules  # type: ignore[union-attr]
        if len(mods) != 1:
            return None
        ad = cast(LoraAdapter, next(iter(mods.values())))
        return ad if ad.config.mode == Mode.DORA else None

    def _dora(self) -> LoraAdapter:
        """The DoRA adapter, for the methods that only a DoRA layer calls."""
        ad = self.dora
        if ad is None:
            raise ValueError(f"{self.name or 'linear'}: no DoRA adapter")
        return ad

    def base_row_norms_sq(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.base.row_norms_sq(dtype)  # frozen: computed once by the base and kept

    def weight_row_norm(
        self,
        dtype: torch.dtype = torch.float32,
        eps: float = 0.0,
        U: Optional[torch.Tensor] = None,
        A_split: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """‖W + sBA‖_row of the DoRA adapter (then max(·, eps)), factored: U = W·Aᵀ runs A's rows through the
        frozen linear, unless the caller already has it (`U` `[d_out, r]`, e.g. from `matmul_with_exact`, with
        `A_split`, the split A it was computed from, if any: `factored_row_norm`)."""
        ad = self._dora()
        with torch.no_grad():
            A = ad.lora_A.detach()
            if U is None:
                # fp32 products over the exact W (a bf16 W or A would cost the norm about 3e-5 relative)
                matmul = getattr(self.base, "matmul_exact", self.base.matmul)
                U, A_split = matmul(A.to(dtype)).T, None
            return factored_row_norm(
                self.base_row_norms_sq(dtype), U, A, ad.lora_B.detach(), ad.scale, dtype, eps, A_split
            )

    def _norm_key(self, dtype: torch.dtype) -> tuple[Any, ...]:
        ad = self._dora()
        return ad.lora_A._version, ad.lora_B._version, ad.identity, dtype

    def norm_is_cached(self, dtype: torch.dtype = torch.float32) -> bool:
        """Whether `dora_norm(dtype)` would return the cached norm (A and B unchanged since it was computed)."""
        return self._g_cache is not None and self._g_cache[0] == self._norm_key(dtype)

    def tracks_running_u(self, A: torch.Tensor) -> bool:
        """Whether this layer keeps a running U for A (`running_u`): on CUDA, over a base with `matmul_with_update`,
        where moving U costs two products of W's size per row of A instead of the three of computing it afresh (a
        dense W: one instead of two). A subclass may choose otherwise (the CPU tests of the device path; the
        benchmarks' comparison with U afresh every step)."""
        return A.is_cuda and has_exact_products(self.base)

    def running_u(self, A: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(U, A_ref) of the running U for A (fp32, detached), if this layer keeps one for it: U `[d_out, r]`
        contiguous fp32 with U = W·A_refᵀ to fp32 accuracy over the exact W. None when tracking is off here
        (`tracks_running_u`) or none was started for this A (`start_running_u`).

        How far it is from W·Aᵀ: the step's update D = bf16(A − A_ref) drops at most 2⁻⁹ of A's change since the
        last update, and that part stays in A − A_ref for the next one instead of being lost, so the error does not
        grow with the steps. After a step in which A changed by a whole A (not an optimizer step: a load into the
        same tensor), U is one bf16 rounding of A off for that step; `reset_running_u` makes the next step exact."""
        if not self.tracks_running_u(A):
            return None
        run = self._running_u
        if run is None or run[0] != self._running_key(A):
            return None
        return run[1], run[2]

    def start_running_u(self, A: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
        """Keep U = W·Aᵀ `[d_out, r]` (exact, just computed) as this layer's running U for A, if tracking applies
        here. Returns U as kept (or as given, where it is not)."""
        if not self.tracks_running_u(A):
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

    def _running_key(self, A: torch.Tensor) -> tuple[Any, ...]:
        return self._dora().identity, tuple(A.shape), A.device

    def dora_norm(
        self,
        dtype: torch.dtype = torch.float32,
        U: Optional[torch.Tensor] = None,
        A_split: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """max(‖W + sBA‖_row, 1e-6), detached; recomputed only when A or B changed (or `_g_cache` was cleared), from
        `U` = W·Aᵀ `[d_out, r]` when the caller has it (`DoraLinearFn`: the base product's decode gave it, from the
        split A `A_split`)."""
        if self._g_cache is None or not self.norm_is_cached(dtype):
            self._g_cache = (self._norm_key(dtype), self.weight_row_norm(dtype, eps=DORA_EPS, U=U, A_split=A_split))
        return self._g_cache[1]

    def dora_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """g = m / max(‖W + sBA‖_row, 1e-6), the norm detached. Reused while A and B are unchanged (playback), and g
        itself while the norm and m are, where no gradient flows into m (one division fewer per call)."""
        m = self._dora().magnitude
        assert m is not None  # a DoRA adapter has its magnitude
        norm = self.dora_norm(dtype)
        if torch.is_grad_enabled() and m.requires_grad:
            return m.to(dtype) / norm
        key = (id(m), m._version, dtype, torch.is_inference_mode_enabled())
        kept = self.__dict__.get("_scale_kept")
        if kept is None or kept[0] is not norm or kept[1] != key:  # the norm itself is held: its id stays its own
            with torch.no_grad():
                kept = (norm, key, m.detach().to(dtype) / norm)
            self.__dict__["_scale_kept"] = kept
        return cast(torch.Tensor, kept[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ad = self.dora
        y: torch.Tensor
        if ad is not None and self._fused_step(x, ad):
            y = DoraLinearFn.apply(x, ad.lora_A, ad.lora_B, ad.magnitude, self)  # type: ignore[no-untyped-call]
        elif ad is not None:
            base_out = self.base.matmul(x)
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            # inference on bf16 activations: the adapter's product xa·Bᵀ is formed inside the composition kernel
            y = dora_compose_xa(base_out, *ad.delta_parts(x), self.dora_scale(dt), ad.scale)
        else:
            played = list(zip(self.weights, cast("Iterable[LoraAdapter]", self.adapters)))
            if len(played) == 1 and bf16_step.applies(self.base, x, played[0][1].config.dropout):
                # a training step on a CPU streaming base in bf16: one node, x and its gradient cast once
                (w0, a0) = played[0]
                y = bf16_step.LoraBf16Fn.apply(x, a0.lora_A, a0.lora_B, self.base, w0 * a0.scale)  # type: ignore[no-untyped-call]
            elif torch.is_grad_enabled() or not played:
                # training: each term s·xa·Bᵀ one `addmm` over y (the scale as its alpha), not a product, a scaling
                # and an addition that each pass over [tokens, d_out]
                y = self.base.matmul(x)
                for w, a in played:
                    y = _add_lora(y, *a.delta_parts(x), w * a.scale)
            else:
                # inference (playback): each term s·xa·Bᵀ is one GEMM added in place of a product, a scaling and an
                # addition, and the first rides on the frozen product's own kernel where the base can take it (a
                # decode step on a GPU is bound by its launches)
                (w0, a0), rest = played[0], played[1:]
                xa, B = a0.delta_parts(x)
                fused = getattr(self.base, "matmul_lora", None)
                got = fused(x, xa, B, w0 * a0.scale) if fused is not None else None
                y = got if got is not None else _add_lora(self.base.matmul(x), xa, B, w0 * a0.scale)
                for w, a in rest:
                    y = _add_lora(y, *a.delta_parts(x), w * a.scale)
        bias: Optional[torch.Tensor] = getattr(self.base, "bias", None)
        return y + bias.to(y.dtype) if bias is not None else y

    def _fused_step(self, x: torch.Tensor, ad: LoraAdapter) -> bool:
        """A training step as one Function (`DoraLinearFn`): where the fused training kernels run, without dropout
        (its mask would have to be kept), on a base that has the transposed product for the input gradient."""
        assert ad.magnitude is not None
        return (
            (not self.training or ad.config.dropout == 0)
            and hasattr(self.base, "matmul_transposed")
            and layer_training_fused(x, self.out_features, ad.lora_A, ad.lora_B, ad.magnitude)
        )

    def extra_repr(self) -> str:
        kinds = ",".join(
            ("dora" if a.is_dora else "lora") + f"(r={a.config.rank})"
            for a in cast("Iterable[LoraAdapter]", self.adapters)
        )
        return f"{self.name}, adapters={kinds}, weights={self.weights}"


# ------------------------------------------------------------------------------------------ the trainable set
class AdapterSet(Trainable):
    """The adapters attached to one model, keyed '<layer>:<target>' in adapter.bin order: the `Trainable` the
    training loop trains (`juno_py.lora.attach` makes one). An adapter played on every expert of a block
    ('<layer>:<target>.*') is one LoraAdapter inside one AdaptedLinear per expert; `modules` holds the first. One
    adapter per expert ('<layer>:<target>.<e>') is an `ExpertAdapter` of the projection's `ExpertStack`: the
    parameters are the stack's, named '<layer>:<target>.lora_A' (and so on), one set for all the experts."""

    state_format = STATE_FORMAT

    def __init__(self, model: Any, modules: dict[str, AdaptedLinear]):
        self.model = model
        self.modules = dict(sorted(modules.items(), key=lambda kv: sort_key(kv[0])))
        self._adapters = {k: cast(LoraAdapter, m.adapters[0]) for k, m in self.modules.items()}
        # what holds the parameters, by the prefix of their names, in adapter.bin order: an adapter, or a stack (at
        # its first expert's place)
        self._owners: dict[str, Union[LoraAdapter, ExpertStack]] = {}
        for key, ad in self._adapters.items():
            if isinstance(ad, ExpertAdapter):
                self._owners.setdefault(key.rsplit(".", 1)[0], ad.stack)
            else:
                self._owners[key] = ad
        self._stacks = [o for o in self._owners.values() if isinstance(o, ExpertStack)]
        self._dora_layers = [m for m in self.modules.values() if m.dora is not None]
        # the layers that keep something keyed on their adapters' tensors that a step makes stale: a stacked LoRA
        # expert keeps only casts keyed on its views, which its stack's `weights_changed` makes anew
        self._keeping = [m for m in self.modules.values() if m.dora is not None or not _stacked(m)]

    @property
    def adapters(self) -> dict[str, LoraAdapter]:
        """Every adapter by key (the experts' `ExpertAdapter`s too). The set's own dict: read it, do not change it."""
        return self._adapters

    def parameters(self) -> Iterator[nn.Parameter]:
        for owner in self._owners.values():
            yield from owner.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for prefix, owner in self._owners.items():
            for name, p in owner.named_parameters():
                yield f"{prefix}.{name}", p

    def groups(self) -> dict[str, list[nn.Parameter]]:
        """A, B and magnitude parameters apart: weight decay applies to A only; LoRA+ scales B's rate."""
        groups: dict[str, list[nn.Parameter]] = {"A": [], "B": [], "magnitude": []}
        for owner in self._owners.values():
            params = dict(owner.named_parameters())
            groups["A"].append(params["lora_A"])
            groups["B"].append(params["lora_B"])
            if "magnitude" in params:
                groups["magnitude"].append(params["magnitude"])
        return groups

    def param_groups(self, lr: float, weight_decay: float, plus_ratio: float = 1.0) -> list[dict[str, Any]]:
        """The optimizer's groups: A at `lr` with `weight_decay`, B at `lr × plus_ratio` (LoRA+) and DoRA's
        magnitude at `lr`, neither decayed; each remembers its `base_lr` for the schedule. Empty groups are left
        out."""
        groups = self.groups()
        spec = [("A", lr, weight_decay), ("B", lr * plus_ratio, 0.0), ("magnitude", lr, 0.0)]
        return [
            {"name": name, "params": groups[name], "lr": rate, "base_lr": rate, "weight_decay": wd}
            for name, rate, wd in spec
            if groups[name]
        ]

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def entries(self, values: Optional[dict[str, torch.Tensor]] = None) -> list[AdapterEntry]:
        """The adapter.bin entries; `values`: whole tensors by `named_parameters` name, in place of the modules' own
        (which sharded training holds in parts). A stacked expert's entry is its row of the stack."""
        fps = TensorFingerprints(self.model)
        given: dict[str, dict[str, torch.Tensor]] = {}
        for n, v in (values or {}).items():
            prefix, name = n.rsplit(".", 1)
            given.setdefault(prefix, {})[name] = v
        out = []
        for key, ad in self._adapters.items():
            if isinstance(ad, ExpertAdapter):
                own = {n: v[ad.index] for n, v in given.get(key.rsplit(".", 1)[0], {}).items()}
            else:
                own = given.get(key, {})
            out.append(ad.to_entry(key, fps.of(ref_tensor(self.model, key)), own or None))
        return out

    def save(self, path: Union[str, Path], values: Optional[dict[str, torch.Tensor]] = None) -> Path:
        return write_adapter(path, self.entries(values))

    def saved_bytes(self) -> int:
        """The adapter file's size: its encoding depends on the shapes and keys only, not the values."""
        return len(encode_adapter(self.entries()))

    def weights_changed(self) -> None:
        """Drop every cached DoRA norm (and g, and the playback casts of A and B: `AdaptedLinear.weights_changed`):
        A or B changed in a way their version counters may not show. A DoRA layer caches ‖W + sBA‖ keyed by A's and
        B's `_version`, which in-place ops bump but torch's fused AdamW (the GPU optimizer) does not: without this
        call after such a step, every later step would reuse the first norm, and a validation pass the first casts.
        The experts' stacks make their views anew instead (`ExpertStack.weights_changed`): one call per stack, not
        one per expert."""
        for m in self._keeping:
            m.weights_changed()
        for s in self._stacks:
            s.weights_changed()

    def train(self, mode: bool = True) -> AdapterSet:
        for ad in self.adapters.values():
            ad.train(mode)
        return self

    def eval(self) -> AdapterSet:
        return self.train(False)

    # ---- the training loop's hooks ----------------------------------------------------------------------------
    def start_run(self) -> None:
        """A may hold other values than a DoRA layer's running U was moved to (a resume, an earlier run in this
        process): the first step computes U afresh."""
        for m in self._dora_layers:
            m.reset_running_u()

    def before_step(self) -> Optional[StepNote]:
        """DoRA's detached row norms for this step. On a CPU they are recomputed here, once per step (the forward
        then reuses them). Elsewhere each stale norm is recomputed by the step's own forward (inside a CUDA graph,
        or eagerly), from the tiles it decodes for its base product anyway (`matmul_with_exact`): not twice. The
        note says how many and how long (`in_step`: inside the step's forward)."""
        dora = self._dora_layers
        if not dora:
            return None
        if self.model.embed.device.type != "cpu" or getattr(self.model, "sharded", False):
            # sharded: the blocks' weights are whole only inside their forward, which computes the norms
            return StepNote("norm_refresh", {"modules": len(dora), "ms": 0.0, "in_step": True})
        t0 = time.perf_counter()
        with torch.no_grad():
            for m in dora:
                m.dora_scale()
        return StepNote("norm_refresh", {"modules": len(dora), "ms": 1e3 * (time.perf_counter() - t0)})

    def after_optimizer_step(self) -> None:
        """DoRA's cached norms go: a fused optimizer bumps no version counters (`weights_changed`)."""
        self.weights_changed()

    def graph_blocker(self) -> Optional[str]:
        if any(owner.config.dropout > 0 for owner in self._owners.values()):
            return "adapter dropout (its random masks would be fixed at capture)"
        return None

    def forget_derived(self) -> None:
        """Drop DoRA's cached norms (and what `weights_changed` drops with them): a captured step computes each norm
        inside the graph, from the adapter as it is at replay."""
        self.weights_changed()

    def derived_tensors(self) -> list[torch.Tensor]:
        """DoRA's cached norms."""
        return [m._g_cache[1] for m in self._dora_layers if m._g_cache is not None]


def _stacked(module: AdaptedLinear) -> bool:
    """Whether a layer's adapters are all rows of expert stacks."""
    return all(isinstance(a, ExpertAdapter) for a in module.adapters)


def ref_tensor(model: Any, key: str) -> str:
    """The GGUF tensor name of the base linear at key '<layer>:<target>' (an expert's: its 3-D tensor)."""
    layer, target, _ = parse_entry_key(key)
    block = model.layout.blocks[layer]
    slot = block.experts[target] if target in block.experts else block.targets[target]
    return cast(str, slot.tensor)


class TensorFingerprints:
    """SHA-256 of base tensors, each hashed once."""

    def __init__(self, model: Any):
        self.gguf = model.gguf
        self._cache: dict[str, Fingerprint] = {}

    def of(self, tensor: str) -> Fingerprint:
        if tensor not in self._cache:
            self._cache[tensor] = Fingerprint.of_tensor(self.gguf.tensor(tensor))
        return self._cache[tensor]
