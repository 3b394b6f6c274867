"""Sharded training (`--shard`) on PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`): the quantized base and
the trainable are split across the ranks of a torchrun job instead of copied into each.

Each frozen linear's quantized bytes (`FrozenQuantLinear.raw`, uint8 `[n_out, row_bytes]`) become a frozen
`nn.Parameter` (requires_grad=False, no copy), so FSDP2 manages them like any parameter: `fully_shard` on every
transformer block splits each block's parameters along dim 0 (rows of GGML blocks for the quantized weights, rows
of A and B, entries of DoRA's magnitude) and keeps only this rank's part. Before a block runs, forward or backward,
FSDP2 all-gathers the block's parameters in one collective (a group of mixed dtypes travels as raw bytes: the
base goes over the wire still quantized) and frees them after; the gradients of A, B and m are reduce-scattered,
so every rank keeps the gradient, the weight and the AdamW moments of its own part only. The root group (the output
projection, unless it is a block's) stays gathered from its forward through its backward, as FSDP2 does for a root.

Prefetching: block i's pre-forward also issues block i+1's all-gather (and block i's pre-backward block i-1's),
as asynchronous work, so on a GPU the next block's bytes move while this block computes; a rank then holds two
blocks gathered at a time. On the CPU (Gloo) collectives and compute share the same cores and prefetching is off
by default (one block gathered at a time).

Numbers. The reduce-scatter sums (gradient divide factor 1) and each rank divides its loss by the global batch's
supervised tokens, so the summed gradient is the global batch's gradient of its mean token loss, as in one process;
the gradient norm is the all-reduced sum of the shards' squares. Every rank runs the same number of forwards
(FSDP2's collectives run in every forward): a rank with fewer micro-batches, or fewer validation batches, runs a
row with weight 0.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from juno_py.train.distributed import DistributedError, World
from juno_py.train.state import StateError, state_path
from juno_py.weights.frozen import FrozenQuantLinear


class ShardedModel:
    """A model whose blocks FSDP2 shards (`shard`). Called like the model; `no_sync()` accumulates gradients
    without reduce-scattering them (the loop's accumulation and truncated-BPTT windows)."""

    def __init__(self, model: nn.Module, world: World, prefetch: int):
        self.model, self.world, self.prefetch = model, world, prefetch
        self.peak_quantized_bytes = 0
        self.frozen_dtype = torch.uint8
        self._groups = [g for m in model.modules() for g in _fsdp_groups(m)]

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.model(*args, **kw)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    # --- numbers over the shards ----------------------------------------------------------------------------
    def grad_norm(self, params: Sequence[torch.Tensor]) -> float:
        """Global L2 norm of the sharded gradients: each rank's fp64 sum of squares of its parts, all-reduced."""
        local = torch.zeros((), dtype=torch.float64, device=self.world.device)
        for p in params:
            if p.grad is not None:
                g = local_part(p.grad)
                if g.numel():
                    local += torch.linalg.vector_norm(g, dtype=torch.float64).square()
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        return math.sqrt(float(local))

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a sharded one (a collective: every rank calls it, in the same order)."""
        return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]

    # --- memory ---------------------------------------------------------------------------------------------
    def quantized_bytes(self) -> int:
        """Bytes of quantized base this rank holds now: its parts of every frozen linear plus the linears gathered
        at this moment (read from the tensors' storages)."""
        seen: set[int] = set()
        total = 0
        for lin in frozen_linears(self.model):
            for t in held_tensors(lin):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        # a prefetched block's all-gather in flight: the quantized part of its buffer (padded shards × ranks)
        for g in self._groups:
            if g._all_gather_result is not None:
                total += sum(
                    fp._sharded_param_data.numel() * self.world.size
                    for fp in g.fsdp_params
                    if fp.sharded_param.dtype == self.frozen_dtype
                )
        return total

    def watch_quantized_bytes(self) -> None:
        """Record the peak of `quantized_bytes()` (`peak_quantized_bytes`) as every layer over a frozen linear runs
        forward, and as its output's gradient arrives in backward (where the layer's backward is next)."""

        def note(*_: Any) -> None:
            self.peak_quantized_bytes = max(self.peak_quantized_bytes, self.quantized_bytes())

        def forward_hook(_m: nn.Module, _inputs: Any, out: Any) -> None:
            note()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(note)

        layers = [m for blk in self.model.blocks for m in blk.linears.values()]  # type: ignore[union-attr]
        for m in [*layers, self.model.output]:
            m.register_forward_hook(forward_hook)  # type: ignore[arg-type]

    def base_bytes(self) -> tuple[int, int]:
        """(bytes of the whole quantized base in the frozen linears, bytes of its largest block)."""
        per_block = [
            sum(_whole_bytes(lin) for lin in frozen_linears(blk))
            for blk in self.model.blocks  # type: ignore[union-attr]
        ]
        rest = sum(_whole_bytes(lin) for lin in frozen_linears(self.model)) - sum(per_block)
        return sum(per_block) + rest, max([*per_block, rest])


class ShardedRows:
    """A frozen linear whose quantized rows are split across the ranks outside FSDP2, for the output projection:
    the chunked loss calls it outside the model's forward, where FSDP2's hooks never run. Each rank keeps rows
    `[r·k, (r+1)·k)` (k = ceil(n_out / N), the last part padded); `gathered()` all-gathers the bytes into the whole
    weight (`all_gather_into_tensor`) for the loss's chunks and frees them after."""

    def __init__(self, lin: FrozenQuantLinear, world: World):
        self.lin, self.world = lin, world
        full = lin._buffers["raw"]
        assert full is not None
        n, rows = full.shape[0], math.ceil(full.shape[0] / world.size)
        a, b = min(n, world.rank * rows), min(n, (world.rank + 1) * rows)
        part = torch.zeros(rows, full.shape[1], dtype=torch.uint8, device=world.device)
        part[: b - a] = full[a:b].to(world.device)  # only this rank's rows are read from the memory map
        self.part, self.n_rows, self.whole = part, n, None
        lin._buffers["raw"] = part[:0]  # nothing of the weight outside `gathered`
        self.depth = 0

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        if self.depth:  # already gathered (a loss inside a loss's context)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        whole = torch.empty(
            self.part.shape[0] * self.world.size, self.part.shape[1], dtype=torch.uint8, device=self.part.device
        )
        dist.all_gather_into_tensor(whole, self.part)
        self.lin._buffers["raw"] = self.whole = whole[: self.n_rows]
        self.depth = 1
        try:
            yield
        finally:
            self.depth = 0
            self.lin._buffers["raw"] = self.part[:0]
            self.whole = None
            del whole

    def held(self) -> list[torch.Tensor]:
        return [self.part] + ([self.whole] if self.whole is not None else [])


def frozen_linears(model: nn.Module) -> Iterator[FrozenQuantLinear]:
    for m in model.modules():
        if isinstance(m, FrozenQuantLinear):
            yield m


def _whole_bytes(lin: FrozenQuantLinear) -> int:
    rows = getattr(lin, "_sharded_rows", None)
    return int(rows.n_rows * rows.part.shape[1]) if rows is not None else int(lin.raw.numel())


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (FSDP2's sharded tensor). torch.distributed.tensor is read only once some module has
    imported it (a sharded run has), so unsharded CPU runs keep it, and the sympy it pulls in, out of the process."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# the oldest torch --shard is allowed on: 2.11, the oldest in use (2.13 is tested; FSDP2 options `shard` sets, such
# as set_force_sum_reduction_for_comms, were not checked in older releases)
MIN_TORCH = (2, 11)
# the oldest torch whose FSDP2 takes uint8 parameters: before it, `FSDPParam._init_sharded_param` builds the sharded
# parameter as `nn.Parameter(dtensor)` (requires_grad=True, refused for an integer dtype: "only Tensors of floating
# point dtype can require gradients") and only then copies requires_grad from the original
UINT8_PARAMS_TORCH = (2, 13)


def frozen_bytes_dtype() -> torch.dtype:
    """The dtype the frozen quantized bytes are sharded as: uint8 where FSDP2 takes it, else float8_e5m2, one byte
    too, the same bits viewed (`FrozenQuantLinear.raw` reads them back as uint8). Exact: FSDP2 only copies a frozen
    parameter's bytes (all-gather into a uint8 buffer when a group mixes dtypes), never casts it (no mixed-precision
    param_dtype is set) and never reduces it (it has no gradient)."""
    return torch.uint8 if _torch_release() >= UINT8_PARAMS_TORCH else torch.float8_e5m2


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (the tensor itself when it is not sharded)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]


def held_tensors(lin: FrozenQuantLinear) -> list[torch.Tensor]:
    """The tensors that hold `lin`'s quantized bytes on this rank: its shard and, while gathered, the whole."""
    rows = getattr(lin, "_sharded_rows", None)
    if rows is not None:
        return rows.held()  # type: ignore[no-any-return]
    raw = lin._parameters.get("raw")
    if raw is None:
        return [lin._buffers["raw"]] if lin._buffers.get("raw") is not None else []
    out = [local_part(raw)]
    state = getattr(lin, "_fsdp_param_of_raw", None)
    if state is not None:
        out.append(state._sharded_param_data)
        unsharded = getattr(state, "_unsharded_param", None)
        if unsharded is not None:
            out.append(unsharded)
    return out


def shard_state_path(adapter_path: Any, rank: int, world_size: int) -> Path:
    """Where rank `rank` of a sharded run of `world_size` ranks keeps its part of the resume state:
    `<adapter>.state.rank<r>-of-<n>`."""
    return Path(f"{state_path(adapter_path)}.rank{rank}-of-{world_size}")


def sharded_like(part: torch.Tensor, like: torch.Tensor, where: str, key: str) -> torch.Tensor:
    """This rank's `part` of a tensor sharded as `like` is, as such a sharded tensor (resume)."""
    if not is_sharded(like):
        return part
    from torch.distributed.tensor import DTensor

    own = local_part(like)
    if part.shape != own.shape or part.dtype != own.dtype:
        raise StateError(
            f"{where}: tensor {key!r} is {part.dtype} {tuple(part.shape)}, expected this rank's part "
            f"{own.dtype} {tuple(own.shape)}"
        )
    return DTensor.from_local(  # type: ignore[no-any-return]
        part.to(own.device),
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def shard(
    model: nn.Module,
    world: World,
    prefetch: Optional[int] = None,
    frozen_dtype: Optional[torch.dtype] = None,
    before_block: Optional[Callable[[nn.Module], None]] = None,
) -> ShardedModel:
    """Shard `model` (adapters already attached, nothing trained yet) across the ranks of `world` with FSDP2.

    The model must still be on the CPU (loaded memory-mapped, not placed): each rank reads only its rows of each
    quantized weight, and on a GPU only its part moves there. `prefetch`: how many blocks ahead to gather (None:
    1 on a GPU, 0 on the CPU). `frozen_dtype`: the one-byte dtype of the frozen bytes' parameters (None:
    `frozen_bytes_dtype()`). `before_block(block)`: called just before each block is sharded (full training decodes
    the block's dense weights there, so a rank holds one block's whole matrices at a time)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not world.active:
        raise DistributedError("--shard needs several processes: start them with torchrun or --nproc")
    if _torch_release() < MIN_TORCH:
        raise DistributedError(
            f"--shard needs torch {'.'.join(map(str, MIN_TORCH))} or newer, this is torch {torch.__version__}: the "
            f"FSDP2 of older releases refuses the quantized base's uint8 parameters; train data-parallel without "
            f"--shard, or upgrade torch"
        )
    device = world.device
    if model.embed.device.type != "cpu":  # type: ignore[union-attr]
        raise DistributedError("shard the model while it is on the CPU: each rank moves only its part to the device")
    linears = list(frozen_linears(model))
    for lin in linears:
        if lin.weight_cache is not None:
            raise DistributedError(
                f"{lin.name}: a resident dequantized weight cache cannot be sharded; use --weights-cache none"
            )
    frozen_dtype = frozen_bytes_dtype() if frozen_dtype is None else frozen_dtype
    if frozen_dtype.itemsize != 1:
        raise DistributedError(f"frozen bytes dtype {frozen_dtype}: expected a one-byte dtype")
    if frozen_dtype != torch.uint8 and world.backend == "gloo":
        # a block with nothing else to gather would all-gather in that dtype, which Gloo refuses
        for i, blk in enumerate(model.blocks):  # type: ignore[union-attr, arg-type]
            if not any(p.requires_grad for p in blk.parameters()):
                raise DistributedError(
                    f"block {i} trains nothing: on torch {torch.__version__} (before "
                    f"{'.'.join(map(str, UINT8_PARAMS_TORCH))}) Gloo cannot shard a block of quantized bytes alone; "
                    f"train a target in every block, or use NCCL"
                )
    in_blocks = {id(lin) for blk in model.blocks for lin in frozen_linears(blk)}  # type: ignore[union-attr]
    for lin in linears:
        if id(lin) in in_blocks:
            raw = lin._buffers.pop("raw")
            assert raw is not None
            # the same bytes (a view of the memory map, no copy), as `frozen_dtype`
            lin.raw = nn.Parameter(raw.view(frozen_dtype), requires_grad=False)
        else:  # the output projection: gathered around the loss (`ShardedRows`)
            rows = ShardedRows(lin, world)
            object.__setattr__(lin, "_sharded_rows", rows)
            model.output_hold = rows.gathered  # type: ignore[assignment]
    mesh = init_device_mesh(device.type, (world.size,))
    blocks = list(model.blocks)  # type: ignore[union-attr, arg-type]
    for blk in blocks:
        if before_block is not None:
            before_block(blk)
        fully_shard(blk, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    ahead = (1 if device.type == "cuda" else 0) if prefetch is None else int(prefetch)
    for i, blk in enumerate(blocks):
        _sum_gradients(blk)
        blk.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + ahead])  # type: ignore[operator]
        # an empty list would leave FSDP2's implicit backward prefetch on (the previous block); the block itself,
        # gathered already when its backward starts, prefetches nothing
        behind = blocks[max(0, i - ahead) : i][::-1] or [blk]
        blk.set_modules_to_backward_prefetch(behind)  # type: ignore[operator]
    _sum_gradients(model)
    _remember_fsdp_params(model, linears)
    # what FSDP2 moved to the device: the frozen linears switch to the backend of their bytes' device
    for lin in linears:
        lin._bind_backend()
        if lin._row_norms_sq is not None:  # DoRA's row norms of the whole W, computed when it was attached
            lin._row_norms_sq = lin._row_norms_sq.to(device)
    model.embed.device = device  # type: ignore[union-attr]
    for name, buf in list(model._buffers.items()):
        if buf is not None and buf.device != device:
            model._buffers[name] = buf.to(device)
    if device.type == "cuda" and model.compute_dtype == torch.bfloat16:  # type: ignore[union-attr]
        model.set_activation_dtype(torch.bfloat16)  # type: ignore[operator]
    model.sharded = True  # type: ignore[assignment]
    out = ShardedModel(model, world, ahead)
    out.frozen_dtype = frozen_dtype
    return out


def _sum_gradients(module: nn.Module) -> None:
    """The reduce-scatter sums the ranks' gradients (a plain SUM, which Gloo and NCCL both run; no division)."""
    module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def _fsdp_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter group of `module` (none when it is not an FSDP2 module or holds no parameters)."""
    state = getattr(module, "_get_fsdp_state", None)
    group = state()._fsdp_param_group if state is not None else None
    return [group] if group is not None else []


def _remember_fsdp_params(model: nn.Module, linears: list[FrozenQuantLinear]) -> None:
    """Give each frozen linear a reference to the FSDP2 record of its bytes (for `quantized_bytes`)."""
    by_param: dict[int, Any] = {}
    for m in model.modules():
        for group in _fsdp_groups(m):
            for fp in group.fsdp_params:
                by_param[id(fp.sharded_param)] = fp
    for lin in linears:
        fp = by_param.get(id(lin._parameters.get("raw")))
        if fp is not None:
            object.__setattr__(lin, "_fsdp_param_of_raw", fp)


__all__ = ["ShardedModel", "shard", "shard_state_path", "sharded_like", "is_sharded", "local_part"]
