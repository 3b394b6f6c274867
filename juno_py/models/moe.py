"""Mixture-of-experts feed-forward: a router picks `n_expert_used` of `n_expert` gated MLPs per token, and the
token's output is their weighted sum.

Routing is llama.cpp's `build_moe_ffn` as `qwen3moe` and `llama` (Mixtral) call it: router logits `W_r·x`,
softmax over all experts, the top `n_expert_used` probabilities, divided by their sum (clamped below at
6.103515625e-5, the smallest normal fp16) — for both architectures (llama.cpp renormalises qwen3moe's weights
whatever the checkpoint's `norm_topk_prob` said), no further scale. Each chosen expert computes
`down_e(act(gate_e(x)) · up_e(x))`. gpt-oss (llama.cpp's SOFTMAX_WEIGHT gating) takes the top `n_expert_used`
router logits (the router has a bias) and a softmax over those; its experts have biases (`ffn_*_exps.bias`, row e
for expert e) and the clamped SwiGLU `swiglu_oai`.

The experts' weights stay quantized: each expert is a `FrozenQuantLinear` over its 2-D slice of the 3-D
`ffn_*_exps` tensor (a view of the file's bytes, decoded on demand like any frozen linear). The (token, slot) pairs
are sorted by expert, and then one of two paths runs:

- grouped (`torch._grouped_mm`; by default on CUDA, compute capability 9.0 or later, bf16 activations): per
  projection ONE grouped matmul over all experts. The projection's whole 3-D weight `[n_expert, n_out, n_in]` is
  decoded in bf16 (one Triton launch over the experts' bytes, which are kept as views of one buffer per projection)
  and freed after the product; backward decodes it again for the input gradient instead of keeping it
  (`GroupedFrozenMatmul`). Per-expert LoRA factors, A `[E, r, n_in]` and B `[E, n_out, r]`, are applied as two
  grouped matmuls (their gradients through autograd of `_grouped_mm`): adapters attached for training, and a
  played-back file's entries that cover every expert, are held in that form (`adapter_stacks`,
  `juno_py.lora.ExpertStack`) and multiplied as they are; other per-expert adapters are stacked per call; a LoRA
  shared by every expert is a plain matmul over all rows; biases are gathered per row. No host sync: the group ends
  are a device tensor.
  DoRA on experts, several adapters of different ranks or weights on one projection, float64 and devices without
  grouped matmuls take the loop.
- loop (the reference): per expert an index_select, its gate/up/down linears (with their adapters) and an
  index_add_; one host sync per block for the group sizes. Each chosen expert's weights are decoded once for all
  of its tokens (and once more in backward), experts no token chose are not touched.

An expert no token chose in a step gets a zero gradient where its adapter is a row of a stack (training, either
path) and none where it is a tensor of its own (the loop); AdamW moves a zero-gradient row by its moments and
weight decay.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from juno_py.models.config import ModelArgs
from juno_py.models.layout import EXPERT_TARGETS, BlockLayout
from juno_py.weights.frozen import FrozenQuantLinear

# act(gate) · up for the expert's gate and up outputs: the block's gated activation (`model.gated` with the
# architecture's activation), passed in so this module does not import the decoder's
GatedFn = Callable[[Tensor, Tensor], Tensor]

# llama.cpp clamps the sum of the chosen probabilities at the smallest normal fp16 before dividing by it
WEIGHTS_SUM_MIN = 6.103515625e-5


# gpt-oss's expert activation: llama.cpp's ggml_swiglu_oai with the constants it hard-codes for the architecture
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate: Tensor, up: Tensor) -> Tensor:
    """gpt-oss's clamped SwiGLU: g = min(gate, 7), u = clamp(up, -7, 7), g·σ(1.702·g)·(u + 1)."""
    g = gate.clamp(max=SWIGLU_OAI_LIMIT)
    u = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return g * torch.sigmoid(g * SWIGLU_OAI_ALPHA) * (u + 1)


def route(logits: Tensor, k: int, routing: str = "softmax_topk") -> tuple[Tensor, Tensor]:
    """(weights `[N, k]`, experts `[N, k]`) from router logits `[N, n_expert]`. "softmax_topk": softmax over all
    experts, the k largest probabilities (largest first), renormalised to sum to 1. "topk_softmax" (gpt-oss): the k
    largest logits, softmax over those k. Weights are differentiable in the logits."""
    if routing == "topk_softmax":
        top, experts = logits.topk(k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits, dim=-1)
    top, experts = probs.topk(k, dim=-1)
    return top / top.sum(-1, keepdim=True).clamp_min(WEIGHTS_SUM_MIN), experts


# how the experts run (MoEFeedForward.expert_path): "auto" (grouped where `grouped_mm_ready`, else the loop),
# "grouped" (wherever torch has `_grouped_mm` for the dtype: the CPU tests of the grouped path), "loop"
EXPERT_PATHS = ("auto", "grouped", "loop")
# the row strides `_grouped_mm` reads must be multiples of 16 bytes: rows and ranks are padded to this many values
GROUPED_ALIGN = 8


def grouped_mm_ready(x: Tensor) -> bool:
    """Whether the grouped path runs by default for activations `x`: torch has `_grouped_mm`, x is bf16 on a CUDA
    device of compute capability 9.0 or later (the grouped GEMM kernels' floor)."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def grouped_matmul(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """`y[rows of group e] = x[rows of group e] · w[e]` for x `[M, K]`, w `[E, K, N]` and offs int32 `[E]`, the
    groups' cumulative ends (empty groups allowed): `torch._grouped_mm`, differentiable in x and w."""
    return torch._grouped_mm(x, w, offs=offs)


class GroupedFrozenMatmul(torch.autograd.Function):
    """`y = x · W[e]ᵀ` per group of rows, W `[E, n_out, n_in]` a frozen weight that `decode()` produces. Nothing is
    saved but the group ends: backward decodes W again for `dx = dy · W[e]` (the weight has no gradient), so the
    decoded weight lives only during each product."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, offs: Tensor, decode: Callable[[], Tensor]) -> Tensor:
        ctx.decode = decode
        ctx.save_for_backward(offs)
        w = decode()
        return grouped_matmul(x, w.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], None, None]:
        (offs,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            w = ctx.decode()
            dx = grouped_matmul(dy.contiguous(), w, offs)
        return dx, None, None


class _ZeroIdleGrad(torch.autograd.Function):
    """The identity on stacked per-expert factors `[E, ...]`; backward zeroes the gradient of the experts no row
    chose (`present` `[E]` bool). On Hopper the grouped weight gradient of an empty group is zero already; on some
    GPUs (B200, pytorch#172439) it is not, and an uninitialised value there would reach the optimizer."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, present: Tensor) -> Tensor:
        ctx.save_for_backward(present)
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        (present,) = ctx.saved_tensors
        mask = present.view(-1, *([1] * (g.dim() - 1)))
        return torch.where(mask, g, torch.zeros((), dtype=g.dtype, device=g.device)), None


class _Slot:
    """One adapter position of a projection on the grouped path: the same adapter on every expert (`shared`) or one
    per expert with the same rank, `coef` (playback weight times the adapter's scale) and dropout. `stack`: the
    adapters' `ExpertStack` where expert e's adapter is its row e (its tensors are the stacked factors)."""

    def __init__(self, adapters: list[Any], coef: float):
        self.adapters = adapters
        self.shared = all(a is adapters[0] for a in adapters)
        self.coef = coef
        self.dropout = float(adapters[0].config.dropout)
        stack = getattr(adapters[0], "stack", None)
        rows = stack is not None and stack.n_expert == len(adapters)
        rows = rows and all(getattr(a, "stack", None) is stack and a.index == e for e, a in enumerate(adapters))
        self.stack = stack if rows else None


class _GroupedProjection:
    """What the grouped path needs of one projection (`wgate_exps`, ...): a FrozenQuantLinear over all experts'
    bytes `[E · n_out]` rows (the experts' own `raw` are views of its buffer), their biases `[E, n_out]` and the
    adapter slots."""

    def __init__(self, whole: FrozenQuantLinear, n_expert: int, bias: Optional[Tensor], slots: list[_Slot]):
        self.whole, self.n_expert, self.bias, self.slots = whole, n_expert, bias, slots
        self.n_out = whole.out_features // n_expert
        self.n_in = whole.in_features

    def decode(self, dtype: torch.dtype) -> Callable[[], Tensor]:
        def weights() -> Tensor:
            w = self.whole.dequantize_rows(0, self.whole.out_features, dtype)
            return w.view(self.n_expert, self.n_out, self.n_in)

        return weights

    def __call__(self, xs: Tensor, offs: Tensor, ids: Tensor, present: Tensor) -> Tensor:
        dt = xs.dtype
        y: Tensor = GroupedFrozenMatmul.apply(xs, offs, self.decode(dt))  # type: ignore[no-untyped-call]
        for slot in self.slots:
            training = slot.adapters[0].training
            xin = F.dropout(xs, slot.dropout, training=True) if training and slot.dropout > 0 else xs
            if slot.shared:
                A, B = slot.adapters[0].factors(dt)
                delta = (xin @ A.T) @ B.T
            else:
                # [E, r, n_in] and [E, n_out, r]
                if slot.stack is not None:
                    A, B = slot.stack.lora_A.to(dt), slot.stack.lora_B.to(dt)
                else:
                    A = torch.stack([a.lora_A for a in slot.adapters]).to(dt)
                    B = torch.stack([a.lora_B for a in slot.adapters]).to(dt)
                A = _ZeroIdleGrad.apply(A, present)  # type: ignore[no-untyped-call]
                B = _ZeroIdleGrad.apply(B, present)  # type: ignore[no-untyped-call]
                pad = -A.shape[1] % GROUPED_ALIGN  # zero ranks: the [M, r] product's rows must be 16-byte aligned
                if pad:
                    A, B = F.pad(A, (0, 0, 0, pad)), F.pad(B, (0, pad))
                delta = grouped_matmul(grouped_matmul(xin, A.transpose(1, 2), offs), B.transpose(1, 2), offs)
            y = y + slot.coef * delta
        if self.bias is not None:
            y = y + self.bias.to(dt).index_select(0, ids)
        return y


def _adapter_slots(modules: list[nn.Module]) -> Optional[tuple[list[FrozenQuantLinear], list[_Slot]]]:
    """(the frozen bases, the adapter slots) where every expert's module fits the grouped path: a bare
    FrozenQuantLinear, or an adapted one with LoRAs (no DoRA) whose ranks, weights and dropout agree position by
    position across the experts. None otherwise (the loop runs)."""
    bases: list[FrozenQuantLinear] = []
    lists: list[list[tuple[float, Any]]] = []
    for m in modules:
        base = _base(m)
        if not isinstance(base, FrozenQuantLinear):
            return None
        bases.append(base)
        if base is m:
            lists.append([])
            continue
        if getattr(m, "dora", None) is not None:
            return None
        lists.append([(float(w), a) for w, a in zip(m.weights, m.adapters)])  # type: ignore[arg-type]
    if any(len(lst) != len(lists[0]) for lst in lists):
        return None
    slots = []
    for j in range(len(lists[0])):
        coefs = {w * a.scale for w, a in (lst[j] for lst in lists)}
        ranks = {(a.lora_A.shape, a.config.dropout) for _, a in (lst[j] for lst in lists)}
        if len(coefs) != 1 or len(ranks) != 1:
            return None
        slots.append(_Slot([lst[j][1] for lst in lists], coefs.pop()))
    return bases, slots


def _base(module: nn.Module) -> nn.Module:
    """The frozen linear under an adapter (an adapted layer has `base` and `adapters`), or the module itself."""
    return getattr(module, "base", module) if hasattr(module, "adapters") else module


class ExpertList(nn.ModuleList):
    """One projection's expert modules, counting the changes of which module is where (`version`): a projection's
    grouped view is checked against the count every forward, not against each of (say) 128 experts."""

    version = 0

    def __setitem__(self, idx: Any, module: nn.Module) -> None:
        super().__setitem__(idx, module)
        self.version += 1

    def __delitem__(self, idx: Any) -> None:
        super().__delitem__(idx)
        self.version += 1

    def append(self, module: nn.Module) -> ExpertList:
        super().append(module)
        self.version += 1
        return self

    def insert(self, index: int, module: nn.Module) -> None:
        super().insert(index, module)
        self.version += 1


def _modules_key(modules: ExpertList) -> tuple[Any, ...]:
    """What a projection's grouped view depends on: which expert module is where (the list itself, held so that its
    id is not reused, and its count of changes), and where the first and last expert's bytes are (a device move goes
    through `MoEFeedForward._apply`, which drops the views; this catches a move of the experts alone). Cheap: it is
    checked every forward."""
    ends = [getattr(_base(m), "raw", None) for m in (modules[0], modules[-1])] if len(modules) else []
    return (modules, modules.version, *(r.data_ptr() if isinstance(r, Tensor) else 0 for r in ends))


def _whole_bytes(bases: list[FrozenQuantLinear]) -> Tensor:
    """All experts' bytes as one uint8 `[E · n_out, row_bytes]` tensor: a view where they already lie one after the
    other in one storage, else a copy, which the experts' `raw` then become views of (so the bytes are held once)."""
    r0 = bases[0].raw
    n_out, row_bytes = r0.shape
    step = n_out * row_bytes
    storage = r0.untyped_storage().data_ptr()
    if all(
        b.raw.is_contiguous()
        and b.raw.shape == r0.shape
        and b.raw.untyped_storage().data_ptr() == storage
        and b.raw.data_ptr() == r0.data_ptr() + e * step
        for e, b in enumerate(bases)
    ):
        return r0.as_strided((len(bases) * n_out, row_bytes), (row_bytes, 1))
    whole = torch.cat([b.raw for b in bases])
    for e, b in enumerate(bases):
        b.raw = whole[e * n_out : (e + 1) * n_out]
    return whole


class MoEFeedForward(nn.Module):
    """The experts of one block: `experts[target][e]` is expert e's linear for `wgate_exps`, `wup_exps` and
    `wdown_exps` (a FrozenQuantLinear, or an adapter wrapping one). The router is the block's `wrouter` linear,
    passed to `forward`; `gated` computes act(gate) · up. `expert_path` (one of EXPERT_PATHS) picks the grouped
    matmuls or the per-expert loop."""

    def __init__(
        self, args: ModelArgs, gated: GatedFn, experts: dict[str, list[nn.Module]], routing: str = "softmax_topk"
    ):
        super().__init__()
        self.n_expert, self.k, self.routing = args.n_expert, args.n_expert_used, routing
        self.experts = nn.ModuleDict({t: ExpertList(experts[t]) for t in EXPERT_TARGETS})
        self.gated = gated
        # the trainable tensors of the experts' adapters where they are held stacked (`juno_py.lora.ExpertStack`, by
        # target): registered here, once, not in each expert's adapter, which views its row
        self.adapter_stacks = nn.ModuleDict()
        # tokens routed to each expert since the load was last taken (detached, on the model's device)
        self.load: Optional[Tensor] = None
        self.expert_path = "auto"
        # per projection: (the modules and bytes it was built for, the grouped path's view of it)
        self._grouped: dict[str, tuple[tuple[Any, ...], Optional[_GroupedProjection]]] = {}

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MoEFeedForward:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves _apply unannotated
        self._grouped.clear()
        raw = getattr(_base(self._modules_of(EXPERT_TARGETS[0])[0]), "raw", None)
        if isinstance(raw, Tensor) and raw.device.type != "cpu":
            # the move copied each expert's bytes on its own: join them now, one projection at a time, so the
            # copies are freed while the next block's reuse their memory
            for t in EXPERT_TARGETS:
                self._projection(t)
        return self

    def _modules_of(self, target: str) -> list[nn.Module]:
        return list(cast(nn.ModuleList, self.experts[target]))

    def _projection(self, target: str) -> Optional[_GroupedProjection]:
        """The grouped path's view of a projection, or None where its experts need the loop."""
        listed = cast(ExpertList, self.experts[target])
        key = _modules_key(listed)
        kept = self._grouped.get(target)
        if kept is not None and kept[0] == key:
            return kept[1]
        modules = list(listed)
        plan: Optional[_GroupedProjection] = None
        found = _adapter_slots(modules)
        if found is not None:
            bases, slots = found
            b0 = bases[0]
            if (
                b0.in_features % GROUPED_ALIGN == 0
                and b0.out_features % GROUPED_ALIGN == 0
                # the whole decode is one launch: its element offsets stay within int32
                and len(bases) * b0.out_features * b0.in_features < 2**31
                and all(
                    (b.ggml_type, b.in_features, b.out_features, b.compute_dtype, b.dequant)
                    == (b0.ggml_type, b0.in_features, b0.out_features, b0.compute_dtype, b0.dequant)
                    for b in bases
                )
            ):
                whole = FrozenQuantLinear(
                    _whole_bytes(bases),
                    b0.ggml_type,
                    b0.in_features,
                    compute_dtype=b0.compute_dtype,
                    dequant=b0.dequant,
                    name=f"{b0.name.split('[')[0]} (all experts)",
                )
                biases = [b.bias for b in bases if b.bias is not None]
                bias = torch.stack(biases) if len(biases) == len(bases) else None
                plan = _GroupedProjection(whole, len(bases), bias, slots)
            key = _modules_key(listed)  # the bytes may have moved into one buffer
        self._grouped[target] = (key, plan)
        return plan

    def runs_grouped(self, x: Tensor) -> bool:
        """Whether activations like `x` (its device and dtype) take the grouped path."""
        return self._grouped_plans(x) is not None

    def _grouped_plans(self, x: Tensor) -> Optional[list[_GroupedProjection]]:
        if self.expert_path == "loop" or x.dtype not in (torch.bfloat16, torch.float32):
            return None
        if self.expert_path == "auto" and not grouped_mm_ready(x):
            return None
        if not hasattr(torch, "_grouped_mm"):
            return None
        plans = [self._projection(t) for t in EXPERT_TARGETS]
        return None if any(p is None for p in plans) else plans  # type: ignore[return-value]

    def forward(self, x: Tensor, router: Callable[[Tensor], Tensor]) -> Tensor:
        shape, d = x.shape, x.shape[-1]
        xf = x.reshape(-1, d)
        route_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        weights, chosen = route(router(xf).to(route_dtype), self.k, self.routing)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        # tokens per expert: a scatter-add, not bincount, which reads its input's largest value on the host
        counts = torch.zeros(self.n_expert, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        # added in place into a tensor that outlives the step, so a replayed CUDA graph of the step counts too (a
        # tensor made under inference mode cannot be written outside it: a fresh one then)
        if self.load is None or self.load.is_inference() or self.load.device != counts.device:
            self.load = counts.detach().clone()
        else:
            self.load.add_(counts.detach())
        tokens = order // self.k
        w = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        out = torch.zeros_like(xf)
        plans = self._grouped_plans(x)
        if plans is not None:
            y = self._grouped_forward(xf, plans, tokens, flat[order], counts)
            out.index_add_(0, tokens, y.to(x.dtype) * w)
            return out.view(shape)
        gate, up, down = (self._modules_of(t) for t in EXPERT_TARGETS)
        start = 0
        for e, end in enumerate(counts.cumsum(0).tolist()):  # one host sync per block: the group sizes
            if end == start:
                continue
            rows = tokens[start:end]
            xe = xf.index_select(0, rows)
            h = self.gated(gate[e](xe).to(x.dtype), up[e](xe).to(x.dtype))
            out.index_add_(0, rows, down[e](h).to(x.dtype) * w[start:end])
            start = end
        return out.view(shape)

    def _grouped_forward(
        self, xf: Tensor, plans: list[_GroupedProjection], tokens: Tensor, ids: Tensor, counts: Tensor
    ) -> Tensor:
        """down(act(gate(x)) · up(x)) of every (token, slot) pair, in expert order `[N·k, d]`. The rows are padded
        with zeros to a multiple of GROUPED_ALIGN, the padding counted in the last expert's group (its outputs are
        dropped, and zero inputs add nothing to the adapters' gradients)."""
        gate, up, down = plans
        tokens_sorted = ids.shape[0]
        pad = -tokens_sorted % GROUPED_ALIGN
        xs = xf.index_select(0, tokens)
        if pad:
            xs = F.pad(xs, (0, 0, 0, pad))
            ids = F.pad(ids, (0, pad), value=self.n_expert - 1)
            counts = counts.clone()
            counts[-1] += pad
        offs = counts.cumsum(0).to(torch.int32)
        present = counts > 0
        h = self.gated(gate(xs, offs, ids, present), up(xs, offs, ids, present))
        return down(h, offs, ids, present)[:tokens_sorted]


def expert_linears(
    gguf: Any,
    slot_tensor: str,
    n_expert: int,
    weights_cache: str,
    compute_dtype: torch.dtype,
    bias_tensor: Optional[str] = None,
) -> list[nn.Module]:
    """One FrozenQuantLinear per expert over its 2-D slice `[n_out, n_in]` of a 3-D `[n_expert, n_out, n_in]`
    tensor: a view of the bytes, no copy and no decode. `bias_tensor` `[n_expert, n_out]`: row e is expert e's bias."""
    info = gguf.tensor(slot_tensor)
    biases = gguf.dequantize(bias_tensor).float().reshape(n_expert, -1) if bias_tensor else None
    out: list[nn.Module] = []
    for e in range(n_expert):
        raw = gguf.raw_rows(slot_tensor, slice(e, e + 1))
        out.append(
            FrozenQuantLinear(
                raw,
                info.ggml_type,
                info.shape[-1],
                None if biases is None else biases[e].clone(),
                cache=weights_cache,
                compute_dtype=compute_dtype,
                name=f"{slot_tensor}[{e}]",
            )
        )
    return out


def build_moe(
    gguf: Any,
    args: ModelArgs,
    gated: GatedFn,
    bl: BlockLayout,
    weights_cache: str,
    compute_dtype: torch.dtype,
    routing: str = "softmax_topk",
) -> MoEFeedForward:
    experts = {
        t: expert_linears(gguf, bl.experts[t].tensor, args.n_expert, weights_cache, compute_dtype, bl.experts[t].bias)
        for t in EXPERT_TARGETS
    }
    return MoEFeedForward(args, gated, experts, routing)


def load_summary(load: dict[int, Tensor]) -> dict[str, Any]:
    """The router's load over some steps, for the metrics: per block the tokens each expert took (`counts`), and
    over all blocks the worst imbalance (the busiest expert's share over the mean share: 1 is perfectly even),
    the mean of the blocks' imbalances and the number of (block, expert) pairs no token chose."""
    if not load:
        return {}
    layers = sorted(load)
    loads = [load[layer] for layer in layers]
    # one read from the device for all the blocks, not one per block
    same = all(v.shape == loads[0].shape and v.device == loads[0].device for v in loads)
    rows = torch.stack(loads).tolist() if same else [v.tolist() for v in loads]
    counts = {layer: [int(c) for c in row] for layer, row in zip(layers, rows)}
    imbalance = []
    for c in counts.values():
        total = sum(c)
        imbalance.append(max(c) * len(c) / total if total else 0.0)
    return {
        "imbalance_max": max(imbalance),
        "imbalance_mean": sum(imbalance) / len(imbalance),
        "idle_experts": sum(1 for c in counts.values() for n in c if n == 0),
        "counts": counts,
    }
