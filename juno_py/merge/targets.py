"""Where adapter entries and dense deltas land in a base GGUF: the model's layout (read from the file's tensor
table and metadata, no weights loaded), the checks that an entry fits it, and the per-tensor plan of row ranges
to patch with their target values `W*`.

A `RowPatch` owns rows [lo, hi) of one physical tensor and computes `W*` for them from the dequantized base
rows `W0`: `W0 + Σ s·B·A + D` (LoRA terms, a dense delta D) or, for DoRA, `g ⊙ (W0 + s·B·A)` with
`g = m / max(‖W0 + s·B·A‖_row, 1e-6)`. Arithmetic is float64; the result is what the merge must encode.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from juno_py.errors import AdapterMismatch, JunoError, show
from juno_py.kernels.dora import DORA_EPS
from juno_py.lora.format import AdapterEntry, Fingerprint, Mode, parse_entry_key, parse_key, read_adapter, sort_key
from juno_py.models.config import ModelArgs, arch_spec
from juno_py.models.layout import TargetSlot, resolve_layout

DenseDelta = Union[torch.Tensor, np.ndarray, Callable[[], Union[torch.Tensor, np.ndarray]]]


class MergeError(JunoError, ValueError):
    """A merge, export or import that cannot proceed: bad arguments, paths or adapter files."""


@dataclass
class AdapterSource:
    """One adapter file and the weight it is merged with."""

    path: Path
    scale: float
    entries: list[AdapterEntry]

    @property
    def is_dora(self) -> bool:
        return any(e.mode == Mode.DORA for e in self.entries)


def read_sources(specs: Sequence[Union[str, Path, tuple]]) -> list[AdapterSource]:
    """'a.bin', 'a.bin:0.5' or (path, scale) → sources; a DoRA adapter merges alone and at scale 1 (as it plays)."""
    from juno_py.lora import parse_adapter_spec

    out = []
    for spec in specs:
        path, scale = parse_adapter_spec(str(spec)) if not isinstance(spec, tuple) else (str(spec[0]), float(spec[1]))
        _, entries = read_adapter(path)
        out.append(AdapterSource(Path(path), scale, entries))
    dora = [s for s in out if s.is_dora]
    if dora and (len(out) > 1 or dora[0].scale != 1.0):
        raise MergeError(
            f"{dora[0].path}: a DoRA adapter merges alone and at scale 1 (got {len(out)} adapter(s), "
            f"scales {[s.scale for s in out]})"
        )
    return out


class ModelTargets:
    """The logical targets of a base GGUF: tensor and rows of every `<layer>:<target>`, checks against them."""

    def __init__(self, gguf):
        self.gguf = gguf
        self.args = ModelArgs.from_gguf(gguf)
        self.spec = arch_spec(gguf.architecture, gguf.path)
        self.layout = resolve_layout(gguf, self.args, self.spec)
        self._fingerprints: dict[str, Fingerprint] = {}
        self.mismatches: list[tuple[str, str, str]] = []  # (file, entry key, tensor) of LoRA fingerprint mismatches

    @property
    def n_layer(self) -> int:
        return len(self.layout.blocks)

    def slot(self, key: str, where: str = "") -> TargetSlot:
        """The rows a key adapts. An expert's are its slice of the 3-D tensor viewed as `[n_expert·n_out, n_in]`
        rows; an every-expert key ('.*') covers all of them (one adapter, repeated per expert)."""
        try:
            layer, target, expert = parse_entry_key(key)
        except ValueError as e:
            raise AdapterMismatch(f"{where}{e}") from None
        if layer >= self.n_layer:
            raise AdapterMismatch(
                f"{where}layer {layer} does not exist: {self.gguf.path} has {self.n_layer} layers "
                f"(an adapter for another model?)"
            )
        bl = self.layout.blocks[layer]
        if target in bl.experts:
            s, n_expert = bl.experts[target], self.args.n_expert
            n_out = s.tensor_rows
            if expert is None:
                return TargetSlot(s.tensor, (0, n_expert * n_out), n_expert * n_out)
            if expert >= n_expert:
                raise AdapterMismatch(f"{where}expert {expert} does not exist: {self.gguf.path} has {n_expert} experts")
            return TargetSlot(s.tensor, (expert * n_out, (expert + 1) * n_out), n_expert * n_out)
        if target not in bl.targets:
            raise AdapterMismatch(
                f"{where}block {layer} of {self.gguf.path} has no {target} (its targets: "
                f"{', '.join([*bl.targets, *bl.experts])})"
            )
        return bl.targets[target]

    def experts_sharing(self, e: AdapterEntry) -> int:
        """How many experts an entry plays on with one adapter: n_expert for an every-expert key, else 1."""
        return self.args.n_expert if e.on_experts and e.expert is None else 1

    def fingerprint(self, tensor: str) -> Fingerprint:
        if tensor not in self._fingerprints:
            self._fingerprints[tensor] = Fingerprint.of_tensor(self.gguf.tensor(tensor))
        return self._fingerprints[tensor]

    def check_entry(self, e: AdapterEntry, path, force: bool = False) -> TargetSlot:
        """The slot an entry applies to, after checking its shape and (for DoRA, strictly) its fingerprint."""
        where = f"{path}: entry {show(e.key)}: "
        slot = self.slot(e.key, where)
        info = self.gguf.tensor(slot.tensor)
        n_out, n_in = (slot.rows[1] - slot.rows[0]) // self.experts_sharing(e), info.n_cols
        if self.experts_sharing(e) > 1 and e.mode == Mode.DORA:
            raise AdapterMismatch(f"{where}a DoRA adapter on every expert ('.*') has no single magnitude")
        if (e.in_dim, e.out_dim) != (n_in, n_out):
            raise AdapterMismatch(
                f"{where}shape in {e.in_dim} x out {e.out_dim} does not fit {slot.tensor} rows "
                f"{slot.rows[0]}..{slot.rows[1]} (in {n_in} x out {n_out}) of {self.gguf.path}: "
                f"an adapter for another model?"
            )
        if e.magnitude is not None and e.magnitude.shape != (n_out,):
            raise AdapterMismatch(f"{where}magnitude has {e.magnitude.size} values, expected {n_out}")
        if e.fingerprint is not None and e.fingerprint != self.fingerprint(slot.tensor):
            mine = self.fingerprint(slot.tensor)
            what = (
                f"{where}fingerprint differs from the base tensor {show(slot.tensor)} (type {e.fingerprint.ggml_type} "
                f"dims {e.fingerprint.dims} vs type {mine.ggml_type} dims {mine.dims}): trained on another base "
                f"or quantization"
            )
            if e.mode == Mode.DORA and not force:
                raise AdapterMismatch(what + "; a DoRA adapter's magnitude is tied to its base, refused (use --force)")
            self.mismatches.append((str(path), e.key, slot.tensor))
        return slot

    def warn_mismatches(self) -> None:
        """One warning for all entries whose fingerprint differs (a LoRA loads anyway, as in playback)."""
        if self.mismatches:
            path, key, tensor = self.mismatches[0]
            more = f" and {len(self.mismatches) - 1} more" if len(self.mismatches) > 1 else ""
            warnings.warn(
                f"{path}: entry {show(key)}{more}: fingerprint differs from the base tensor {show(tensor)} of "
                f"{self.gguf.path}: trained on another base or quantization",
                stacklevel=3,
            )
            self.mismatches.clear()

    def tensor_rows(self, name: str) -> int:
        return self.gguf.tensor(name).n_rows

    def slots_of_tensor(self, tensor: str) -> list[tuple[int, str, TargetSlot]]:
        """Every (layer, target, slot) living in a physical tensor, in row order."""
        out = [
            (il, t, s) for il, bl in enumerate(self.layout.blocks) for t, s in bl.targets.items() if s.tensor == tensor
        ]
        return sorted(out, key=lambda x: x[2].rows)


# ------------------------------------------------------------------------------------------------------ patches
@dataclass
class LoraTerm:
    A: np.ndarray  # [r, n_in]
    B: np.ndarray  # [n_out, r]
    scale: float  # s (alpha/r or alpha/sqrt r) times the adapter file's weight


@dataclass
class RowPatch:
    """What changes in rows [lo, hi) of one physical tensor."""

    key: str  # '<layer>:<target>' or the tensor name (a dense delta over the whole tensor)
    rows: tuple[int, int]
    loras: list[LoraTerm] = field(default_factory=list)
    magnitude: Optional[np.ndarray] = None  # DoRA: m [hi - lo]
    dense: Optional[DenseDelta] = None
    _dense_value: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    def _dense(self, n_cols: int) -> torch.Tensor:
        if self._dense_value is None:  # a callable is evaluated once per tensor, then `release()`d
            d = self.dense() if callable(self.dense) else self.dense
            d = d.detach() if isinstance(d, torch.Tensor) else torch.from_numpy(np.asarray(d))
            if d.numel() != self.n_rows * n_cols:
                raise MergeError(
                    f"dense delta {show(self.key)}: shape {tuple(d.shape)} does not fit rows "
                    f"{self.rows[0]}..{self.rows[1]} x {n_cols} columns"
                )
            self._dense_value = d.to("cpu", torch.float64).reshape(self.n_rows, n_cols)
        return self._dense_value

    def release(self) -> None:
        self._dense_value = None

    def delta_rows(self, lo: int, hi: int, n_cols: int) -> torch.Tensor:
        """The additive part Σ s·B·A + D for absolute rows [lo, hi) inside this patch, float64."""
        a, b = lo - self.rows[0], hi - self.rows[0]
        out = torch.zeros(hi - lo, n_cols, dtype=torch.float64)
        for t in self.loras:
            B = torch.from_numpy(t.B[a:b]).double()
            out.addmm_(B, torch.from_numpy(t.A).double(), alpha=t.scale)
        if self.dense is not None:
            out += self._dense(n_cols)[a:b]
        return out

    def target_rows(self, w0: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """W* for absolute rows [lo, hi) (within this patch) from their base values w0 `[hi-lo, n_cols]`, float64."""
        v = w0.double() + self.delta_rows(lo, hi, w0.shape[1])
        if self.magnitude is not None:
            m = torch.from_numpy(self.magnitude[lo - self.rows[0] : hi - self.rows[0]]).double()
            v *= (m / torch.linalg.vector_norm(v, dim=1).clamp_min(DORA_EPS)).unsqueeze(1)
        return v


def _as_key(name: str) -> Optional[tuple[int, str]]:
    try:
        return parse_key(name)
    except ValueError:
        return None


def plan_patches(
    targets: ModelTargets,
    sources: Sequence[AdapterSource] = (),
    deltas: Optional[Mapping[str, DenseDelta]] = None,
    force: bool = False,
) -> dict[str, list[RowPatch]]:
    """Physical tensor → its row patches (disjoint, in row order), from adapter files and dense deltas.

    Dense deltas are keyed by a tensor name (the whole tensor) or by '<layer>:<target>' (that target's rows).
    Several LoRA files on one target add up; a DoRA entry or a dense delta combines with nothing but LoRA terms
    (DoRA: with nothing at all)."""
    by_key: dict[tuple[str, tuple[int, int]], RowPatch] = {}

    def patch_for(tensor: str, rows: tuple[int, int], key: str) -> RowPatch:
        p = by_key.get((tensor, rows))
        if p is None:
            p = by_key[(tensor, rows)] = RowPatch(key, rows)
        return p

    for src in sources:
        for e in src.entries:
            slot = targets.check_entry(e, src.path, force)
            p = patch_for(slot.tensor, slot.rows, e.key)
            if e.mode == Mode.DORA:
                if p.loras or p.dense is not None:
                    raise MergeError(
                        f"{src.path}: entry {show(e.key)}: a DoRA entry cannot combine with other changes to the same rows"
                    )
                p.magnitude = np.asarray(e.magnitude, dtype=np.float32)
            elif p.magnitude is not None:
                raise MergeError(f"{src.path}: entry {show(e.key)}: the rows already carry a DoRA entry")
            B = np.asarray(e.B, np.float32)
            B = np.tile(B, (targets.experts_sharing(e), 1))  # an every-expert entry: the same B·A on each expert
            p.loras.append(LoraTerm(np.asarray(e.A, np.float32), B, e.scale * src.scale))
    for name, value in (deltas or {}).items():
        key = _as_key(name)
        if key is not None:
            slot = targets.slot(name, f"dense delta {show(name)}: ")
            tensor, rows = slot.tensor, slot.rows
        else:
            if name not in targets.gguf.tensors:
                raise MergeError(f"dense delta {show(name)}: tensor is missing from {targets.gguf.path}")
            tensor, rows = name, (0, targets.tensor_rows(name))
        p = patch_for(tensor, rows, name)
        if p.magnitude is not None or p.dense is not None:
            raise MergeError(
                f"dense delta {show(name)}: rows {rows[0]}..{rows[1]} of {tensor} already carry a DoRA "
                f"entry or another dense delta"
            )
        p.dense = value
    targets.warn_mismatches()
    plan: dict[str, list[RowPatch]] = {}
    for (tensor, _), p in by_key.items():
        plan.setdefault(tensor, []).append(p)
    for tensor, patches in plan.items():
        patches.sort(key=lambda p: p.rows)
        for a, b in zip(patches, patches[1:]):
            if b.rows[0] < a.rows[1]:
                raise MergeError(
                    f"{tensor}: changes to rows {a.rows[0]}..{a.rows[1]} ({a.key}) and {b.rows[0]}.."
                    f"{b.rows[1]} ({b.key}) overlap"
                )
    return plan


def entries_by_tensor(
    targets: ModelTargets, entries: Sequence[AdapterEntry], path, force: bool = False
) -> dict[str, list[tuple[AdapterEntry, TargetSlot]]]:
    """Entries grouped by the physical tensor they adapt (file order of tensors, row order within)."""
    grouped: dict[str, list[tuple[AdapterEntry, TargetSlot]]] = {}
    for e in sorted(entries, key=lambda e: sort_key(e.key)):
        slot = targets.check_entry(e, path, force)
        grouped.setdefault(slot.tensor, []).append((e, slot))
    targets.warn_mismatches()
    order = {name: i for i, name in enumerate(targets.gguf.tensors)}
    return {t: sorted(v, key=lambda es: es[1].rows) for t, v in sorted(grouped.items(), key=lambda kv: order[kv[0]])}
