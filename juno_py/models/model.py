"""The decoder: embedding of the tokens used, blocks of attention and gated MLP over frozen quantized linears,
final norm, output projection. One block structure serves every architecture of the allowlist; what differs is
data in `ArchSpec` and `ModelArgs`.

The residual stream, norms, RoPE and attention run in fp32 (on a GPU with bf16 compute: bf16 activations, norms
computed in fp32); the frozen linears use `compute_dtype`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from juno_py.errors import GGUFFormatError
from juno_py.kernels import elementwise
from juno_py.models.attention import AttentionMask, attend
from juno_py.models.config import ArchSpec, ModelArgs, arch_spec
from juno_py.models.layout import TARGETS, Layout, resolve_layout
from juno_py.models.loss import LinearHead, TiledHead, chunked_cross_entropy
from juno_py.weights.frozen import FrozenQuantLinear

WEIGHTS_CACHES = ("none", "bf16", "fp32")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}
FUSED_ACTIVATIONS = {fn: name for name, fn in ACTIVATIONS.items()}  # the activations the fused kernels compute
# d act(x) · grad: the ATen kernels autograd itself runs for these activations (the same bits)
ACTIVATION_BACKWARDS = {
    F.silu: torch.ops.aten.silu_backward,
    ACTIVATIONS["gelu_tanh"]: partial(torch.ops.aten.gelu_backward, approximate="tanh"),
}


class GatedActivation(torch.autograd.Function):
    """`act(gate) · up` keeping only `gate` and `up` for backward, which recomputes `act(gate)`.

    Autograd of the plain expression keeps three tensors of the MLP's width per layer (gate, up and act(gate));
    this keeps two, a sixth of a step's saved activations on SmolLM2, for one activation recomputed per layer.
    The gradients are the ones autograd computes for the plain expression (the same ops in the same order)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, act) -> Tensor:
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):
        gate, up = ctx.saved_tensors
        d_up = dy * ctx.act(gate) if ctx.needs_input_grad[1] else None
        d_gate = None
        if ctx.needs_input_grad[0]:
            backward = ACTIVATION_BACKWARDS.get(ctx.act)
            if backward is not None:
                d_gate = backward(dy * up, gate)
            else:  # another activation: through autograd
                with torch.enable_grad():
                    g = gate.detach().requires_grad_(True)
                    d_gate = torch.autograd.grad(ctx.act(g), g, dy * up)[0]
        return d_gate, d_up, None


def _capturing(x: Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of x's device."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def gated(act, gate: Tensor, up: Tensor) -> Tensor:
    """`act(gate) · up`: the fused kernels on CUDA (`kernels.elementwise`: one pass forward, one backward), else
    through GatedActivation when a graph is being recorded."""
    name = FUSED_ACTIVATIONS.get(act)
    if name is not None:
        y = elementwise.gated(name, gate, up)
        if y is not None:
            return y
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return GatedActivation.apply(gate, up, act)
    return act(gate) * up


class RMSNorm(nn.Module):
    """`x / rms(x) · weight`, computed in the weight's dtype (fp32, or fp64 for exactness checks); the result has
    `out_dtype` (None: the weight's dtype; bf16 for bf16 activations). On CUDA one fused kernel each way
    (`kernels.elementwise`; backward keeps x and one fp32 rstd per row); the eager ops elsewhere. Gemma's
    `(1 + w)` needs nothing of its own: GGUF files hold the shifted weight."""

    def __init__(self, weight: Tensor, eps: float):
        super().__init__()
        self.eps = eps
        self.out_dtype: Optional[torch.dtype] = None
        self.register_buffer("weight", weight.float())

    def forward(self, x: Tensor) -> Tensor:
        y = elementwise.rms_norm(x, self.weight, self.eps, self.out_dtype or self.weight.dtype)
        if y is not None:
            return y
        x = x.to(self.weight.dtype)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y if self.out_dtype is None else y.to(self.out_dtype)


def rope_inv_freq(rope_dim: int, base: float, freq_scale: float = 1.0, factors: Optional[Tensor] = None) -> Tensor:
    """Angle per position of each rotated pair, float64: scale · base^(-2i/rope_dim) / factor_i."""
    inv = freq_scale * base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    return inv if factors is None else inv / factors.double()


def yarn_inv_freq(
    rope_dim: int,
    base: float,
    freq_scale: float,
    n_ctx_orig: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    ext_factor: float = 1.0,
    truncate: bool = True,
) -> Tensor:
    """YaRN's angle per position of each rotated pair, float64: pair i blends the interpolated angle
    (scale · base^(-2i/d)) with the unscaled one by a ramp that is 1 below the correction dimension of `beta_fast`
    rotations and 0 above that of `beta_slow` (over the original context), times `ext_factor`. `truncate`: the
    correction range rounded outwards to whole dimensions (llama.cpp's ggml_rope_yarn_corr_dims)."""
    extrap = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if freq_scale == 1.0:
        return extrap

    def corr_dim(rotations: float) -> float:
        return rope_dim * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, rope_dim - 1.0)
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    ramp = 1.0 - ((i - low) / max(high - low, 0.001)).clamp(0.0, 1.0)
    mix = ramp * ext_factor
    return freq_scale * extrap * (1 - mix) + extrap * mix


def rope_cos_sin(
    positions: Tensor, inv_freq: Tensor, attn_factor: float = 1.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin `[B, T, 1, rope_dim/2]` (fp32, or `dtype`) for integer positions `[B, T]`."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(positions.device)
    cos, sin = angles.cos() * attn_factor, angles.sin() * attn_factor
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


_COMPLEX_ROPE_DTYPES = (torch.float32, torch.float64)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str, complex_pairs: bool = True) -> Tensor:
    """Rotate the first rope_dim features of each head of `x` `[B, T, H, D]`; the rest pass through.

    Adjacent pairs ("norm") of fp32/fp64 x rotate as one complex multiply, (a + ib)·(cos + i·sin): the same products
    and sums as the real formulas (a·cos − b·sin, a·sin + b·cos; on the CPU the same bits, forward and backward),
    in one vectorized kernel instead of six strided ones and a stack (about 3× faster for a step's fwd+bwd on the
    CPU). bf16 (no complex dtype), the halves style ("neox") and `complex_pairs=False` use the real formulas."""
    n_rot = 2 * cos.shape[-1]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if style == "neox":
        a, b = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
        rot = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    elif complex_pairs and x.dtype in _COMPLEX_ROPE_DTYPES and cos.dtype == x.dtype:
        pairs = rot.unflatten(-1, (-1, 2))
        if pairs.stride(-1) != 1 or any(st % 2 for st in pairs.stride()[:-1]) or pairs.storage_offset() % 2:
            pairs = pairs.contiguous()  # view_as_complex needs whole complex numbers in memory
        rot = torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)).flatten(-2)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def rope_qk(q: Tensor, k: Tensor, rope: tuple[Tensor, Tensor], style: str) -> tuple[Tensor, Tensor]:
    """`apply_rope` of q and k: on CUDA one fused launch for both (and one for both gradients), else the eager ops."""
    out = elementwise.rope_qk(q, k, *rope, style)
    if out is not None:
        return out
    return apply_rope(q, *rope, style), apply_rope(k, *rope, style)


class KVCache:
    """Keys, values, positions (and documents, where given) of earlier tokens for every block, preallocated for
    `max_len` tokens."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device=None, dtype=torch.float32):
        self.max_len = max_len
        shape_k = (batch, args.n_head_kv, max_len, args.head_dim)
        shape_v = (batch, args.n_head_kv, max_len, args.head_dim_v)
        self.k = [torch.zeros(shape_k, device=device, dtype=dtype) for _ in range(args.n_layer)]
        self.v = [torch.zeros(shape_v, device=device, dtype=dtype) for _ in range(args.n_layer)]
        self.positions = torch.zeros((batch, max_len), device=device, dtype=torch.long)
        self.documents: Optional[Tensor] = None
        self.by_index = True  # every position so far is its index (attention masks then depend on shapes alone)
        self.length = 0
        self._start = 0

    def extend(self, positions: Tensor, documents: Optional[Tensor] = None, by_index: bool = False) -> Tensor:
        """Reserve room for the new tokens' entries; returns the key positions `[B, length]` they attend to.
        `documents` `[B, t]`: the new tokens' document ids (kept for `key_documents`); `by_index`: the positions
        are the tokens' indices."""
        t = positions.shape[1]
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {self.length} used, {t} more requested")
        self._start = self.length
        self.length += t
        self.positions[:, self._start : self.length] = positions
        self.by_index = self.by_index and by_index
        if documents is not None:
            if self.documents is None:
                self.documents = torch.zeros_like(self.positions)
            self.documents[:, self._start : self.length] = documents
        return self.positions[:, : self.length]

    def key_documents(self) -> Optional[Tensor]:
        """Document ids `[B, length]` of the cached tokens, None when none were given."""
        return None if self.documents is None else self.documents[:, : self.length]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self._start + k.shape[2]
        self.k[layer][:, :, self._start : end] = k
        self.v[layer][:, :, self._start : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class QuantEmbedding(nn.Module):
    """Token embedding that dequantizes only the rows of the tokens in the batch: on the CPU from the file's
    memory map, or on the device where the table's bytes already are (an in-memory model built there)."""

    def __init__(self, gguf, tensor: str, scale: Optional[float] = None):
        super().__init__()
        self.gguf, self.tensor, self.scale = gguf, tensor, scale
        self.n_vocab, self.dim = gguf.tensors[tensor].shape
        self.device = torch.device("cpu")

    def _apply(self, fn, recurse=True):
        self.device = fn(torch.empty(0)).device
        return super()._apply(fn, recurse)

    def forward(self, tokens: Tensor) -> Tensor:
        from juno_py.gguf import quants

        ids, inverse = torch.unique(tokens.reshape(-1).cpu(), return_inverse=True)
        if len(ids) and (ids[0] < 0 or ids[-1] >= self.n_vocab):
            bad = int(ids[0] if ids[0] < 0 else ids[-1])
            raise IndexError(f"token id {bad} is outside the vocabulary of {self.n_vocab} ({self.tensor})")
        info = self.gguf.tensors[self.tensor]
        raw = info.raw
        if isinstance(raw, torch.Tensor) and raw.device.type != "cpu":
            from juno_py.kernels import dequant

            picked = raw.index_select(0, ids.to(raw.device))
            if dequant.has_kernel(info.ggml_type) and dequant.triton_ready(raw.device):
                rows = dequant.dequantize_tile(picked, info.ggml_type, self.dim, dtype=torch.float32)
            else:
                rows = quants.dequantize(info.ggml_type, picked.cpu(), self.dim, what=self.tensor)
            inverse = inverse.to(rows.device)
        else:
            rows = quants.dequantize(info.ggml_type, raw[ids.numpy()], self.dim, what=self.tensor)
        out = rows[inverse].reshape(*tokens.shape, self.dim)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=torch.float32)
        return out.to(self.device)


@contextlib.contextmanager
def _nested(outer, inner):
    with outer, inner:
        yield


class Block(nn.Module):
    """One decoder block. `linears` holds the frozen linear of every logical target (`wq` ... `wdown`), looked up
    at each call so that an adapter can wrap one by replacing its entry. A mixture-of-experts block has `moe`
    (`juno_py.models.moe`) in place of the dense MLP, with its router in `linears["wrouter"]`."""

    def __init__(
        self,
        args: ModelArgs,
        spec: ArchSpec,
        layer: int,
        linears: dict[str, nn.Module],
        norms: dict[str, Tensor],
        moe: Optional[nn.Module] = None,
        sinks: Optional[Tensor] = None,
    ):
        super().__init__()
        self.moe = moe
        self.args, self.spec, self.layer = args, spec, layer
        self.linears = nn.ModuleDict(linears)
        self.norms = nn.ModuleDict({role: RMSNorm(w, args.norm_eps) for role, w in norms.items()})
        self.window = args.sliding_window if args.is_sliding(layer) else 0
        self.act_dtype = torch.float32  # the residual stream's dtype (float64 only for exactness checks)
        self.act = ACTIVATIONS[spec.activation]
        # attention sink logits [n_head] (gpt-oss), frozen
        self.sinks: Optional[Tensor]
        self.register_buffer("sinks", None if sinks is None else sinks.float(), persistent=False)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Optional[AttentionMask], cache: Optional[KVCache] = None
    ) -> Tensor:
        return self.around(x, lambda h: self.attention(h, rope, mask, cache))

    def around(
        self, x: Tensor, attend: Callable[[Tensor], Tensor], feed_forward: Optional[Callable[[Tensor], Tensor]] = None
    ) -> Tensor:
        """The block's norms and residuals around `attend` (normed input -> attention output) and the feed-forward
        (`feed_forward`, default the block's own): the forward, and decoders that compute attention (a static cache)
        or play the feed-forward's adapters their own way."""
        h = attend(self.norms["attn_norm"](x))
        if self.spec.sandwich_norms:
            h = self.norms["post_attention_norm"](h)
        x = x + h
        h = (feed_forward or self.feed_forward)(self.norms["ffn_norm"](x))
        if self.spec.sandwich_norms:
            h = self.norms["post_ffw_norm"](h)
        return x + h

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Optional[AttentionMask], cache: Optional[KVCache]
    ) -> Tensor:
        a, (b, t, _) = self.args, x.shape
        q = self.linears["wq"](x).to(self.act_dtype).view(b, t, a.n_head, a.head_dim)
        k = self.linears["wk"](x).to(self.act_dtype).view(b, t, a.n_head_kv, a.head_dim)
        v = self.linears["wv"](x).to(self.act_dtype).view(b, t, a.n_head_kv, a.head_dim_v)
        if self.spec.qk_norm:
            q, k = self.norms["attn_q_norm"](q), self.norms["attn_k_norm"](k)
        q, k = rope_qk(q, k, rope, self.spec.rope_style)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        sinks = None if self.sinks is None else self.sinks.to(q.dtype)
        y = attend(q, k, v, mask, a.attn_scale, enable_gqa=a.n_head != a.n_head_kv, sinks=sinks)
        return self.linears["wo"](y.transpose(1, 2).reshape(b, t, a.n_head * a.head_dim_v)).to(self.act_dtype)

    def feed_forward(self, x: Tensor) -> Tensor:
        if self.moe is not None:
            return self.moe(x, self.linears["wrouter"])
        return self.gated_down(self.linears["wgate"](x), self.linears["wup"](x))

    def gated_down(self, gate: Tensor, up: Tensor) -> Tensor:
        """The dense feed-forward after its gate and up products: down(act(gate) · up), in the activations' dtype."""
        h = gated(self.act, gate.to(self.act_dtype), up.to(self.act_dtype))
        return self.linears["wdown"](h).to(self.act_dtype)


@dataclass(frozen=True)
class TargetRef:
    """A logical target of one block and where its frozen weight lives in the file (for an expert target: which
    expert of the 3-D tensor, and the rows within that expert's slice)."""

    layer: int
    target: str
    module: nn.Module
    tensor: str
    rows: tuple[int, int]
    expert: Optional[int] = None


class Transformer(nn.Module):
    def __init__(
        self,
        gguf,
        args: ModelArgs,
        spec: ArchSpec,
        layout: Layout,
        weights_cache: str = "none",
        compute_dtype: torch.dtype = torch.float32,
        n_ctx: Optional[int] = None,
    ):
        super().__init__()
        if weights_cache not in WEIGHTS_CACHES:
            raise ValueError(f"weights_cache is {weights_cache!r}: expected one of {', '.join(WEIGHTS_CACHES)}")
        self.gguf, self.args, self.spec, self.layout = gguf, args, spec, layout
        self.checkpoint_blocks = False  # recompute each block in backward (activation checkpointing)
        self.act_dtype = torch.float32
        self.compute_dtype = compute_dtype

        def linear(name: str, rows: Optional[slice] = None, bias: Optional[str] = None) -> nn.Module:
            return FrozenQuantLinear.from_gguf(
                gguf, name, rows=rows, bias=bias, cache=weights_cache, compute_dtype=compute_dtype
            )

        def vector(name: str) -> Tensor:
            return gguf.dequantize(name).float()

        self.embed = QuantEmbedding(gguf, layout.token_embd, math.sqrt(args.n_embd) if spec.embed_scale else None)
        self.blocks = nn.ModuleList()
        for il, bl in enumerate(layout.blocks):
            linears = {t: linear(s.tensor, s.row_slice, s.bias) for t, s in bl.targets.items()}
            norms = {role: vector(name) for role, name in bl.norms.items()}
            moe = None
            if bl.experts:
                from juno_py.models.moe import build_moe, swiglu_oai

                act = (
                    swiglu_oai
                    if spec.expert_activation == "swiglu_oai"
                    else partial(gated, ACTIVATIONS[spec.activation])
                )
                moe = build_moe(gguf, args, act, bl, weights_cache, compute_dtype, spec.routing)
            sinks = vector(bl.sinks) if bl.sinks else None
            self.blocks.append(Block(args, spec, il, linears, norms, moe, sinks))
        self.norm = RMSNorm(vector(layout.output_norm), args.norm_eps)
        self.output = linear(layout.output, None, layout.output_bias)

        # RoPE: one table of angles per distinct (base, scale) among the layers
        factors = None
        if layout.rope_freqs:
            factors = vector(layout.rope_freqs)
        elif layout.rope_factors_long or layout.rope_factors_short:
            long_ctx = (n_ctx or args.n_ctx_orig) > args.n_ctx_orig  # llama.cpp picks by the context size
            name = layout.rope_factors_long if long_ctx else layout.rope_factors_short
            if name is None:
                raise GGUFFormatError(
                    f"{gguf.path}: tensor 'rope_factors_{'long' if long_ctx else 'short'}.weight' "
                    f"is missing: expected it beside its LongRoPE counterpart"
                )
            factors = vector(name)
        keys = [
            (args.rope_base_of(il), args.rope_scale_of(il), args.rope_attn_factor_of(il)) for il in range(args.n_layer)
        ]
        self._rope_keys = sorted(set(keys))
        self._rope_of_layer = [self._rope_keys.index(k) for k in keys]
        self._rope_attn = [attn for _, _, attn in self._rope_keys]  # what multiplies cos and sin, per table
        for i, (base, scale, _) in enumerate(self._rope_keys):
            if args.rope_scaling == "yarn":
                inv = yarn_inv_freq(
                    args.rope_dim,
                    base,
                    scale,
                    args.n_ctx_orig,
                    args.yarn_beta_fast,
                    args.yarn_beta_slow,
                    args.yarn_ext_factor,
                    args.yarn_truncate,
                )
                inv = inv if factors is None else inv / factors.double()
            else:
                inv = rope_inv_freq(args.rope_dim, base, scale, factors)
            self.register_buffer(f"_inv_freq{i}", inv, persistent=False)

    @classmethod
    def from_gguf(
        cls, gguf, weights_cache: str = "none", compute_dtype: torch.dtype = torch.float32, n_ctx: Optional[int] = None
    ) -> "Transformer":
        spec = arch_spec(gguf.architecture, gguf.path)
        args = ModelArgs.from_gguf(gguf)
        return cls(gguf, args, spec, resolve_layout(gguf, args, spec), weights_cache, compute_dtype, n_ctx)

    @classmethod
    def from_tensors(
        cls,
        metadata,
        tensors,
        weights_cache: str = "none",
        compute_dtype: torch.dtype = torch.float32,
        n_ctx: Optional[int] = None,
        label: str = "<memory>",
    ) -> "Transformer":
        """A model from metadata and quantized tensors held in memory, no file: `tensors` maps GGUF tensor names to
        `(ggml_type, shape, uint8 bytes)` (see `juno_py.gguf.MemoryGGUF`); bytes already on a GPU stay there."""
        from juno_py.gguf.memory import MemoryGGUF

        return cls.from_gguf(MemoryGGUF(metadata, tensors, label), weights_cache, compute_dtype, n_ctx)

    def frozen_linears(self) -> Iterator[FrozenQuantLinear]:
        for m in self.modules():
            if isinstance(m, FrozenQuantLinear):
                yield m

    def place(self, device, weights_cache: str = "none") -> "Transformer":
        """Move the model to `device` and set it up for it. On a GPU the frozen weights stay quantized there (or,
        with `weights_cache` "bf16"/"fp32", a dequantized copy is decoded on the GPU after the move) and, with bf16
        compute, the activations run in bf16 (norms in fp32; adapters keep fp32 weights)."""
        if weights_cache not in WEIGHTS_CACHES:
            raise ValueError(f"weights_cache is {weights_cache!r}: expected one of {', '.join(WEIGHTS_CACHES)}")
        device = torch.device(device)
        self.to(device)
        if device.type != "cpu":
            for lin in self.frozen_linears():
                if lin.cache != weights_cache:
                    lin.set_weights_cache(weights_cache)
            if self.compute_dtype == torch.bfloat16:
                self.set_activation_dtype(torch.bfloat16)
        return self

    def set_activation_dtype(self, dtype: torch.dtype) -> "Transformer":
        """Run the residual stream, RoPE and attention in `dtype`: float32 (the default), float64 for exactness
        checks (frozen linears then compute in float64 over the same dequantized values), or bfloat16 (GPU
        training: norms still compute in fp32, adapters keep fp32 weights)."""
        self.act_dtype = dtype
        for blk in self.blocks:
            blk.act_dtype = dtype
        norm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight = m.weight.to(norm_dtype)
                m.out_dtype = None if dtype == norm_dtype else dtype
        return self

    # --- forward ---------------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: Tensor,
        positions: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        documents: Optional[Tensor] = None,
    ) -> Tensor:
        """Hidden states after the final norm, fp32 `[B, T, n_embd]`, for token ids `[B, T]`.

        `positions` `[B, T]` default to 0.. T-1 (after the cache's tokens). `documents` `[B, T]`: document ids
        (packed rows; padding tokens are documents of their own): a token attends only to its own document's
        tokens. `mask` `[B, T, S]` (S = keys: cached plus new) restricts attention further where a caller holds
        such a mask (it costs O(T·S); documents do not); causality by position and sliding windows always apply.
        """
        device = self.embed.device  # inputs may come from the CPU (data loaders): they follow the model
        positions = positions.to(device) if positions is not None else None
        mask = mask.to(device) if mask is not None else None
        documents = documents.to(device) if documents is not None else None
        return self.hidden_states(self.embed_tokens(tokens), positions, mask, cache, documents)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """The token embeddings `[B, T, n_embd]` in the activations' dtype, on the model's device (the frozen table's
        rows of the tokens used, dequantized)."""
        return self.embed(tokens.to(self.embed.device)).to(self.act_dtype)

    def hidden_states(
        self,
        x: Tensor,
        positions: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        documents: Optional[Tensor] = None,
    ) -> Tensor:
        """`forward` from the embeddings `x` `[B, T, n_embd]` on: the blocks and the final norm. Every input is on
        the model's device already; nothing here reads the host (a CUDA graph can capture it: `train.cuda_graph`).
        Which keys each query sees is built once per distinct sliding window (`models.attention.AttentionMask`)
        and the kernel is chosen there."""
        b, t = x.shape[:2]
        by_index = positions is None and documents is None
        plain = mask is None and cache is None and by_index  # causal by index: SDPA's causal kernels
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + t, device=x.device).expand(b, t)
        k_doc = documents
        if cache is not None:
            k_pos = cache.extend(positions, documents, by_index)
            by_index = cache.by_index
            k_doc = cache.key_documents() if documents is not None else None
        else:
            k_pos = positions
        masks = {
            w: None
            if plain and not w
            else AttentionMask(positions, k_pos, w, documents if k_doc is not None else None, k_doc, mask, by_index)
            for w in {blk.window for blk in self.blocks}
        }
        ropes = [
            rope_cos_sin(positions, getattr(self, f"_inv_freq{i}"), self._rope_attn[i], self.act_dtype)
            for i in range(len(self._rope_keys))
        ]
        for blk in self.blocks:
            rope, m = ropes[self._rope_of_layer[blk.layer]], masks[blk.window]
            if self.checkpoint_blocks and torch.is_grad_enabled() and cache is None:
                # inside a CUDA graph's capture the RNG state cannot be read; captured steps have no dropout
                x = checkpoint(blk, x, rope, m, use_reentrant=False, preserve_rng_state=not _capturing(x))
            else:
                x = blk(x, rope, m, cache)
        return self.norm(x)

    def project(self, hidden: Tensor) -> Tensor:
        """Logits (fp32) of hidden states: the output projection, then the final soft cap if the model has one."""
        logits = self.output(hidden).to(self.act_dtype)
        cap = self.args.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def loss_head(self) -> Optional[LinearHead | TiledHead]:
        """The output projection as a head that the chunked loss computes block by block, never holding
        `[positions, vocab]` logits. Where a quantized W lives on the CPU, a LinearHead: one decode of W per chunk
        instead of two when it streams, and each block of W's rows meets the chunk's hidden states while its logits
        are still in cache (SmolLM2, bf16 cache, 2 cores: about 5 % of a LoRA step faster and 0.1 GiB less peak
        memory than the logits through `project`). Where W's bytes are on a GPU, a TiledHead: tiles of W decoded
        one at a time instead of all of W held decoded beside a chunk's logits over the whole vocabulary
        (Gemma-3-270M, 8 × 512 tokens: 0.87 GiB at the loss's peak became about 0.1). None otherwise (the loss
        calls `project`): float64 activations (exactness checks), an output that is not quantized."""
        out = self.output
        if not isinstance(out, FrozenQuantLinear):
            return None
        if out.resident:
            if self.act_dtype not in (torch.float32, torch.bfloat16):
                return None
            return TiledHead(out, self.args.final_logit_softcap)
        if self.act_dtype != torch.float32:
            return None
        return LinearHead(out, self.args.final_logit_softcap)

    def output_decoded(self):
        """Context for the chunked loss: a quantized output projection on the GPU that the loss multiplies through
        `project` (float64 activations; a TiledHead decodes its own tiles) is decoded once for all chunks
        (`FrozenQuantLinear.decoded`) instead of twice per chunk; anything else is left as it is. A sharded model
        (`juno_py.train.sharded`) first gathers the projection's bytes here (`output_hold`)."""
        out = self.output
        decode = isinstance(out, FrozenQuantLinear) and not isinstance(self.loss_head(), TiledHead)
        inner = out.decoded() if decode else contextlib.nullcontext()
        hold = getattr(self, "output_hold", None)
        return inner if hold is None else _nested(hold(), inner)

    def logits(self, token_ids) -> Tensor:
        """`[T, vocab]` fp32 logits for a sequence of token ids (`[B, T, vocab]` for a `[B, T]` batch)."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long, device=self.embed.device)
        batch = tokens.dim() == 2
        out = self.project(self(tokens if batch else tokens.unsqueeze(0)))
        out = out if out.dtype == torch.float64 else out.float()
        return out if batch else out[0]

    def loss(
        self,
        tokens: Tensor,
        targets: Tensor,
        positions: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        chunk: int = 1024,
        ignore_index: int = -100,
        reduction: str = "mean",
        documents: Optional[Tensor] = None,
    ) -> Tensor:
        """Cross-entropy of `targets` `[B, T]` (ignore_index: no loss), logits computed in chunks of positions."""
        hidden = self(tokens, positions, mask, documents=documents)
        return chunked_cross_entropy(
            hidden,
            targets,
            self.project,
            chunk=chunk,
            ignore_index=ignore_index,
            reduction=reduction,
            hold=self.output_decoded(),
            head=self.loss_head(),
        )

    # --- structure -------------------------------------------------------------------------------------------
    def targets(self, names: Sequence[str] = TARGETS) -> Iterator[TargetRef]:
        """Every (block, logical target) with its current module and physical tensor rows; an expert target once per
        expert. Targets a block does not have (the dense MLP of an MoE block) are skipped."""
        for blk, bl in zip(self.blocks, self.layout.blocks):
            for name in names:
                if name in bl.targets:
                    slot = bl.targets[name]
                    yield TargetRef(blk.layer, name, blk.linears[name], slot.tensor, slot.rows)
                elif name in bl.experts:
                    slot = bl.experts[name]
                    for e, module in enumerate(blk.moe.experts[name]):
                        yield TargetRef(blk.layer, name, module, slot.tensor, slot.rows, e)

    def linear(self, layer: int, target: str, expert: Optional[int] = None) -> nn.Module:
        """The module now at a target (an expert target needs its expert)."""
        blk = self.blocks[layer]
        return blk.linears[target] if expert is None else blk.moe.experts[target][expert]

    def set_linear(self, layer: int, target: str, module: nn.Module, expert: Optional[int] = None) -> None:
        """Put `module` at a target (an adapter wrapping the frozen linear, or the frozen linear back)."""
        blk = self.blocks[layer]
        if expert is None:
            blk.linears[target] = module
        else:
            blk.moe.experts[target][expert] = module

    def expert_load(self, reset: bool = False) -> dict[int, Tensor]:
        """Tokens routed to each expert per MoE block since the load was last reset: `{layer: counts [n_expert]}`
        (`reset`: copies of them, and counting starts afresh). A reset zeroes the counts in place, so the tensors a
        captured training step adds into stay the ones read here."""
        out = {blk.layer: blk.moe.load for blk in self.blocks if blk.moe is not None and blk.moe.load is not None}
        if reset:
            out = {layer: counts.clone() for layer, counts in out.items()}
            for blk in self.blocks:
                if blk.moe is not None and blk.moe.load is not None:
                    if blk.moe.load.is_inference():  # not writable outside inference mode
                        blk.moe.load = None
                    else:
                        blk.moe.load.zero_()
        return out

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.args, batch, max_len, device=self.embed.device, dtype=self.act_dtype)

    @property
    def tokenizer(self):
        """The GGUF's tokenizer, loaded on first use."""
        if getattr(self, "_tokenizer", None) is None:
            from juno_py.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value
