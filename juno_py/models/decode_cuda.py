"""One-token decode steps replayed as a CUDA graph: `CudaGraphDecoder`.

A step runs the model's own modules (its norms, its frozen linears with the adapters played on them, its gated
activation, its output projection) for one token over the model's preallocated `KVCache`, with every shape fixed:
the position is a device tensor, RoPE's cos and sin come from a table of the cache's positions indexed by it, the
new key and value go into the cache at it (`index_copy_`), and attention runs over the whole cache with a mask of
the keys at or before it (and inside the block's sliding window) computed from it. Nothing in a step reads the
host, so on CUDA the step is captured once as a graph over static buffers (the token in, the logits out) and
replayed per token: one launch for the whole model. The frozen products of one token go through the resident
weights' GEMV (`weights.resident`, `kernels.matvec_triton`), which reads each weight byte once and writes the
activations' dtype; a LoRA adds its x·Aᵀ product, whose term the GEMV adds to its sums (`matmul_lora`), DoRA
composes as `AdaptedLinear` composes it at inference. On CUDA each residual addition runs with the norm after it,
and RoPE with the cache writes, as one launch each (`kernels.decode_triton`, the unfused kernels' bits), and the
cache is attended by `decode_triton.attend`, which reads the position and the window itself and stops at the
position (fp32 online softmax; no mask).

Where the embedding table's bytes are a tensor on the model's device (a model built there) the step looks the
token up itself from the static token tensor, inside the graph; a table in the file's memory map is looked up on
the host before the replay. The step also computes [greedy token, every logit finite] (`pick`), which `generate`
reads at temperature 0 instead of the logits; other sampling runs after the replay on the static logits
(`models.generate.sample`), so temperature, top-k and top-p draw from the caller's generator exactly as the forward
path does. Where a graph cannot be captured (CPU, or a capture that fails) the same step runs eagerly: on the CPU
its logits equal the model's forward within float32 rounding, which the tests check. A decoder (and its graph)
belongs to one cache: the graph holds the cache's and the adapters' kept casts' addresses, so each `generate` call
captures its own.
`CudaGraphDecoder.unsupported(model, cache)` says why a model cannot take this path (mixture-of-experts blocks,
adapters in training with dropout, a cache other than batch 1 in the activations' dtype).
"""

from __future__ import annotations

import importlib
import warnings
from functools import partial
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from juno_py.gguf import quants
from juno_py.kernels import dequant as device_dequant
from juno_py.lora.adapters import SharedInputPlay
from juno_py.models.model import (
    FUSED_ACTIVATIONS,
    KVCache,
    QuantEmbedding,
    RMSNorm,
    Transformer,
    rope_cos_sin,
    rope_qk,
)

# the linears of a block that read one input: their adapters' x·Aᵀ run as one product (`SharedInputPlay`)
SHARED_INPUTS = {"qkv": ("wq", "wk", "wv"), "gate_up": ("wgate", "wup")}

# decode steps run eagerly before the capture: Triton compiles (and autotunes) its kernels there, not in the graph
WARMUP_STEPS = 2


def _dropout_blocker(module: Any, what: str) -> Optional[str]:
    from juno_py.lora.adapters import AdaptedLinear

    if isinstance(module, AdaptedLinear):
        adapters: list[Any] = list(module.adapters)
        for a in adapters:
            if a.training and a.config.dropout > 0:
                return f"{what} has an adapter in training mode with dropout"
    return None


def _embedding_table(model: Transformer) -> Optional[tuple[Tensor, int, int, Optional[float]]]:
    """(bytes, GGML type, width, scale) of the model's embedding table where its bytes are a tensor on the model's
    device (a model built there): the step then looks the token up itself, inside the graph. None elsewhere (a
    table in the file's memory map): the lookup runs on the host before each replay."""
    emb = model.embed
    if not isinstance(emb, QuantEmbedding):
        return None
    info = emb.gguf.tensors[emb.tensor]
    raw = info.raw
    if not isinstance(raw, Tensor) or raw.device != emb.device or raw.dim() != 2:
        return None
    return raw, int(info.ggml_type), int(emb.dim), emb.scale


class CudaGraphDecoder:
    """Decode steps for `model` over `cache` (a `KVCache` of batch 1 that `prefill` filled): `step(token)` feeds one
    token after the cached ones and returns the logits `[vocab]` for the next (a buffer the next step overwrites).
    `graph`: capture the step as a CUDA graph on first use where the cache is on CUDA (False: always eager). `fused`:
    False runs the step without `kernels.decode_triton`'s fused kernels (None: where they apply). Build with
    `CudaGraphDecoder.build(model, cache)`, which returns None where the path does not apply."""

    def __init__(self, model: Transformer, cache: KVCache, graph: Optional[bool] = None, fused: Optional[bool] = None):
        self.model, self.cache, self.args = model, cache, model.args
        a = self.args
        device, dtype = cache.k[0].device, cache.k[0].dtype
        self.device, self.dtype = device, dtype
        self.use_graph = device.type == "cuda" and graph is not False
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.graph_error: Optional[str] = None
        self.warm = 0
        # static inputs: the token (or its embedding, where the table's bytes are not on the model's device) and
        # its position; static outputs: the logits, and [greedy token, 1 if every logit is finite] (`pick`)
        self.token = torch.zeros(1, device=device, dtype=torch.long)
        self.x_in = torch.zeros(1, 1, a.n_embd, device=device, dtype=model.act_dtype)
        self.pos = torch.zeros(1, device=device, dtype=torch.long)
        self.logits: Optional[Tensor] = None
        self.picked: Optional[Tensor] = None
        self.graph_picked: Optional[Tensor] = None
        self.table = _embedding_table(model)
        self.key_index = torch.arange(cache.max_len, device=device)
        self.mask_zero = torch.zeros((), device=device, dtype=model.act_dtype)  # the additive masks' kept keys
        self.positions = torch.arange(cache.max_len, device=device).unsqueeze(0)
        # cos and sin [1, max_len, 1, rope_dim / 2] per RoPE table, in the activations' dtype as the forward has them
        self.ropes = [
            rope_cos_sin(self.positions, getattr(model, f"_inv_freq{i}"), a.rope_attn_factor, model.act_dtype)
            for i in range(len(model._rope_keys))
        ]
        # the fused step kernels (`kernels.decode_triton`) where they take this model: CUDA (or the interpreter under
        # JUNO_PY_KERNELS=fused), float32 or bfloat16 activations
        self.fused = _step_kernels(model, cache) if fused is not False else None
        self.fused_norms = self.fused is not None and _norms_fuse(model)
        self.fused_rope = self.fused is not None and _rope_fuses(model)
        # attention over the cache rows up to the position (fp32 online softmax) instead of SDPA's over the whole
        # masked cache: H100, graphed, Llama-3-8B's heads, cache full, 8.2 µs against 11.0 at 160 keys, 22.9 against
        # 82.1 at 4096, 73.4 against 317.6 at 16384 (and faster still while the cache fills)
        self.fused_attn = self.fused is not None
        # per block, the linears that read one input played with one x·Aᵀ (`SharedInputPlay`), where they fit
        self.shared: dict[tuple[int, str], SharedInputPlay] = {}
        self.plain: dict[tuple[int, str], list[Any]] = {}
        for blk in model.blocks:
            for group, names in SHARED_INPUTS.items():
                mods = [blk.linears[n] for n in names if n in blk.linears]
                play = SharedInputPlay.build(mods, model.act_dtype) if len(mods) == len(names) else None
                if play is not None:
                    if fused is False:  # each linear its own GEMV, as the model's modules run them
                        play.groups = []
                    self.shared[(blk.layer, group)] = play
                elif fused is not False and len(mods) == len(names) and all(_groupable(m) for m in mods):
                    # linears without adapters that read one input: one grouped GEMV where their types agree
                    self.plain[(blk.layer, group)] = mods

    @staticmethod
    def unsupported(model: Transformer, cache: Optional[KVCache] = None) -> Optional[str]:
        """Why `model` (and `cache`) cannot decode through static-cache steps, or None when they can."""
        if cache is not None:
            k = cache.k[0]
            if k.shape[0] != 1 or k.dtype != model.act_dtype or k.device != model.embed.device:
                return "the cache is not a cache of batch 1 in the activations' dtype on the model's device"
        blocks: list[Any] = list(model.blocks)
        for blk in blocks:
            if getattr(blk, "moe", None) is not None:
                return f"block {blk.layer} is a mixture of experts: it decodes through the model's own forward"
            for t, m in blk.linears.items():
                reason = _dropout_blocker(m, f"block {blk.layer} {t}")
                if reason:
                    return reason
        return _dropout_blocker(model.output, "the output projection")

    @classmethod
    def build(
        cls, model: Transformer, cache: KVCache, graph: Optional[bool] = None, fused: Optional[bool] = None
    ) -> Optional["CudaGraphDecoder"]:
        if cls.unsupported(model, cache) is not None:
            return None
        return cls(model, cache, graph, fused)

    # --- the step, on static tensors -------------------------------------------------------------------------
    def _attention(
        self, blk: Any, x: Tensor, rope: tuple[Tensor, Tensor], valid: Tensor, xa: Optional[Tensor] = None
    ) -> Tensor:
        """The block's attention of its normed input x; `xa`: x·Aᵀ of its q, k, v LoRAs (`SharedInputPlay`) where the
        step computed it with the norm."""
        a = self.args
        lin = blk.linears
        shared = self.shared.get((blk.layer, "qkv"))
        if shared is not None:
            q, k, v = shared(x, xa)
        else:
            q, k, v = self._plain(blk, "qkv", x) or (lin["wq"](x), lin["wk"](x), lin["wv"](x))
        kc, vc = self.cache.k[blk.layer], self.cache.v[blk.layer]
        if self.fused_rope:
            # RoPE at the step's position and the cache writes in one launch (`rope`: the whole tables)
            dt = blk.act_dtype
            q = self.fused.rope_cache(q.to(dt), k.to(dt), v.to(dt), *rope, self.pos, kc, vc, blk.spec.rope_style)
        else:
            q = q.to(blk.act_dtype).view(1, 1, a.n_head, a.head_dim)
            k = k.to(blk.act_dtype).view(1, 1, a.n_head_kv, a.head_dim)
            v = v.to(blk.act_dtype).view(1, 1, a.n_head_kv, a.head_dim_v)
            if blk.spec.qk_norm:
                q, k = blk.norms["attn_q_norm"](q), blk.norms["attn_k_norm"](k)
            q, k = rope_qk(q, k, rope, blk.spec.rope_style)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            kc.index_copy_(2, self.pos, k.to(kc.dtype))
            vc.index_copy_(2, self.pos, v.to(vc.dtype))
        # grouped queries: the one query of each of a key/value head's query heads as that head's rows of queries
        # (query head h reads key/value head h // group, as SDPA's enable_gqa has it), so that SDPA runs its
        # masked kernels without grouped-query support (with it and a mask, CUDA falls back to the math path,
        # about ten launches a block, and copies the cache's heads)
        if self.fused_attn:
            y = self.fused.attend(q, kc, vc, self.pos, a.attn_scale, blk.window)
        else:
            group = a.n_head // a.n_head_kv
            y = F.scaled_dot_product_attention(
                q.reshape(1, a.n_head_kv, group, a.head_dim), kc, vc, attn_mask=valid, scale=a.attn_scale
            )
        out: Tensor = lin["wo"](y.reshape(1, 1, a.n_head * a.head_dim_v))
        return out.to(blk.act_dtype)

    def _feed_forward(self, blk: Any, x: Tensor, xa: Optional[Tensor] = None) -> Tensor:
        """The block's feed-forward (`Block.feed_forward`), its gate and up played with one x·Aᵀ where they fit (`xa`:
        that product where the step computed it with the norm)."""
        shared = self.shared.get((blk.layer, "gate_up"))
        act = FUSED_ACTIVATIONS.get(blk.act)
        if shared is None:
            plain = self.plain.get((blk.layer, "gate_up"))
            h = None
            if plain is not None and self.fused is not None and act is not None:
                h = type(plain[0]).matmul_group(plain, x, [None, None], act=act)
            if h is not None:
                return cast(Tensor, blk.linears["wdown"](h.to(blk.act_dtype)).to(blk.act_dtype))
            out: Tensor = blk.feed_forward(x)
            return out
        # gate, up and the activation in one launch where they group (the activation as the fused kernel has it)
        h = shared.gated(x, act, xa) if self.fused is not None and act is not None else None
        if h is not None:
            out = blk.linears["wdown"](h.to(blk.act_dtype)).to(blk.act_dtype)
            return out
        gate, up = shared(x, xa)
        y: Tensor = blk.gated_down(gate, up)
        return y

    def _forward(self) -> Tensor:
        """Logits `[vocab]` of the token whose embedding is in `x_in` at the position in `pos`; reads no host value."""
        model = self.model
        blocks: list[Any] = list(model.blocks)
        # the rows of the RoPE tables at the position; the fused kernel reads them from the whole tables itself
        ropes = (
            self.ropes
            if self.fused_rope
            else [(cos.index_select(1, self.pos), sin.index_select(1, self.pos)) for cos, sin in self.ropes]
        )
        # keys at or before the position, per sliding window (0: none): [1, 1, 1, max_len] masks, additive (0 or
        # -inf) in the activations' dtype, as SDPA turns a boolean mask into, made here once a step rather than by
        # SDPA in every block (two launches a block); the fused attention takes the position and window itself
        masks: dict[int, Tensor] = {}
        windows = set() if self.fused_attn else {blk.window for blk in blocks}
        for w in windows:
            valid = self.key_index <= self.pos
            if w:
                valid = valid & (self.key_index > self.pos - w)
            masks[w] = torch.where(valid, self.mask_zero, float("-inf")).view(1, 1, 1, -1)
        x = self.x_in if self.table is None else self._embed()
        rope_of = model._rope_of_layer
        if self.fused_norms:
            # each residual addition and the norm after it in one launch (`decode_triton.add_rms`): `Block.around`'s
            # operations, the next block's input norm (the final norm after the last) taken with the addition
            # and with it the x·Aᵀ of the LoRAs that read the normed row (`SharedInputPlay`)
            h, xa = blocks[0].norms["attn_norm"](x), None
            for i, blk in enumerate(blocks):
                rope, valid = ropes[rope_of[blk.layer]], masks.get(blk.window)
                sandwich = blk.spec.sandwich_norms
                attn = self._attention(blk, h, rope, valid, xa)
                post = blk.norms["post_attention_norm"] if sandwich else None
                x, h, xa = self._add_norm(x, attn, blk.norms["ffn_norm"], post, (blk.layer, "gate_up"))
                ffn = self._feed_forward(blk, h, xa)
                last = i + 1 == len(blocks)
                after = model.norm if last else blocks[i + 1].norms["attn_norm"]
                post = blk.norms["post_ffw_norm"] if sandwich else None
                x, h, xa = self._add_norm(x, ffn, after, post, None if last else (blocks[i + 1].layer, "qkv"))
            logits = model.project(h[0, -1])
        else:
            for blk in blocks:
                rope, valid = ropes[rope_of[blk.layer]], masks.get(blk.window)
                x = blk.around(
                    x, partial(self._attention, blk, rope=rope, valid=valid), partial(self._feed_forward, blk)
                )
            logits = model.project(model.norm(x)[0, -1])
        self.picked = torch.stack([torch.argmax(logits), torch.isfinite(logits).all().to(torch.long)])
        return logits

    def _plain(self, blk: Any, group: str, x: Tensor) -> Optional[list[Tensor]]:
        """The products of a group of linears without adapters (`plain`) from one grouped GEMV, biases added; None
        where they do not group."""
        mods = self.plain.get((blk.layer, group))
        y = type(mods[0]).matmul_group(mods, x, [None] * len(mods)) if mods is not None else None
        if y is None:
            return None
        outs, at = [], 0
        for m in mods:
            part, at = y[..., at : at + m.out_features], at + m.out_features
            bias = getattr(m, "bias", None)
            outs.append(part + bias.to(part.dtype) if bias is not None else part)
        return outs

    def _add_norm(
        self, x: Tensor, h: Tensor, norm: Any, post: Any, play: Optional[tuple[int, str]]
    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """(s = x + post(h), norm(s), xa) in one launch; `post`: the block's sandwich norm of h, or None; xa: the x·Aᵀ
        of norm(s) for the `SharedInputPlay` of `play` (block, group) where there is one, else None."""
        assert self.fused is not None
        shared = self.shared.get(play) if play is not None else None
        return cast(
            tuple[Tensor, Tensor, Optional[Tensor]],
            self.fused.add_rms(
                x,
                h.to(self.model.act_dtype),
                norm.weight,
                norm.eps,
                post=(post.weight, post.eps) if post is not None else None,
                lora_a=shared.A if shared is not None else None,
            ),
        )

    def _embed(self) -> Tensor:
        """The embedding `[1, 1, n_embd]` of the token in `token`, from the table's bytes on the device: the rows
        `QuantEmbedding` gives (the row decoded to fp32, the embedding scale, the activations' dtype)."""
        assert self.table is not None
        raw, ggml_type, dim, scale = self.table
        picked = raw.index_select(0, self.token)
        if raw.is_cuda and device_dequant.has_kernel(ggml_type) and device_dequant.triton_ready(raw.device):
            rows = device_dequant.dequantize_tile(picked, ggml_type, dim, dtype=torch.float32)
        else:
            rows = quants.dequantize(ggml_type, picked, dim)
        if scale is not None:
            rows = rows * torch.tensor(scale, dtype=torch.float32)
        return rows.view(1, 1, dim).to(self.model.act_dtype)

    def _capture(self) -> None:
        # the step that triggers the capture returns its eager logits and pick; the captured step's outputs are
        # the replays' (capturing runs nothing: until the first replay they hold no values)
        eager_picked = self.picked
        try:
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    logits = self._forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graph, self.logits, self.graph_picked = graph, logits, self.picked
        finally:
            self.picked = eager_picked

    def pick(self) -> tuple[int, bool]:
        """(the greedy token, whether every logit is finite) of the last step's logits, computed inside the step:
        one read of two integers instead of an argmax and a finiteness check on the host's side of the logits.
        The token is `int(torch.argmax(logits))`, the first of equal maxima, as `generate.sample` gives it."""
        assert self.picked is not None, "pick() follows a step"
        token, finite = self.picked.tolist()
        return int(token), bool(finite)

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        cache = self.cache
        pos = cache.length
        if pos >= cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens; {pos} used, 1 more requested")
        if self.table is not None:
            n_vocab = self.table[0].shape[0]
            if not 0 <= token < n_vocab:
                raise IndexError(f"token id {token} is outside the vocabulary of {n_vocab} ({self.model.embed.tensor})")
            self.token.fill_(token)
        else:
            self.x_in.copy_(self.model.embed_tokens(torch.tensor([[token]], dtype=torch.long)))
        cache.extend(self.positions[:, pos : pos + 1], by_index=True)
        self.pos.fill_(pos)
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None
            self.picked = self.graph_picked
            return self.logits
        logits = self._forward()
        self.warm += 1
        if self.use_graph and self.graph_error is None and self.warm >= WARMUP_STEPS:
            # the step just run wrote this position's keys and values; capturing does not run it, and a replay
            # would write the same values again
            try:
                self._capture()
            except Exception as e:  # a model part that cannot be captured: keep stepping eagerly
                self.graph, self.logits = None, None
                self.graph_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                warnings.warn(
                    f"the decode step could not be captured as a CUDA graph ({self.graph_error}); it runs eagerly",
                    stacklevel=2,
                )
        return logits


def _groupable(m: Any) -> bool:
    """A linear without adapters whose products a grouped GEMV may take (`matmul_group`, which still checks)."""
    return hasattr(m, "matmul_group") and getattr(m, "resident", False)


def _step_kernels(model: Transformer, cache: KVCache) -> Any:
    """The `decode_triton` module where the fused step kernels take the model's activations on the cache's device
    (the rules of `kernels.elementwise.fused_elementwise`), else None."""
    from juno_py.kernels import elementwise

    probe = cache.k[0].new_empty(0)
    if elementwise.fused_elementwise(probe) is None or probe.dtype != model.act_dtype:
        return None
    return importlib.import_module("juno_py.kernels.decode_triton")


def _fusable_norm(norm: Any, model: Transformer) -> bool:
    """An RMSNorm of fp32 weights over the model's width that gives the activations' dtype (as `add_rms` does)."""
    if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32 or norm.weight.shape != (model.args.n_embd,):
        return False
    return (norm.out_dtype or norm.weight.dtype) == model.act_dtype


def _norms_fuse(model: Transformer) -> bool:
    """Whether every residual addition of the model and the norm after it can run as one `add_rms`."""
    norms = [model.norm]
    for blk in model.blocks:
        names = ["attn_norm", "ffn_norm"] + (
            ["post_attention_norm", "post_ffw_norm"] if blk.spec.sandwich_norms else []
        )
        if any(n not in blk.norms for n in names):
            return False
        norms += [blk.norms[n] for n in names]
    return all(_fusable_norm(n, model) for n in norms)


def _rope_fuses(model: Transformer) -> bool:
    """Whether every block's RoPE and cache writes can run as one `rope_cache` (no per-head q/k norms between)."""
    return all(not blk.spec.qk_norm and blk.spec.rope_style in ("norm", "neox") for blk in model.blocks)


__all__ = ["CudaGraphDecoder"]
