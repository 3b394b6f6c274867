"""Re-encoding a patched tensor: the requant policies (`source`, a forced type, `auto`), the ladder of types
`auto` climbs, block-preserving encoding, and the numbers the report gives per encoding.

Keeping the source type re-encodes only the blocks whose values changed and keeps every other block's bytes:
llama.cpp's quantizer is not idempotent on dequantized k-quant data, so encoding an unchanged block again could
change it. A different output type re-encodes the whole tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

from juno_py.errors import show
from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType, type_name
from juno_py.gguf.quants.iquants import I_LAYOUTS
from juno_py.gguf.quants.kquants import K_LAYOUTS
from juno_py.gguf.quants.registry import bits_per_weight
from juno_py.gguf.quants.simple import LEGACY_LAYOUTS
from juno_py.merge.targets import MergeError, RowPatch

Policy = Union[str, GGMLType]  # "source", "auto" or a forced type

# rows of float32 weights handled at once: bounds the merge's working memory for very large tensors
CHUNK_BYTES = 64 << 20

# kept when they are a tensor's own type, but never climbed to: F16 holds weights more precisely than BF16, the
# ternary types hold only ternary weights, and MXFP4's power-of-two scales lose to IQ4_XS at the same size
_NOT_CLIMBED = {GGMLType.BF16, GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4}
_K_QUANTS = {layout.ggml_type for layout in K_LAYOUTS}
_IQ4 = {layout.ggml_type for layout in I_LAYOUTS}


def _encodable() -> list[GGMLType]:
    return [GGMLType[name] for name in quants.quantizable_types()]


def _order(t: GGMLType) -> tuple[float, int]:
    # by size; at equal size the k-quant (finer scales) ranks above the non-linear IQ4 type, which ranks above the
    # legacy type (a searched scale on a non-linear grid)
    return bits_per_weight(t), 2 if t in _K_QUANTS else int(t in _IQ4)


def ladder(start: int, n_cols: int) -> list[GGMLType]:
    """The types `auto` tries for a tensor of `start` type with rows of `n_cols`, smallest first: `start` itself
    when we can encode it, then every larger encodable type whose block divides the row (k-quants need rows that
    are a multiple of 256), up to F32. A type we cannot encode (IQ1-IQ3) starts at the nearest one we can that is at
    least as large."""
    start = GGMLType(start)
    fits = [t for t in _encodable() if n_cols % GGML_BLOCK_SIZES[t][0] == 0]
    climb = sorted((t for t in fits if t not in _NOT_CLIMBED), key=_order)
    if start in fits:
        return [start] + [t for t in climb if _order(t) > _order(start)]
    return [t for t in climb if bits_per_weight(t) >= bits_per_weight(start)]


def parse_requant(spec: Union[str, GGMLType]) -> Policy:
    """'source' | 'auto' | a GGML type name we can encode (case-insensitive)."""
    if isinstance(spec, GGMLType):
        value = spec
    else:
        text = str(spec).strip().lower()
        if text in ("source", "auto"):
            return text
        try:
            value = GGMLType[text.upper()]
        except KeyError:
            raise MergeError(
                f"--requant {show(spec)}: expected source, auto or a GGML type name "
                f"({', '.join(t.lower() for t in quants.quantizable_types())})"
            ) from None
    if value not in _encodable():
        raise MergeError(
            f"--requant {type_name(value).lower()}: juno-py cannot encode this type; encodable types are "
            f"{', '.join(t.lower() for t in quants.quantizable_types())}"
        )
    return value


def candidate_types(policy: Policy, source_type: int, n_cols: int) -> list[GGMLType]:
    if policy == "auto":
        return ladder(source_type, n_cols)
    first = source_type if policy == "source" else policy
    return ladder(first, n_cols)[:1]  # the type itself, or the nearest that fits the row / that we can encode


# --------------------------------------------------------------------------------------------- extreme codes
def _code_table():
    """type → (function raw blocks → integer codes, lowest code, highest code)."""
    table = {}
    for layout in list(LEGACY_LAYOUTS.values()) + list(K_LAYOUTS) + list(I_LAYOUTS):
        if layout.lookup is not None:
            lo, hi = int(layout.lookup.min()), int(layout.lookup.max())
        else:
            bits = layout.low.bits + (layout.high.bits if layout.high is not None else 0)
            lo, hi = -layout.code_offset, (1 << bits) - 1 - layout.code_offset
        table[layout.ggml_type] = (layout.codes, lo, hi)
    # Q8_0: int8 codes after the fp16 scale; llama.cpp's encoder uses −127..127
    table[GGMLType.Q8_0] = (lambda blocks: blocks[:, 2:].view(torch.int8), -127, 127)
    return table


_CODES = _code_table()


def extreme_code_count(ggml_type: int, raw: np.ndarray) -> Optional[tuple[int, int]]:
    """(values at the lowest or highest code of their type, values) of encoded bytes; None for float types."""
    entry = _CODES.get(int(ggml_type))
    if entry is None:
        return None
    fn, lo, hi = entry
    _, size = GGML_BLOCK_SIZES[ggml_type]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, size))
    codes = fn(blocks).to(torch.int16)
    return int(((codes <= lo) | (codes >= hi)).sum()), int(codes.numel())


# ------------------------------------------------------------------------------------------------- encoding
@dataclass
class Encoding:
    """One candidate encoding of a patched tensor and what it did to the target values."""

    ggml_type: GGMLType
    raw: np.ndarray  # uint8 [rows, bytes per row]
    n_values: int = 0
    delta_sq: float = 0.0  # Σ (W* − W0)²
    error_sq: float = 0.0  # Σ (W* − Ŵ)²
    max_abs_error: float = 0.0
    blocks_reencoded: int = 0  # blocks passed through the encoder
    blocks_rewritten: int = 0  # blocks whose bytes differ from the source's (all of them when the type changed)
    blocks_total: int = 0
    extreme: Optional[tuple[int, int]] = None

    @property
    def delta_norm(self) -> float:
        return math.sqrt(self.delta_sq)

    @property
    def rmse(self) -> float:
        return math.sqrt(self.error_sq / self.n_values) if self.n_values else 0.0

    @property
    def retention(self) -> float:
        """1 − ‖Δtarget − Δretained‖ / ‖Δtarget‖, with Δtarget − Δretained = W* − Ŵ; 1 for a zero delta."""
        return 1.0 - math.sqrt(self.error_sq) / self.delta_norm if self.delta_sq > 0 else 1.0

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def extreme_fraction(self) -> Optional[float]:
        return self.extreme[0] / self.extreme[1] if self.extreme and self.extreme[1] else None


def _row_chunks(n_rows: int, n_cols: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // (4 * max(n_cols, 1)))
    return [(lo, min(lo + step, n_rows)) for lo in range(0, n_rows, step)]


def _target_chunk(w0: torch.Tensor, lo: int, hi: int, patches: Sequence[RowPatch]) -> Optional[torch.Tensor]:
    """W* (float64) of rows [lo, hi), or None when no patch touches them."""
    out = None
    for p in patches:
        a, b = max(lo, p.rows[0]), min(hi, p.rows[1])
        if a >= b:
            continue
        if out is None:
            out = w0.double()
        out[a - lo : b - lo] = p.target_rows(w0[a - lo : b - lo], a, b)
    return out


class TensorValues:
    """Per chunk of rows of one tensor: (lo, hi, base values W0 float32, target W* float64 or None where no patch
    touches the rows). A tensor of one chunk keeps them, so that `auto`'s candidates share one computation."""

    def __init__(self, info, patches: Sequence[RowPatch]):
        self.info, self.patches = info, patches
        self.chunks = _row_chunks(info.n_rows, info.n_cols)
        self._kept: Optional[list] = None

    def __iter__(self):
        if self._kept is not None:
            yield from self._kept
            return
        raw = self.info.raw.reshape(self.info.n_rows, -1)
        for lo, hi in self.chunks:
            w0 = quants.dequantize(self.info.ggml_type, raw[lo:hi], self.info.n_cols, what=self.info.name)
            item = (lo, hi, w0, _target_chunk(w0, lo, hi, self.patches))
            if len(self.chunks) == 1:
                self._kept = [item]
            yield item


def encode(info, patches: Sequence[RowPatch], out_type: int, values: Optional[TensorValues] = None) -> Encoding:
    """Encode W* of one tensor (`info`: a `TensorInfo`) as `out_type`, chunk by chunk of rows.

    With the source's own type, only blocks whose float32 values changed go through the encoder; every other
    block keeps its bytes. Otherwise every block is encoded."""
    n_rows, n_cols = info.n_rows, info.n_cols
    keep = int(out_type) == int(info.ggml_type)
    codec = quants.get_codec(out_type, info.name, action="encode")
    src_raw = info.raw.reshape(n_rows, -1)
    enc = Encoding(GGMLType(out_type), np.empty((n_rows, codec.row_bytes(n_cols)), dtype=np.uint8))
    enc.n_values = n_rows * n_cols
    enc.blocks_total = enc.n_values // codec.block_size
    for lo, hi, w0, target in values or TensorValues(info, patches):
        out = enc.raw[lo:hi]
        if keep:
            out[...] = src_raw[lo:hi]
            if target is None:
                continue
            t32 = target.float()
            tb, wb = t32.view(-1, codec.block_size), w0.view(-1, codec.block_size)
            changed = (tb != wb).any(dim=1).nonzero().view(-1)
            out_blocks = torch.from_numpy(out.reshape(-1, codec.type_size))
            decoded = w0.clone()
            if len(changed):
                new = codec.quantize_blocks(tb.index_select(0, changed).contiguous())
                old = out_blocks.index_select(0, changed)
                out_blocks.index_copy_(0, changed, new)
                decoded.view(-1, codec.block_size).index_copy_(0, changed, codec.dequantize_blocks(new))
                enc.blocks_reencoded += len(changed)
                enc.blocks_rewritten += int((new != old).any(dim=1).sum())
        else:
            if target is None:
                target = w0.double()
            t32 = target.float()
            out[...] = quants.quantize(out_type, t32, what=info.name)
            decoded = quants.dequantize(out_type, out, n_cols, what=info.name)
            enc.blocks_reencoded += t32.numel() // codec.block_size
        err = target - decoded.double()
        enc.delta_sq += float((target - w0.double()).pow(2).sum())
        enc.error_sq += float(err.pow(2).sum())
        enc.max_abs_error = max(enc.max_abs_error, float(err.abs().max()) if err.numel() else 0.0)
    if not keep:
        enc.blocks_rewritten = enc.blocks_total
    return enc


@dataclass
class Choice:
    """The encoding a policy settled on, and every candidate the ladder tried on the way: (type, retention, bytes).

    `requested` is the type the policy asked for (the tensor's own under `source` and `auto`, the forced type
    otherwise); `reason` says why the written type differs from it (None when it does not), and `substituted`
    whether that is a substitution (a type juno-py cannot encode, or whose blocks do not fit the rows) rather than
    `auto` climbing for retention."""

    encoding: Encoding
    requested: str = ""
    tried: list[tuple[str, float, int]] = field(default_factory=list)
    source_retention: Optional[float] = None  # retention in the source type (auto; None if not tried)
    source_nbytes: int = 0  # bytes this tensor would take under `source`
    reason: Optional[str] = None
    substituted: bool = False
    climbed: bool = False  # the ladder was climbed for retention (auto, or a type juno-py cannot encode)


def _fits(t: int, n_cols: int) -> bool:
    return n_cols % GGML_BLOCK_SIZES[t][0] == 0


def choose_encoding(info, patches: Sequence[RowPatch], policy: Policy, min_retention: float = 0.9) -> Choice:
    """Encode one patched tensor under `policy`; `auto` stops at the first type meeting `min_retention`.

    A tensor whose own type juno-py cannot encode climbs the ladder under `source` too: the smallest encodable
    type, from the nearest one at least as large, whose retention meets `min_retention` (never a silent fixed
    substitute); the choice's `reason` says so."""
    source_type = GGMLType(info.ggml_type)
    requested = source_type if isinstance(policy, str) else GGMLType(policy)
    encodable = requested in _encodable()
    climb = policy == "auto" or (policy == "source" and not encodable)
    candidates = ladder(source_type, info.n_cols) if climb else candidate_types(policy, source_type, info.n_cols)
    if not candidates:
        raise MergeError(f"tensor {show(info.name)}: no encodable type fits its rows of {info.n_cols} values")
    source_first = candidate_types("source", source_type, info.n_cols)[0]
    values = TensorValues(info, patches)
    choice = None
    for t in candidates:
        enc = encode(info, patches, t, values)
        if choice is None:
            choice = Choice(enc, requested=requested.name, climbed=climb)
        choice.encoding = enc
        choice.tried.append((t.name, enc.retention, enc.nbytes))
        if t == source_first:
            choice.source_retention = enc.retention
        if not climb or enc.retention >= min_retention:
            break
    if source_type in _encodable() or policy not in ("source", "auto"):
        # a forced type over a type we cannot encode: `source` would climb; its first rung stands in for it
        choice.source_nbytes = info.n_rows * quants.get_codec(source_first).row_bytes(info.n_cols)
    else:
        choice.source_nbytes = choice.encoding.nbytes  # `source` climbs the same ladder to the same target
    choice.encoding.extreme = extreme_code_count(choice.encoding.ggml_type, choice.encoding.raw)
    choice.reason, choice.substituted = _reason(choice, requested, encodable, info.n_cols, min_retention)
    return choice


def _reason(
    choice: Choice, requested: GGMLType, encodable: bool, n_cols: int, min_retention: float
) -> tuple[Optional[str], bool]:
    written = choice.encoding.ggml_type
    if written == requested:
        return None, False
    climbed = ""
    if choice.climbed:
        met = choice.encoding.retention >= min_retention
        climbed = (
            f"the smallest type of the ladder from it whose retention reaches {min_retention:g}"
            if met
            else f"no type of the ladder reaches retention {min_retention:g}: the last one tried"
        )
    if not encodable:
        return f"juno-py cannot encode {requested.name}; wrote {climbed}", True
    if not _fits(requested, n_cols):
        block = GGML_BLOCK_SIZES[requested][0]
        return (
            f"{requested.name} blocks of {block} values do not divide rows of {n_cols}; wrote the nearest type "
            f"that fits",
            True,
        )
    first = choice.tried[0]
    return f"retention {first[1]:.4f} in {first[0]} is below {min_retention:g}; wrote {climbed}", False
