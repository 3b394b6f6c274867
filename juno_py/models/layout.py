"""Layout: where each logical weight of the model lives in the file, resolved from the tensors present.

Logical targets are `wq wk wv wo wgate wup wdown` per block. A mixture-of-experts block (`{arch}.expert_count`
> 0) has `wrouter` (`ffn_gate_inp`, one row per expert) and the experts' `wgate_exps wup_exps wdown_exps` (3-D
tensors `ffn_*_exps`, `[n_expert, n_out, n_in]`, one 2-D weight per expert) in place of the dense MLP. A file may hold Q, K and V split (`attn_q`,
`attn_k`, `attn_v`) or fused (`attn_qkv`, rows q‖k‖v), and the MLP's gate and up split (`ffn_gate`, `ffn_up`)
or fused (`ffn_up` with 2·n_ff rows, gate first, no `ffn_gate`), in any architecture. Every shape is checked
against the metadata, and every tensor of the file must be used: a leftover tensor means a feature we would
silently ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from juno_py.errors import GGUFFormatError
from juno_py.models.config import ArchSpec, ModelArgs

TARGETS = ("wq", "wk", "wv", "wo", "wgate", "wup", "wdown")
EXPERT_TARGETS = ("wgate_exps", "wup_exps", "wdown_exps")  # one 2-D weight per expert in a 3-D tensor
MOE_TARGETS = ("wrouter", *EXPERT_TARGETS)
ALL_TARGETS = TARGETS + MOE_TARGETS


@dataclass(frozen=True)
class TargetSlot:
    """One logical target: rows [start, stop) of a physical tensor, and the bias over the same rows if any."""

    tensor: str
    rows: tuple[int, int]
    tensor_rows: int  # rows of the whole physical tensor
    bias: Optional[str] = None

    @property
    def fused(self) -> bool:
        return self.rows != (0, self.tensor_rows)

    @property
    def row_slice(self) -> Optional[slice]:
        return slice(*self.rows) if self.fused else None


@dataclass
class BlockLayout:
    targets: dict[str, TargetSlot]  # 2-D targets: attention, and the dense MLP or the MoE router
    norms: dict[str, str]  # role (attn_norm, ffn_norm, attn_q_norm, ...) -> tensor name
    # MoE blocks: expert target -> its 3-D tensor `[n_expert, n_out, n_in]` (rows: one expert's n_out)
    experts: dict[str, TargetSlot] = field(default_factory=dict)
    sinks: Optional[str] = None  # attention sink logits `[n_head]` (gpt-oss)


@dataclass
class Layout:
    token_embd: str
    output: str  # output.weight, or token_embd.weight when the output is tied
    output_norm: str
    output_bias: Optional[str]
    rope_freqs: Optional[str]  # llama-3 style frequency factors
    rope_factors_long: Optional[str]  # Phi-3 LongRoPE
    rope_factors_short: Optional[str]
    n_vocab: int
    blocks: list[BlockLayout] = field(default_factory=list)

    @property
    def tied_output(self) -> bool:
        return self.output == self.token_embd


class _Tensors:
    """The file's tensor table, with checked lookups and a record of what was used."""

    def __init__(self, gguf):
        self.path = gguf.path
        self.infos = gguf.tensors
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.infos

    def need(self, name: str, shape: tuple[int, ...], what: str) -> str:
        info = self.infos.get(name)
        if info is None:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} is missing: expected {what}, shape {shape}")
        return self.check(name, shape, what)

    def optional(self, name: str, shape: tuple[int, ...], what: str) -> Optional[str]:
        return self.check(name, shape, what) if name in self.infos else None

    def check(self, name: str, shape: tuple[int, ...], what: str) -> str:
        got = tuple(self.infos[name].shape)
        if got != tuple(shape):
            raise GGUFFormatError(
                f"{self.path}: tensor {name!r} has shape {got}, expected {tuple(shape)} ({what}, from the metadata)"
            )
        self.used.add(name)
        return name


def _attention_slots(t: _Tensors, args: ModelArgs, p: str) -> dict[str, TargetSlot]:
    d, q, kv, v = args.n_embd, args.q_dim, args.kv_dim, args.v_dim
    slots: dict[str, TargetSlot] = {}
    if t.has(f"{p}attn_qkv.weight"):
        total = q + kv + v
        name = t.need(f"{p}attn_qkv.weight", (total, d), "fused Q‖K‖V")
        bias = t.optional(f"{p}attn_qkv.bias", (total,), "fused Q‖K‖V bias")
        for target, lo, hi in (("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, total)):
            slots[target] = TargetSlot(name, (lo, hi), total, bias)
    else:
        for target, part, rows in (("wq", "attn_q", q), ("wk", "attn_k", kv), ("wv", "attn_v", v)):
            name = t.need(f"{p}{part}.weight", (rows, d), f"{target} (or a fused {p}attn_qkv.weight)")
            slots[target] = TargetSlot(name, (0, rows), rows, t.optional(f"{p}{part}.bias", (rows,), f"{target} bias"))
    name = t.need(f"{p}attn_output.weight", (d, args.n_head * args.head_dim_v), "wo")
    slots["wo"] = TargetSlot(name, (0, d), d, t.optional(f"{p}attn_output.bias", (d,), "wo bias"))
    return slots


def _mlp_slots(t: _Tensors, args: ModelArgs, p: str) -> dict[str, TargetSlot]:
    d, ff = args.n_embd, args.n_ff
    slots: dict[str, TargetSlot] = {}
    if t.has(f"{p}ffn_gate.weight"):
        for target, part in (("wgate", "ffn_gate"), ("wup", "ffn_up")):
            name = t.need(f"{p}{part}.weight", (ff, d), target)
            slots[target] = TargetSlot(name, (0, ff), ff, t.optional(f"{p}{part}.bias", (ff,), f"{target} bias"))
    else:
        name = t.need(f"{p}ffn_up.weight", (2 * ff, d), f"fused gate‖up (no {p}ffn_gate.weight in the file)")
        bias = t.optional(f"{p}ffn_up.bias", (2 * ff,), "fused gate‖up bias")
        slots["wgate"] = TargetSlot(name, (0, ff), 2 * ff, bias)
        slots["wup"] = TargetSlot(name, (ff, 2 * ff), 2 * ff, bias)
    name = t.need(f"{p}ffn_down.weight", (d, ff), "wdown")
    slots["wdown"] = TargetSlot(name, (0, d), d, t.optional(f"{p}ffn_down.bias", (d,), "wdown bias"))
    return slots


def _moe_slots(
    t: _Tensors, args: ModelArgs, p: str, spec: ArchSpec
) -> tuple[dict[str, TargetSlot], dict[str, TargetSlot]]:
    """The router (a 2-D target) and the experts' 3-D tensors of a mixture-of-experts block (with their per-expert
    biases `[n_expert, n_out]` where the architecture has them)."""
    d, ff, n = args.n_embd, args.n_ff_exp, args.n_expert
    router = t.need(f"{p}ffn_gate_inp.weight", (n, d), "wrouter (expert_count rows)")
    router_bias = t.optional(f"{p}ffn_gate_inp.bias", (n,), "wrouter bias")
    experts = {}
    for target, part, shape in (
        ("wgate_exps", "ffn_gate_exps", (n, ff, d)),
        ("wup_exps", "ffn_up_exps", (n, ff, d)),
        ("wdown_exps", "ffn_down_exps", (n, d, ff)),
    ):
        name = t.need(f"{p}{part}.weight", shape, f"{target} (expert_count x n_out x n_in)")
        bias_shape = (n, shape[1])
        bias: Optional[str]
        if spec.expert_activation == "swiglu_oai":  # gpt-oss: llama.cpp requires the experts' biases
            bias = t.need(f"{p}{part}.bias", bias_shape, f"{target} bias (expert_count x n_out)")
        else:
            bias = t.optional(f"{p}{part}.bias", bias_shape, f"{target} bias (expert_count x n_out)")
        experts[target] = TargetSlot(name, (0, shape[1]), shape[1], bias)
    return {"wrouter": TargetSlot(router, (0, n), n, router_bias)}, experts


def resolve_layout(gguf, args: ModelArgs, spec: ArchSpec) -> Layout:
    t = _Tensors(gguf)
    if not t.has("token_embd.weight"):
        raise GGUFFormatError(f"{gguf.path}: tensor 'token_embd.weight' is missing: expected (n_vocab, {args.n_embd})")
    n_vocab = gguf.tensors["token_embd.weight"].shape[0]
    declared = gguf.metadata.get(f"{args.architecture}.vocab_size", n_vocab)
    if declared != n_vocab:
        raise GGUFFormatError(
            f"{gguf.path}: tensor 'token_embd.weight' has {n_vocab} rows, expected {declared} "
            f"(metadata {args.architecture}.vocab_size)"
        )
    token_embd = t.need("token_embd.weight", (n_vocab, args.n_embd), "token embeddings")
    output = t.optional("output.weight", (n_vocab, args.n_embd), "output projection") or token_embd
    half_rot = (args.rope_dim // 2,)
    layout = Layout(
        token_embd=token_embd,
        output=output,
        output_norm=t.need("output_norm.weight", (args.n_embd,), "final norm"),
        output_bias=t.optional("output.bias", (n_vocab,), "output bias"),
        rope_freqs=t.optional("rope_freqs.weight", half_rot, "RoPE frequency factors"),
        rope_factors_long=t.optional("rope_factors_long.weight", half_rot, "LongRoPE long factors"),
        rope_factors_short=t.optional("rope_factors_short.weight", half_rot, "LongRoPE short factors"),
        n_vocab=n_vocab,
    )
    norm_roles = ["attn_norm", "ffn_norm"]
    if spec.qk_norm:
        norm_roles += ["attn_q_norm", "attn_k_norm"]
    if spec.sandwich_norms:
        norm_roles += ["post_attention_norm", "post_ffw_norm"]
    for il in range(args.n_layer):
        p = f"blk.{il}."
        experts: dict[str, TargetSlot] = {}
        if args.n_expert:
            ffn, experts = _moe_slots(t, args, p, spec)
        else:
            ffn = _mlp_slots(t, args, p)
        targets = {**_attention_slots(t, args, p), **ffn}
        for target in spec.required_biases:
            if targets[target].bias is None:
                raise GGUFFormatError(
                    f"{gguf.path}: tensor '{targets[target].tensor[: -len('weight')]}bias' is "
                    f"missing: {args.architecture} requires a bias on {target}"
                )
        norms = {}
        for role in norm_roles:
            size = args.head_dim if role in ("attn_q_norm", "attn_k_norm") else args.n_embd
            tensor = spec.ffn_norm_tensor if role == "ffn_norm" else role
            norms[role] = t.need(f"{p}{tensor}.weight", (size,), f"{role} of block {il}")
        sinks = None
        if spec.attn_sinks:
            sinks = t.need(f"{p}attn_sinks.weight", (args.n_head,), f"attention sinks of block {il} (one per head)")
        ordered = {k: targets[k] for k in ALL_TARGETS if k in targets}
        layout.blocks.append(BlockLayout(targets=ordered, norms=norms, experts=experts, sinks=sinks))
    leftover = sorted(set(gguf.tensors) - t.used)
    if leftover:
        more = f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else ""
        raise GGUFFormatError(
            f"{gguf.path}: tensor {leftover[0]!r}{more} is not used by the {args.architecture} "
            f"architecture with {args.n_layer} blocks: unsupported variant or inconsistent metadata"
        )
    return layout
