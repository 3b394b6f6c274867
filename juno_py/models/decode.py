"""One-token decode steps on the CPU at the cost of the weights' bytes: `NativeDecoder`.

Each step multiplies every frozen linear straight from its GGUF blocks through the native fused dequantize-dot
(`juno_py.gguf.quants.native`): no float W is written, not even a block of one, so a token reads each weight byte
once. The products of a block that share an input run as one call (q, k and v; gate and up), their rows shared by the
native thread pool (`juno_py.threads.native_threads`). Adapters apply as two small products each: LoRAs (several,
with their playback scales) add `coef · B·(A·h)` to the base product; a DoRA adapter composes as `AdaptedLinear`
composes it. Keys and values go into the model's preallocated `KVCache`; the products write into buffers allocated
once per decoder; RoPE angles come from a table computed once for the cache's positions. The steps between the
products (RMSNorm with the residual add, RoPE, attention over the cache, the gated activation) are single native
calls too, so a token costs a few dozen calls per block rather than a few hundred torch operations.

What a step computes is the model's own forward for one token (the same norm weights, RoPE angles, attention and
activation formulas), with the frozen products regrouped as fused dot products: the logits equal `Transformer`'s
within float32 rounding. `NativeDecoder.unsupported(model)` says why a model cannot take this path (another device or
dtype, a base the native products do not cover, adapters in training with dropout, no native library); generation
then decodes through the model's forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from juno_py import threads
from juno_py.gguf.quants import native
from juno_py.models.model import KVCache, Transformer, rope_cos_sin
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
    adapters, in place."""

    def __init__(self, module, x: Tensor):
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
        self.plain = self.dora is None and not self.loras and self.bias is None

    def finish(self) -> None:
        """The linear's output for the input `x` into `out`, after its native base product ran there."""
        if self.plain:
            return
        y = self.out
        if self.dora is not None:
            from juno_py.kernels.dora import dora_compose_xa

            ad, mod = self.dora, self.adapted
            xa, B = ad.delta_parts(self.x.unsqueeze(0))
            y.copy_(dora_compose_xa(y.unsqueeze(0), xa, B, mod.dora_scale(torch.float32), ad.scale)[0])
        else:
            for A, B, coef in self.loras:
                y.add_(torch.mv(B, torch.mv(A, self.x)), alpha=coef)
        if self.bias is not None:
            y.add_(self.bias)


def _norm(module) -> tuple[int, float]:
    """(pointer to the weights, eps) of an RMSNorm module (fp32: the decoder runs only fp32 activations)."""
    w = module.weight
    assert w.dtype == torch.float32 and w.is_contiguous()
    return w.data_ptr(), float(module.eps)


class _Layer:
    def __init__(self, blk, args, cache: KVCache):
        n_embd = args.n_embd
        self.blk = blk
        self.h_attn = torch.empty(n_embd)
        self.h_ffn = torch.empty(n_embd)
        self.attn_out = torch.empty(args.n_head * args.head_dim_v)
        lin = blk.linears
        self.q, self.k, self.v = (_Slot(lin[t], self.h_attn) for t in ("wq", "wk", "wv"))
        self.o = _Slot(lin["wo"], self.attn_out)
        self.gate, self.up = (_Slot(lin[t], self.h_ffn) for t in ("wgate", "wup"))
        self.act_out = torch.empty(self.gate.base.out_features)
        self.down = _Slot(lin["wdown"], self.act_out)
        self.slots = (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)
        lib = native.library()
        self.plan_qkv = native.MatvecPlan(lib, [s.task for s in (self.q, self.k, self.v)])
        self.plan_o = native.MatvecPlan(lib, [self.o.task])
        self.plan_gate_up = native.MatvecPlan(lib, [self.gate.task, self.up.task])
        self.plan_down = native.MatvecPlan(lib, [self.down.task])
        norms = blk.norms
        self.attn_norm, self.ffn_norm = _norm(norms["attn_norm"]), _norm(norms["ffn_norm"])
        self.qk_norms = (_norm(norms["attn_q_norm"]), _norm(norms["attn_k_norm"])) if blk.spec.qk_norm else None
        self.post_norms = (
            (_norm(norms["post_attention_norm"]), _norm(norms["post_ffw_norm"])) if blk.spec.sandwich_norms else None
        )
        self.k_cache, self.v_cache = cache.k[blk.layer], cache.v[blk.layer]
        assert self.k_cache.is_contiguous() and self.v_cache.is_contiguous()
        self.act = ACTIVATION_CODES[blk.spec.activation]
        self.neox = int(blk.spec.rope_style == "neox")


# the gated activations the native step computes, by ArchSpec.activation
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


class NativeDecoder:
    """Decode steps for `model` over `cache` (a `KVCache` of batch 1 that `prefill` filled): `step(token)` feeds one
    token after the cached ones and returns the logits `[vocab]` for the next (a buffer the next step overwrites).
    Build with `NativeDecoder.build(model, cache)`, which returns None where the path does not apply."""

    def __init__(self, model: Transformer, cache: KVCache, lib):
        self.model, self.cache, self.args, self.lib = model, cache, model.args, lib
        a = self.args
        self.layers = [_Layer(blk, a, cache) for blk in model.blocks]
        self.x = torch.empty(a.n_embd)  # the residual stream
        self.h_out = torch.empty(a.n_embd)
        self.output = _Slot(model.output, self.h_out)
        self.plan_output = native.MatvecPlan(lib, [self.output.task])
        self.out_norm = _norm(model.norm)
        self.scores = torch.empty(cache.max_len)
        self.positions = torch.arange(cache.max_len).unsqueeze(0)
        # cos and sin [max_len, rope_dim / 2] per RoPE table, fp32 as the forward computes them
        self.ropes = []
        for i in range(len(model._rope_keys)):
            cos, sin = rope_cos_sin(self.positions, getattr(model, f"_inv_freq{i}"), model._rope_attn[i])
            self.ropes.append((cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()))
        self.n_rot = 2 * self.ropes[0][0].shape[-1]
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
            if getattr(blk, "sinks", None) is not None:
                return f"block {blk.layer} has attention sinks: it decodes through the model's own forward"
            if getattr(blk, "moe", None) is not None:
                return f"block {blk.layer} is a mixture of experts: it decodes through the model's own forward"
            if blk.spec.activation not in ACTIVATION_CODES:
                return f"block {blk.layer} has the activation {blk.spec.activation!r}"
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
        model, cache, a, lib = self.model, self.cache, self.args, self.lib
        pos = cache.length
        if pos >= cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens; {pos} used, 1 more requested")
        cache.extend(self.positions[:, pos : pos + 1])
        self.token[0, 0] = token
        self.x.copy_(model.embed_tokens(self.token)[0, 0])
        n = threads.native_threads()
        x, n_embd = self.x.data_ptr(), a.n_embd
        pending = None  # the previous block's output, added to the residual stream by the next norm
        for L in self.layers:
            blk = L.blk
            cos, sin = self.ropes[model._rope_of_layer[blk.layer]]
            w, eps = L.attn_norm
            lib.juno_residual_rmsnorm(x, pending, w, n_embd, 1, eps, L.h_attn.data_ptr())
            L.plan_qkv.run(n)
            for slot in (L.q, L.k, L.v):
                slot.finish()
            q, k = L.q.out.data_ptr(), L.k.out.data_ptr()
            if L.qk_norms is not None:
                (wq, eq), (wk, ek) = L.qk_norms
                lib.juno_residual_rmsnorm(q, None, wq, a.head_dim, a.n_head, eq, q)
                lib.juno_residual_rmsnorm(k, None, wk, a.head_dim, a.n_head_kv, ek, k)
            c, s = cos[pos].data_ptr(), sin[pos].data_ptr()
            lib.juno_rope(q, a.n_head, a.head_dim, self.n_rot, c, s, L.neox)
            lib.juno_rope(k, a.n_head_kv, a.head_dim, self.n_rot, c, s, L.neox)
            L.k_cache[0, :, pos].copy_(L.k.out.view(a.n_head_kv, a.head_dim))
            L.v_cache[0, :, pos].copy_(L.v.out.view(a.n_head_kv, a.head_dim_v))
            lo = max(0, pos + 1 - blk.window) if blk.window else 0
            lib.juno_attend(
                q,
                L.k_cache.data_ptr(),
                L.v_cache.data_ptr(),
                a.n_head,
                a.n_head_kv,
                a.head_dim,
                a.head_dim_v,
                cache.max_len * a.head_dim,
                cache.max_len * a.head_dim_v,
                lo,
                pos + 1,
                a.attn_scale,
                self.scores.data_ptr(),
                L.attn_out.data_ptr(),
            )
            L.plan_o.run(n)
            L.o.finish()
            o = L.o.out.data_ptr()
            if L.post_norms is not None:
                lib.juno_residual_rmsnorm(o, None, L.post_norms[0][0], n_embd, 1, L.post_norms[0][1], o)
            w, eps = L.ffn_norm
            lib.juno_residual_rmsnorm(x, o, w, n_embd, 1, eps, L.h_ffn.data_ptr())
            L.plan_gate_up.run(n)
            L.gate.finish()
            L.up.finish()
            lib.juno_gated(L.gate.out.data_ptr(), L.up.out.data_ptr(), L.act_out.numel(), L.act, L.act_out.data_ptr())
            L.plan_down.run(n)
            L.down.finish()
            pending = L.down.out.data_ptr()
            if L.post_norms is not None:
                lib.juno_residual_rmsnorm(pending, None, L.post_norms[1][0], n_embd, 1, L.post_norms[1][1], pending)
        w, eps = self.out_norm
        lib.juno_residual_rmsnorm(x, pending, w, n_embd, 1, eps, self.h_out.data_ptr())
        self.plan_output.run(n)
        self.output.finish()
        logits = self.output.out
        cap = a.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits


__all__ = ["NativeDecoder"]
