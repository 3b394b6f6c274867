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
`ffn_*_exps` tensor (a view of the file's bytes, decoded on demand like any frozen linear). Tokens are grouped by
expert, so within a step each expert's weights are decoded once for all of its tokens (and once more in backward
for the input gradient), never per token; experts no token chose are not touched.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

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


class MoEFeedForward(nn.Module):
    """The experts of one block: `experts[target][e]` is expert e's linear for `wgate_exps`, `wup_exps` and
    `wdown_exps` (a FrozenQuantLinear, or an adapter wrapping one). The router is the block's `wrouter` linear,
    passed to `forward`; `gated` computes act(gate) · up."""

    def __init__(
        self, args: ModelArgs, gated: GatedFn, experts: dict[str, list[nn.Module]], routing: str = "softmax_topk"
    ):
        super().__init__()
        self.n_expert, self.k, self.routing = args.n_expert, args.n_expert_used, routing
        self.experts = nn.ModuleDict({t: nn.ModuleList(experts[t]) for t in EXPERT_TARGETS})
        self.gated = gated
        # tokens routed to each expert since the load was last taken (detached, on the model's device)
        self.load: Optional[Tensor] = None

    def forward(self, x: Tensor, router: Callable[[Tensor], Tensor]) -> Tensor:
        shape, d = x.shape, x.shape[-1]
        xf = x.reshape(-1, d)
        route_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        weights, chosen = route(router(xf).to(route_dtype), self.k, self.routing)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.n_expert)
        self.load = counts.detach() if self.load is None else self.load + counts.detach()
        tokens = order // self.k
        w = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        out = torch.zeros_like(xf)
        gate, up, down = (self.experts[t] for t in EXPERT_TARGETS)
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
    counts = {layer: [int(c) for c in v.tolist()] for layer, v in sorted(load.items())}
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
