"""Architectures we run: the allowlist as a table of per-architecture facts, and the hyperparameters read from
GGUF metadata with llama.cpp's defaults where the file is silent.

Facts that are not in the metadata (rotary style, Gemma 3's sliding-window pattern and local RoPE base, its
attention scale) live in `ARCHITECTURES` and in `ModelArgs.from_gguf`, each as llama.cpp defines them. So do the
facts the exchange with Hugging Face needs: each target's module name in transformers' model of the architecture,
and which targets' rows llama.cpp's converter permuted.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from juno_py.errors import GGUFFormatError, UnsupportedArchitecture, show

_MISSING = object()

# logical target -> Hugging Face module inside a decoder layer (`model.layers.N.<module>`)
HF_SPLIT_MODULES = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "wgate": "mlp.gate_proj",
    "wup": "mlp.up_proj",
    "wdown": "mlp.down_proj",
}
HF_FUSED_MODULES = {
    "wq": "self_attn.qkv_proj",
    "wk": "self_attn.qkv_proj",
    "wv": "self_attn.qkv_proj",
    "wo": "self_attn.o_proj",
    "wgate": "mlp.gate_up_proj",
    "wup": "mlp.gate_up_proj",
    "wdown": "mlp.down_proj",
}
# mixture-of-experts target -> the Hugging Face parameter holding it (`model.layers.N.<parameter>`), which PEFT
# adapts through `target_parameters`: the router is a 2-D weight of its own module (not an nn.Linear), the experts
# 3-D parameters `[n_expert, ...]` with gate and up fused in `gate_up_proj`. Within a module the parameters are
# listed in the order transformers registers them, the order PEFT wraps them in.
HF_MOE_PARAMETERS = {  # Qwen3MoeForCausalLM, MixtralForCausalLM: `[n_expert, n_out, n_in]`, gate rows first
    "wrouter": "mlp.gate.weight",
    "wgate_exps": "mlp.experts.gate_up_proj",
    "wup_exps": "mlp.experts.gate_up_proj",
    "wdown_exps": "mlp.experts.down_proj",
}
GPT_OSS_MOE_PARAMETERS = {  # GptOssForCausalLM: `[n_expert, n_in, n_out]`, gate and up outputs interleaved
    "wrouter": "mlp.router.weight",
    "wgate_exps": "mlp.experts.gate_up_proj",
    "wup_exps": "mlp.experts.gate_up_proj",
    "wdown_exps": "mlp.experts.down_proj",
}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the block structures we implement."""

    rope_style: str  # "norm": rotate adjacent pairs (x[2i], x[2i+1]); "neox": rotate halves (x[i], x[i+d/2])
    activation: str = "silu"  # gate activation of the gated MLP: "silu" or "gelu_tanh"
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE (attn_q_norm, attn_k_norm)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP (post_attention_norm, post_ffw_norm)
    embed_scale: bool = False  # embeddings multiplied by sqrt(n_embd)
    swa_pattern: int = 0  # layer il uses sliding-window attention when il % pattern < pattern - 1 (0: never)
    swa_rope_base: float = 10000.0  # RoPE base of sliding layers when rope.freq_base_swa is absent
    required_biases: tuple[str, ...] = ()  # biases llama.cpp requires (others are used when present)
    # each target's module in Hugging Face's model; targets sharing a module are fused there (rows in target order)
    hf_modules: Mapping[str, str] = field(default_factory=lambda: HF_SPLIT_MODULES, hash=False)
    # targets whose GGUF rows are a per-head permutation of Hugging Face's: target -> ModelArgs field with the
    # head count the permutation runs over
    hf_permuted_rows: Mapping[str, str] = field(default_factory=dict, hash=False)
    # each mixture-of-experts target's parameter in Hugging Face's model (`HF_MOE_PARAMETERS`); empty: none
    hf_parameters: Mapping[str, str] = field(default_factory=dict, hash=False)
    # Hugging Face modules or parameters whose fused targets' outputs alternate one by one (gpt-oss's gate_up_proj:
    # gate, up, gate, up, ...) rather than following each other in target order
    hf_interleaved: tuple[str, ...] = ()
    # mixture-of-experts feed-forward: "" (never), "optional" (when {arch}.expert_count > 0), "required"
    experts: str = ""
    # learned per-head attention sink logits (`attn_sinks`), added to each softmax's denominator
    attn_sinks: bool = False
    # routing: "softmax_topk" (softmax over all experts, top k, renormalised) or "topk_softmax" (top k of the
    # logits, softmax over those k: llama.cpp's SOFTMAX_WEIGHT gating)
    routing: str = "softmax_topk"
    # the experts' gated activation: "" (the block's `activation` · up) or "swiglu_oai" (gpt-oss's clamped SwiGLU)
    expert_activation: str = ""
    ffn_norm_tensor: str = "ffn_norm"  # the tensor of the norm before the feed-forward (gpt-oss: post_attention_norm)
    sliding_rope_same: bool = False  # sliding layers use the global RoPE base and scaling (else swa_rope_base, none)
    yarn_truncate: bool = True  # YaRN's correction range rounded outwards to whole dimensions (llama.cpp's)


ARCHITECTURES: dict[str, ArchSpec] = {
    # Mistral-style models arrive as llama. llama.cpp's converter permutes Q and K rows so that rotating
    # adjacent pairs on the file's rows equals Hugging Face's rotate-half on its own rows.
    # Mixtral-style models are llama files with {arch}.expert_count > 0 and 3-D expert tensors.
    "llama": ArchSpec(
        rope_style="norm",
        hf_permuted_rows={"wq": "n_head", "wk": "n_head_kv"},
        experts="optional",
        hf_parameters=HF_MOE_PARAMETERS,
    ),
    "qwen2": ArchSpec(rope_style="neox", required_biases=("wq", "wk", "wv")),
    "qwen3": ArchSpec(rope_style="neox", qk_norm=True),
    "qwen3moe": ArchSpec(rope_style="neox", qk_norm=True, experts="required", hf_parameters=HF_MOE_PARAMETERS),
    # llama.cpp disables Phi-3's sliding window; so do we. Hugging Face fuses its attention and MLP inputs.
    "phi3": ArchSpec(rope_style="neox", hf_modules=HF_FUSED_MODULES),
    # gpt-oss: biased attention with sinks, every other layer sliding (even layers), biased experts with a clamped
    # SwiGLU, top-k-then-softmax routing, YaRN on every layer. The YaRN correction range is not rounded, as the
    # checkpoints' `truncate: false` says and transformers computes it.
    "gpt-oss": ArchSpec(
        rope_style="neox",
        swa_pattern=2,
        required_biases=("wq", "wk", "wv", "wo", "wrouter"),
        experts="required",
        attn_sinks=True,
        routing="topk_softmax",
        expert_activation="swiglu_oai",
        ffn_norm_tensor="post_attention_norm",
        sliding_rope_same=True,
        yarn_truncate=False,
        hf_parameters=GPT_OSS_MOE_PARAMETERS,
        hf_interleaved=("mlp.experts.gate_up_proj",),
    ),
    "gemma3": ArchSpec(
        rope_style="neox", activation="gelu_tanh", qk_norm=True, sandwich_norms=True, embed_scale=True, swa_pattern=6
    ),
}


def arch_spec(architecture: str, path: Any = "") -> ArchSpec:
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        where = f"{path}: " if path else ""
        raise UnsupportedArchitecture(
            f"{where}architecture {show(architecture)} is not supported: expected one of {', '.join(ARCHITECTURES)}"
        )
    return spec


class _Meta:
    """Typed access to `<arch>.*` metadata keys; every complaint names the file and the key."""

    def __init__(self, gguf):
        self.path = gguf.path
        self.arch = gguf.architecture
        self.values = gguf.metadata

    def get(self, key: str, default: Any = _MISSING, kind: type = int) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.values:
            if default is _MISSING:
                raise GGUFFormatError(f"{self.path}: metadata {full!r} is missing, expected {kind.__name__}")
            return default
        value = self.values[full]
        if isinstance(value, (list, array.array)):  # per-layer arrays (head counts, ff sizes): must be uniform
            if not value or any(v != value[0] for v in value):
                raise GGUFFormatError(
                    f"{self.path}: metadata {full!r} varies per layer ({show(value)}): "
                    f"expected one value for every layer"
                )
            value = value[0]
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is float
            else isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        )
        if not ok:
            raise GGUFFormatError(f"{self.path}: metadata {full!r} is {show(value)}, expected {kind.__name__}")
        return kind(value)

    def positive(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if value <= 0:
            raise GGUFFormatError(f"{self.path}: metadata {self.arch}.{key!r} is {value}, expected a positive integer")
        return value


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length
    head_dim_v: int  # attention.value_length
    n_ff: int
    norm_eps: float
    rope_dim: int  # rotated dimensions per head (partial rotary when < head_dim)
    rope_base: float
    rope_base_swa: float
    rope_freq_scale: float  # 1 / rope.scaling.factor (linear scaling)
    rope_attn_factor: float  # multiplies cos and sin (LongRoPE's attention factor)
    n_ctx_train: int
    n_ctx_orig: int  # rope.scaling.original_context_length: above it LongRoPE uses its long factors
    sliding_window: int  # 0 when no layer slides
    swa_pattern: int
    attn_scale: float
    final_logit_softcap: float  # 0: none
    n_expert: int = 0  # experts per MoE block (0: dense feed-forward)
    n_expert_used: int = 0  # experts each token is routed to (top-k)
    n_ff_exp: int = 0  # hidden size of one expert
    rope_scaling: str = "linear"  # "none", "linear", "longrope" or "yarn"
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = 1.0
    yarn_truncate: bool = True
    sliding_rope_same: bool = False

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def v_dim(self) -> int:
        return self.n_head_kv * self.head_dim_v

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1

    def rope_base_of(self, layer: int) -> float:
        return self.rope_base_swa if self.is_sliding(layer) and not self.sliding_rope_same else self.rope_base

    def rope_scale_of(self, layer: int) -> float:
        if self.is_sliding(layer) and not self.sliding_rope_same:
            return 1.0  # llama.cpp: Gemma 3's sliding layers never scale
        return self.rope_freq_scale

    def rope_attn_factor_of(self, layer: int) -> float:
        """What multiplies cos and sin: the attention factor, times YaRN's 1 + 0.1·ln(factor) where YaRN scales."""
        scale = self.rope_scale_of(layer)
        if self.rope_scaling == "yarn" and self.yarn_ext_factor != 0 and scale < 1.0:
            return self.rope_attn_factor * (1.0 + 0.1 * math.log(1.0 / scale))
        return self.rope_attn_factor

    @classmethod
    def from_gguf(cls, gguf) -> "ModelArgs":
        arch = gguf.architecture
        spec = arch_spec(arch, gguf.path)
        m = _Meta(gguf)
        n_embd = m.positive("embedding_length")
        n_head = m.positive("attention.head_count")
        n_head_kv = m.positive("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise GGUFFormatError(
                f"{gguf.path}: metadata {arch}.attention.head_count_kv is {n_head_kv}, expected a "
                f"divisor of attention.head_count ({n_head})"
            )
        head_dim = m.positive("attention.key_length", n_embd // n_head)
        head_dim_v = m.positive("attention.value_length", n_embd // n_head)
        rope_dim = m.positive("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise GGUFFormatError(
                f"{gguf.path}: metadata {arch}.rope.dimension_count is {rope_dim}, expected an even "
                f"number no larger than the head size {head_dim}"
            )
        scaling = m.get("rope.scaling.type", "linear", str)  # llama.cpp's default; a factor of 0 means none
        if scaling not in ("none", "linear", "longrope", "yarn"):
            raise UnsupportedArchitecture(
                f"{gguf.path}: metadata {arch}.rope.scaling.type is {show(scaling)}: "
                f"supported RoPE scalings are none, linear, yarn and longrope (LongRoPE factor "
                f"tensors)"
            )
        factor = m.get("rope.scaling.factor", 0.0, float) or m.get("rope.scale_linear", 0.0, float)
        n_ctx_train = m.positive("context_length", 2048)
        n_layer = m.positive("block_count")
        if spec.swa_pattern:  # gpt-oss: llama.cpp requires the window
            sliding_window = m.get("attention.sliding_window", _MISSING if spec.attn_sinks else 0)
        else:
            sliding_window = 0
        if sliding_window < 0:
            raise GGUFFormatError(
                f"{gguf.path}: metadata {arch}.attention.sliding_window is {sliding_window}, "
                f"expected a non-negative integer"
            )
        n_expert, n_expert_used, n_ff_exp = _experts(m, spec)
        if arch == "gemma3" and n_layer == 62:  # Gemma 3 27B: llama.cpp scales by n_embd / n_head
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)
        else:
            attn_scale = 1.0 / math.sqrt(head_dim)
        return cls(
            architecture=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_ff=m.positive("feed_forward_length") if not n_expert else m.get("feed_forward_length", n_ff_exp),
            norm_eps=m.get("attention.layer_norm_rms_epsilon", kind=float),
            rope_dim=rope_dim,
            rope_base=m.get("rope.freq_base", 10000.0, float),
            rope_base_swa=m.get("rope.freq_base_swa", spec.swa_rope_base, float),
            rope_freq_scale=1.0 / factor if factor and scaling != "none" else 1.0,
            rope_attn_factor=m.get(
                "rope.scaling.yarn_attn_factor" if scaling == "yarn" else "rope.scaling.attn_factor", 1.0, float
            ),
            n_ctx_train=n_ctx_train,
            n_ctx_orig=m.positive("rope.scaling.original_context_length", n_ctx_train),
            sliding_window=sliding_window,
            swa_pattern=spec.swa_pattern,
            attn_scale=attn_scale,
            final_logit_softcap=m.get("final_logit_softcapping", 0.0, float),
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            rope_scaling=scaling,
            yarn_beta_fast=m.get("rope.scaling.yarn_beta_fast", 32.0, float),
            yarn_beta_slow=m.get("rope.scaling.yarn_beta_slow", 1.0, float),
            yarn_ext_factor=m.get("rope.scaling.yarn_ext_factor", 1.0, float) if scaling == "yarn" else 0.0,
            yarn_truncate=spec.yarn_truncate,
            sliding_rope_same=spec.sliding_rope_same,
        )


def _experts(m: _Meta, spec: ArchSpec) -> tuple[int, int, int]:
    """(n_expert, n_expert_used, n_ff_exp) as llama.cpp reads them; (0, 0, 0) for a dense feed-forward."""
    if not spec.experts:
        return 0, 0, 0
    n_expert = m.get("expert_count", 0 if spec.experts == "optional" else _MISSING)
    if n_expert == 0 and spec.experts == "optional":
        return 0, 0, 0
    if n_expert <= 0:
        raise GGUFFormatError(f"{m.path}: metadata {m.arch}.expert_count is {n_expert}, expected a positive integer")
    n_used = m.get("expert_used_count")
    if not 0 < n_used <= n_expert:
        raise GGUFFormatError(
            f"{m.path}: metadata {m.arch}.expert_used_count is {n_used}, expected 1..{n_expert} (expert_count)"
        )
    if spec.experts == "required":  # qwen3moe: expert_feed_forward_length, else n_ff / n_expert_used
        n_ff_exp = m.get("expert_feed_forward_length", 0) or m.positive("feed_forward_length") // n_used
    else:  # llama: every expert has the dense feed_forward_length
        n_ff_exp = m.positive("feed_forward_length")
    if n_ff_exp <= 0:
        raise GGUFFormatError(
            f"{m.path}: metadata {m.arch}.expert_feed_forward_length is {n_ff_exp}, expected a positive integer"
        )
    return n_expert, n_used, n_ff_exp
