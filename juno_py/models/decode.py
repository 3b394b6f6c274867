"""One-token decode steps on the CPU at the cost of the weights' bytes: `NativeDecoder`.

Each step multiplies every frozen linear straight from its GGUF blocks through the native fused dequantize-dot
(`juno_py.gguf.quants.native`): no float W is written, not even a block of one, so a token reads each weight byte
once. The products of a block that share an input run as one call (q, k and v; gate and up), their rows shared by the
native thread pool (`juno_py.threads.native_threads`). Adapters apply as two small products each: LoRAs (several,
with their playback scales) add `coef · B·(A·h)` to the base product; a DoRA adapter composes as `AdaptedLinear`
composes it. Keys and values go into the model's preallocated `KVCache`; the products write into buffers allocated
once per decoder; RoPE angles come from a table computed once for the cache's positions.

What a step computes is the model's own forward for one token (the same norms, RoPE, attention and activations, by the
same modules), with the frozen products regrouped as fused dot products: the logits equal `Transformer`'s within
float32 rounding. `NativeDecoder.unsupported(model)` says why a model cannot take this path (another device or
dtype, a base the native products do not cover, adapters in training with dropout, no native library); generation
then decodes through the model's forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from juno_py import threads
from juno_py.gguf.quants import native
from juno_py.models.model import KVCache, Transformer, apply_rope, rope_cos_sin
from juno_py.weights.frozen import FrozenQuantLinear


def _base_of(module) -> tuple[Optional[FrozenQuantLinear], Optional[object]]:
    """(the frozen base, the AdaptedLinear around it or None) of a block's linear; (None, None) for anything else."""
    from juno_py.lora.adapters import AdaptedLinear

    if isinstance(module, AdaptedLinear):
        base = module.base
        return (base, module) if isinstance(base, FrozenQuantLinear) else (None, None)
    return (module, None) if isinstance(module, FrozenQuantLinear) else (None, None)


def _linear_blocker(module, what: str) -> Optional[str]:
    base, adapted = _base_of(module)
    if base is None:
        return f"{what} is a {type(module).__name__}, not a frozen quantized linear"
    if base.resident or base.raw.device.type != "cpu":
        return f"{what} keeps its bytes on {base.raw.device}"
    if base.ggml_type not in native.MATVEC_TYPES:
        return f"{what} has GGML type {base.ggml_type}, which the native products do not cover"
    if adapted is not None:
        for a in adapted.adapters:
            if a.training and a.config.dropout > 0:
                return f"{what} has an adapter in training mode with dropout"
    return None


class _Slot:
    """One frozen linear of the decoder: the native task writing its base product into `out`, then its bias and
    adapters."""

    def __init__(self, lib, module, x: Tensor):
        base, adapted = _base_of(module)
        assert base is not None
        self.base, self.adapted = base, adapted
        self.x = x
        self.out = torch.empty(base.out_features, dtype=torch.float32)
        self.task = native.task_for(base.ggml_type, base.raw, x, self.out)
        self.bias = base.bias.float() if base.bias is not None else None
        self.loras: list[tuple[Tensor, Tensor, float]] = []
        self.dora = None
        if adapted is not None:
            dora = adapted.dora
            if dora is not None:
                self.dora = dora
            else:
                for w, a in zip(adapted.weights, adapted.adapters):
                    A, B = a.factors(torch.float32)
                    self.loras.append((A, B, float(w) * a.scale))

    def finish(self) -> Tensor:
        """The linear's output for the input `x`, after its native base product ran: `out` itself (adapters and
        bias added in place), or a new tensor for a DoRA composition."""
        y = self.out
        if self.dora is not None:
            from juno_py.kernels.dora import dora_compose_xa

            ad, mod = self.dora, self.adapted
            xa, B = ad.delta_parts(self.x.unsqueeze(0))
            y = dora_compose_xa(y.unsqueeze(0), xa, B, mod.dora_scale(torch.float32), ad.scale)[0]
        else:
            for A, B, coef in self.loras:
                y.add_(torch.mv(B, torch.mv(A, self.x)), alpha=coef)
        if self.bias is not None:
            y = y.add_(self.bias) if y is self.out else y + self.bias
        return y


class _Layer:
    def __init__(self, lib, blk, args):
        n_embd = args.n_embd
        self.h_attn = torch.empty(n_embd)
        self.h_ffn = torch.empty(n_embd)
        self.attn_out = torch.empty(args.n_head * args.head_dim_v)
        lin = blk.linears
        self.q, self.k, self.v = (_Slot(lib, lin[t], self.h_attn) for t in ("wq", "wk", "wv"))
        self.o = _Slot(lib, lin["wo"], self.attn_out)
        self.gate, self.up = (_Slot(lib, lin[t], self.h_ffn) for t in ("wgate", "wup"))
        self.act_out = torch.empty(self.gate.base.out_features)
        self.down = _Slot(lib, lin["wdown"], self.act_out)
        self.plan_qkv = native.MatvecPlan(lib, [s.task for s in (self.q, self.k, self.v)])
        self.plan_o = native.MatvecPlan(lib, [self.o.task])
        self.plan_gate_up = native.MatvecPlan(lib, [self.gate.task, self.up.task])
        self.plan_down = native.MatvecPlan(lib, [self.down.task])


class NativeDecoder:
    """Decode steps for `model` over `cache` (a `KVCache` of batch 1 that `prefill` filled): `step(token)` feeds one
    token after the cached ones and returns the logits `[vocab]` for the next (a buffer the next step overwrites).
    Build with `NativeDecoder.build(model, cache)`, which returns None where the path does not apply."""

    def __init__(self, model: Transformer, cache: KVCache, lib):
        self.model, self.cache, self.args = model, cache, model.args
        a = self.args
        self.layers = [_Layer(lib, blk, a) for blk in model.blocks]
        self.h_out = torch.empty(a.n_embd)
        self.output = _Slot(lib, model.output, self.h_out)
        self.plan_output = native.MatvecPlan(lib, [self.output.task])
        positions = torch.arange(cache.max_len).unsqueeze(0)
        self.positions = positions
        self.ropes = [
            rope_cos_sin(positions, getattr(model, f"_inv_freq{i}"), a.rope_attn_factor, torch.float32)
            for i in range(len(model._rope_keys))
        ]
        self.token = torch.zeros(1, 1, dtype=torch.long)

    @staticmethod
    def unsupported(model: Transformer, cache: Optional[KVCache] = None) -> Optional[str]:
        """Why `model` (and `cache`) cannot decode through the native products, or None when they can."""
        if model.embed.device.type != "cpu":
            return f"the model is on {model.embed.device}"
        if model.act_dtype != torch.float32:
            return f"the activations run in {model.act_dtype}"
        if cache is not None and (cache.k[0].shape[0] != 1 or cache.k[0].dtype != torch.float32):
            return "the cache is not a float32 cache of batch 1"
        for blk in model.blocks:
            for t, m in blk.linears.items():
                reason = _linear_blocker(m, f"block {blk.layer} {t}")
                if reason:
                    return reason
        reason = _linear_blocker(model.output, "the output projection")
        if reason:
            return reason
        if native.library() is None:
            return "the native library is unavailable"
        return None

    @classmethod
    def build(cls, model: Transformer, cache: KVCache) -> Optional["NativeDecoder"]:
        if cls.unsupported(model, cache) is not None:
            return None
        lib = native.library()
        return cls(model, cache, lib) if lib is not None else None

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        model, cache, a = self.model, self.cache, self.args
        pos = cache.length
        if pos >= cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens; {pos} used, 1 more requested")
        cache.extend(self.positions[:, pos : pos + 1])
        self.token[0, 0] = token
        x = model.embed_tokens(self.token)[0, 0]
        n = threads.native_threads()
        for blk, L in zip(model.blocks, self.layers):
            cos, sin = self.ropes[model._rope_of_layer[blk.layer]]
            rope = (cos[:, pos : pos + 1], sin[:, pos : pos + 1])
            x = x + self._attention(blk, L, x, rope, pos, n)
            x = x + self._feed_forward(blk, L, x, n)
        self.h_out.copy_(model.norm(x))
        self.plan_output.run(n)
        logits = self.output.finish()
        cap = a.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def _attention(self, blk, L: _Layer, x: Tensor, rope, pos: int, n: int) -> Tensor:
        a, cache = self.args, self.cache
        L.h_attn.copy_(blk.norms["attn_norm"](x))
        L.plan_qkv.run(n)
        q = L.q.finish().view(1, 1, a.n_head, a.head_dim)
        k = L.k.finish().view(1, 1, a.n_head_kv, a.head_dim)
        v = L.v.finish().view(1, a.n_head_kv, a.head_dim_v)
        if blk.spec.qk_norm:
            q, k = blk.norms["attn_q_norm"](q), blk.norms["attn_k_norm"](k)
        style = blk.spec.rope_style
        q, k = apply_rope(q, *rope, style), apply_rope(k, *rope, style)
        kc, vc = cache.k[blk.layer], cache.v[blk.layer]
        kc[0, :, pos] = k[0, 0]
        vc[0, :, pos] = v[0]
        lo = max(0, pos + 1 - blk.window) if blk.window else 0
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            kc[:, :, lo : pos + 1],
            vc[:, :, lo : pos + 1],
            scale=a.attn_scale,
            enable_gqa=a.n_head != a.n_head_kv,
        )
        L.attn_out.copy_(y.reshape(-1))
        L.plan_o.run(n)
        h = L.o.finish()
        return blk.norms["post_attention_norm"](h) if blk.spec.sandwich_norms else h

    def _feed_forward(self, blk, L: _Layer, x: Tensor, n: int) -> Tensor:
        L.h_ffn.copy_(blk.norms["ffn_norm"](x))
        L.plan_gate_up.run(n)
        gate, up = L.gate.finish(), L.up.finish()
        torch.mul(blk.act(gate), up, out=L.act_out)
        L.plan_down.run(n)
        h = L.down.finish()
        return blk.norms["post_ffw_norm"](h) if blk.spec.sandwich_norms else h


__all__ = ["NativeDecoder"]
