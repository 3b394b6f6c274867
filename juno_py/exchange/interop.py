"""What the PEFT and GGUF-LoRA exchanges share: stacking several targets' adapters into one pair over a fused
module (A stacked, B block-diagonal over the targets' row ranges), the record that lets our importer undo the
stacking exactly, and the final checks and write of an imported adapter.

The record is a JSON string stored beside the tensors (safetensors metadata, a GGUF key); other tools ignore
it. Per exported pair it lists each part: its entry key, its rows of the pair's B, its rows of the stacked A,
alpha, scaling, init and the factor baked into its B (None when B is stored as trained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from juno_py.lora.format import MAX_ABS_VALUE, AdapterEntry, Init, Mode, Scaling, sort_key, write_adapter
from juno_py.merge.targets import MergeError, ModelTargets

RECORD_FORMAT = "juno-py adapter parts"


@dataclass
class Part:
    """One entry inside an exported pair: rows [lo, hi) of the pair's B (its output rows)."""

    entry: AdapterEntry
    rows: tuple[int, int]
    B: np.ndarray  # the entry's B, in the exported row order
    magnitude: Optional[np.ndarray] = None  # DoRA m, in the exported row order


def stack_parts(parts: Sequence[Part], n_rows: int, factors: Sequence[Optional[float]]):
    """(A [R, n_in], B [n_rows, R], per part its columns (c0, c1)): A stacked, B block-diagonal, each B multiplied
    by its factor (None: stored as is)."""
    A = np.concatenate([np.asarray(p.entry.A, np.float32) for p in parts], axis=0)
    B = np.zeros((n_rows, A.shape[0]), dtype=np.float32)
    cols, c = [], 0
    for p, f in zip(parts, factors):
        r = p.entry.rank
        block = p.B if f is None else (p.B.astype(np.float64) * f).astype(np.float32)
        B[p.rows[0] : p.rows[1], c : c + r] = block
        cols.append((c, c + r))
        c += r
    return A, B, cols


def part_records(parts: Sequence[Part], cols, factors) -> list[dict]:
    return [
        {
            "key": p.entry.key,
            "rows": list(p.rows),
            "cols": list(c),
            "alpha": p.entry.alpha,
            "scaling": p.entry.scaling.name.lower(),
            "init": p.entry.init.name.lower(),
            "mode": p.entry.mode.name.lower(),
            "bake": f,
        }
        for p, c, f in zip(parts, cols, factors)
    ]


def dump_record(groups: dict[str, list[dict]]) -> str:
    return json.dumps({"format": RECORD_FORMAT, "version": 1, "groups": groups}, sort_keys=True)


def load_record(text: Optional[str], where: str) -> dict[str, list[dict]]:
    """The groups of a record, or {} when there is none (a file from another tool)."""
    if not text:
        return {}
    try:
        rec = json.loads(text)
        if rec.get("format") != RECORD_FORMAT:
            return {}
        return dict(rec["groups"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise MergeError(f"{where}: the juno-py parts record is not valid JSON of the expected form") from None


def split_by_record(records: list[dict], A: np.ndarray, B: np.ndarray, magnitude: Optional[np.ndarray], where: str):
    """Undo `stack_parts`: per record (key, A, B, magnitude, alpha, scaling, init, mode), rows in B's order."""
    out = []
    for rec in records:
        try:
            (lo, hi), (c0, c1) = rec["rows"], rec["cols"]
            key, alpha, bake = rec["key"], float(rec["alpha"]), rec["bake"]
            scaling, init, mode = Scaling[rec["scaling"].upper()], Init[rec["init"].upper()], Mode[rec["mode"].upper()]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise MergeError(f"{where}: a part of the juno-py record is malformed: {rec!r}") from None
        if not (0 <= lo < hi <= B.shape[0] and 0 <= c0 < c1 <= A.shape[0]):
            raise MergeError(
                f"{where}: record part {key!r} (rows {lo}..{hi}, columns {c0}..{c1}) lies outside "
                f"A {A.shape} / B {B.shape}"
            )
        b = B[lo:hi, c0:c1]
        if bake is not None:
            b = (b.astype(np.float64) / float(bake)).astype(np.float32)
        mag = magnitude[lo:hi] if magnitude is not None else None
        out.append((key, np.ascontiguousarray(A[c0:c1]), np.ascontiguousarray(b), mag, alpha, scaling, init, mode))
    return out


def finish_import(targets: ModelTargets, entries: list[AdapterEntry], source, output) -> Path:
    """Give each entry its base fingerprint, check it fits the model, write adapter.bin (atomically)."""
    from juno_py.merge.merge import check_output_path

    if not entries:
        raise MergeError(f"{source}: no adapter tensors found")
    check_output_path(Path(output), [Path(source)])
    seen = set()
    for e in entries:
        if e.key in seen:
            raise MergeError(f"{source}: two adapters for {e.key!r}")
        seen.add(e.key)
        for field, x in (("A", e.A), ("B", e.B), ("magnitude", e.magnitude)):
            if x is not None and x.size and not float(np.abs(x).max()) <= MAX_ABS_VALUE:  # NaN fails too
                raise MergeError(
                    f"{source}: entry {e.key!r}: {field} holds values beyond +-{MAX_ABS_VALUE:g} or not finite "
                    f"(largest {float(np.abs(x).max()):g}); adapter.bin refuses them"
                )
        slot = targets.slot(e.key, f"{source}: entry {e.key!r}: ")
        e.fingerprint = targets.fingerprint(slot.tensor)
        targets.check_entry(e, source)
    return write_adapter(output, sorted(entries, key=lambda e: sort_key(e.key)))
