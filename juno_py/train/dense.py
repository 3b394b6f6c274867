"""Full-parameter training targets: chosen frozen quantized linears become dense trainable weights.

`densify(model, targets)` replaces each chosen `FrozenQuantLinear` by a `DenseLinear` whose weight is the exactly
dequantized matrix as an fp32 Parameter (the master copy); its matmuls run in the frozen layer's compute dtype
(bf16 where the hardware has it). Every other weight stays quantized and frozen. The returned `DenseTargets` is the
`Trainable` the training loop trains, and gives the merge its dense deltas ΔW = W_trained − W_base, keyed
'<layer>:<target>'.

Sharded (`--shard`, `TrainConfig(shard=True)`): `densify(..., deferred=True)` decodes nothing yet; the loop's
sharding decodes each block's targets (`DenseTargets.materialize`) just before FSDP2 shards that block, so a rank
holds the whole fp32 matrices of one block at a time and keeps its rows of each. `gather()` brings the whole
trained matrices to rank 0 for the merge.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from juno_py.errors import JunoError
from juno_py.lora import parse_targets
from juno_py.train.optim import BETAS, EPS, TorchOptimizer, TrainOptimizer
from juno_py.train.trainable import StepNote, Trainable
from juno_py.weights.base import FrozenBase

if TYPE_CHECKING:
    from juno_py.metrics import MetricsRecorder
    from juno_py.train.galore import GaLoreConfig

STATE_FORMAT = "juno-py full state"  # the resume sidecar of `juno-py full`: its own schema, not an adapter's
OPTIMIZERS = ("galore", "adamw")


class DenseLinearFn(torch.autograd.Function):
    """`y = x·Wᵀ (+ b)` with W the fp32 master, computed in `dtype`; backward gives dx and dW (fp32).

    Saved for backward: x in the compute dtype and a reference to the master W (no copy: a bf16 copy of W is
    made for each matmul and dropped after it), so a step holds no second weight per layer."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        x2 = x.reshape(-1, weight.shape[1]).to(dtype)
        # fp32 out (as the frozen linears give on the CPU); bf16 activations (GPU) stay bf16, float64 stays float64
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float64) else torch.float32
        y = (x2 @ weight.to(dtype).T).to(out_dtype)
        if bias is not None:
            y += bias.to(out_dtype)
        ctx.save_for_backward(x2, weight)
        ctx.dtype, ctx.x_dtype, ctx.x_shape = dtype, x.dtype, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None, None]:
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0]).to(ctx.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ weight.to(ctx.dtype)).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = (dy2.T @ x2).to(weight.dtype)
        return dx, dw, None, None


class DenseLinear(nn.Module):
    """A trainable dense `y = x·Wᵀ + b`: W an fp32 Parameter, b a frozen buffer, matmuls in `compute_dtype`
    (float64 inputs compute in float64, for exactness checks)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        compute_dtype: torch.dtype = torch.float32,
        name: str = "",
    ):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.compute_dtype, self.name = compute_dtype, name

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if x.dtype == torch.float64 else self.compute_dtype
        y: torch.Tensor = DenseLinearFn.apply(x, self.weight, self.bias, dtype)  # type: ignore[no-untyped-call]
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.name}, in_features={self.in_features}, out_features={self.out_features}, "
            f"compute_dtype={str(self.compute_dtype).removeprefix('torch.')}"
        )


class DenseTargets(Trainable):
    """The dense trainable targets of one model, keyed '<layer>:<target>' (layer order, then target order), with
    the frozen quantized layer each replaced (kept for ΔW and nothing else)."""

    state_format = STATE_FORMAT
    writes_file = False  # `save` writes nothing: the resume state holds the weights

    def __init__(self, model: Any, linears: dict[str, DenseLinear], bases: dict[str, Any]):
        self.model, self.linears, self.bases = model, linears, bases
        self.whole: dict[str, torch.Tensor] = {}  # `gather`'s whole matrices (sharded runs, rank 0)

    def parameters(self) -> Iterator[nn.Parameter]:
        for lin in self.linears.values():
            yield lin.weight

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for key, lin in self.linears.items():
            yield key, lin.weight

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, lr: float, weight_decay: float, plus_ratio: float = 1.0) -> list[dict[str, Any]]:
        """One group named 'weights', every matrix decayed (`plus_ratio` has nothing to scale here)."""
        return [
            {
                "name": "weights",
                "params": list(self.parameters()),
                "lr": lr,
                "base_lr": lr,
                "weight_decay": weight_decay,
            }
        ]

    def train(self, mode: bool = True) -> DenseTargets:
        for lin in self.linears.values():
            lin.train(mode)
        return self

    def eval(self) -> DenseTargets:
        return self.train(False)

    def save(self, path: Union[str, Path]) -> None:
        """Nothing to write beside the resume state, which holds the trained weights (`<output>.state`); the
        GGUF is written once, by the merge, at the end."""
        return None

    def saved_bytes(self) -> int:
        return 0

    # ---- the training loop's hooks: dense weights keep nothing derived from their values ----------------------
    def start_run(self) -> None:
        return None

    def before_step(self) -> Optional[StepNote]:
        return None

    def after_optimizer_step(self) -> None:
        return None

    def graph_blocker(self) -> Optional[str]:
        return "full-parameter training (dense targets)"

    def forget_derived(self) -> None:
        return None

    def derived_tensors(self) -> list[torch.Tensor]:
        return []

    # ---- sharded training ----------------------------------------------------------------------------------
    def deferred(self) -> list[str]:
        """The keys whose weights are not decoded yet (`densify(..., deferred=True)`)."""
        return [key for key, lin in self.linears.items() if lin.weight.is_meta]

    def materialize(self, module: Optional[nn.Module] = None) -> None:
        """Decode the deferred weights of the targets inside `module` (every target when None) from their frozen
        bases, as fp32 masters on the base's device."""
        inside = None if module is None else {id(m) for m in module.modules()}
        for key, lin in self.linears.items():
            if lin.weight.is_meta and (inside is None or id(lin) in inside):
                base = self.bases[key]
                weight = base.dequantize_rows(0, base.out_features).to(torch.float32).contiguous()
                lin.weight = nn.Parameter(weight, requires_grad=True)

    def gather(self, keep: bool = True) -> None:
        """Sharded weights: all-gather each whole matrix, one at a time (a collective: every rank calls it), and
        keep it on the CPU where `keep` (rank 0, which merges); `deltas` then reads these. Unsharded: nothing."""
        from juno_py.train.sharded import is_sharded

        for key, lin in self.linears.items():
            if is_sharded(lin.weight):
                whole = lin.weight.detach().full_tensor()  # type: ignore[attr-defined]
                if keep:
                    self.whole[key] = whole.cpu()
                del whole

    def base_weight(self, key: str) -> torch.Tensor:
        """The frozen base's exact dequantized weight of `key` (fp32, on the CPU)."""
        base = self.bases[key]
        w: torch.Tensor = base.dequantize_rows(0, base.out_features)
        return w.cpu()

    def deltas(self) -> dict[str, Callable[[], torch.Tensor]]:
        """ΔW = W_trained − W_base per key, in float64 (exact for two fp32 matrices), computed when the merge asks
        for it, one tensor at a time."""

        def delta(key: str) -> Callable[[], torch.Tensor]:
            def compute() -> torch.Tensor:
                trained = self.whole.get(key)
                if trained is None:
                    trained = self.linears[key].weight.detach().cpu()
                return trained.double() - self.base_weight(key).double()

            return compute

        return {key: delta(key) for key in self.linears}


def densify(
    model: Any,
    targets: Union[str, Sequence[str]] = "all",
    layers: Optional[Iterable[int]] = None,
    deferred: bool = False,
) -> DenseTargets:
    """Make the chosen targets of every (or the given) layer dense and trainable; freeze everything else.
    `deferred`: leave the weights undecoded (meta tensors of their shape) until `DenseTargets.materialize`, which
    the sharded loop calls block by block (the unsharded loop decodes them all at its start)."""
    names = parse_targets(targets)
    layer_set = set(layers) if layers is not None else None
    linears: dict[str, DenseLinear] = {}
    bases: dict[str, Any] = {}
    for ref in model.targets(names):
        if layer_set is not None and ref.layer not in layer_set:
            continue
        base = ref.module
        key = f"{ref.layer}:{ref.target}"
        if not isinstance(base, FrozenBase):
            raise JunoError(
                f"target {key}: a {type(base).__name__}, expected a frozen quantized linear (full "
                f"training replaces the base weights; detach adapters first)"
            )
        if deferred:
            weight = torch.empty(base.out_features, base.in_features, device="meta")
            dense = DenseLinear(weight, base.bias, base.compute_dtype, name=key)
        else:
            weight = base.dequantize_rows(0, base.out_features)
            dense = DenseLinear(weight, base.bias, base.compute_dtype, name=key).to(weight.device)
        base.weight_cache = None  # the dense master replaces it; the bytes stay for ΔW
        model.blocks[ref.layer].linears[ref.target] = dense
        linears[key], bases[key] = dense, base
    if not linears:
        raise JunoError(f"no targets to train (targets {','.join(names)}, layers {sorted(layer_set or [])})")
    for p in model.parameters():
        p.requires_grad_(False)
    out = DenseTargets(model, linears, bases)
    for p in out.parameters():
        p.requires_grad_(True)
    return out


def build_dense_optimizer(
    kind: str,
    targets: DenseTargets,
    lr: float,
    weight_decay: float = 0.0,
    galore: Optional[GaLoreConfig] = None,
    seed: int = 0,
    recorder: Optional[MetricsRecorder] = None,
) -> TrainOptimizer:
    """'galore': GaLoreAdamW with `galore` (a GaLoreConfig); 'adamw': torch.optim.AdamW (β 0.9/0.999, ε 1e-8),
    both with decoupled weight decay on every matrix and one group named 'weights' for the schedule."""
    if kind == "galore":
        from juno_py.train.galore import GaLoreAdamW, GaLoreConfig

        optimizer: TrainOptimizer = GaLoreAdamW(
            list(targets.named_parameters()), lr, weight_decay, galore or GaLoreConfig(), seed=seed, recorder=recorder
        )
        return optimizer
    if kind == "adamw":
        return TorchOptimizer(
            torch.optim.AdamW(
                targets.param_groups(lr, weight_decay), lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay
            )
        )
    raise JunoError(f"--optimizer {kind!r}: expected one of {', '.join(OPTIMIZERS)}")
