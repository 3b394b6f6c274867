"""What the PEFT and GGUF-LoRA exchanges share: stacking several targets' adapters into one pair over a fused
module (A stacked, B block-diagonal over the targets' row ranges), the record that lets our importer undo the
stacking exactly, and the final checks and write of an imported adapter.

The record is a JSON string stored beside the tensors (safetensors metadata, a GGUF key); other tools ignore
it. Per exported pair it lists each part: its entry key, its rows of the pair's B, its rows of the stacked A,
alpha, scaling, init and the factor baked into its B (None when B is stored as trained).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from juno_py.atomic import atomic_write_bytes
from juno_py.errors import JunoError, one_line, show
from juno_py.lora.format import (
    MAX_ABS_ALPHA,
    MAX_ABS_VALUE,
    AdapterEntry,
    Init,
    Mode,
    Scaling,
    encode_adapter,
    parse_adapter,
    parse_key,
    sort_key,
)
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


def number(value: Any, where: str, what: str, limit: float) -> float:
    """A number read from a file (JSON, metadata): int or float but not bool, finite, |value| <= limit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MergeError(f"{where}: {what} is {show(value)} ({type(value).__name__}), expected a number")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not abs(x) <= limit:  # NaN fails too
        raise MergeError(f"{where}: {what} is {show(value)}, expected a finite number within +-{limit:g}")
    return x


def _index_pair(value: Any, where: str, what: str) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise MergeError(f"{where}: {what} is {show(value)}, expected a list of two integers [lo, hi]")
    return value[0], value[1]


def _member(cls, value: Any, where: str, what: str):
    names = [m.name.lower() for m in cls]
    if not isinstance(value, str) or value not in names:
        raise MergeError(f"{where}: {what} is {show(value)}, expected one of {', '.join(names)}")
    return cls[value.upper()]


def load_record(text: Any, where: str) -> dict[str, list[dict]]:
    """The groups of a record (module or tensor name -> list of part objects), or {} when there is none (a
    file from another tool, or another format's JSON under the key)."""
    if text is None or text == "":
        return {}
    problem = "is not a JSON string"
    if isinstance(text, str):
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
            raise MergeError(f"{where}: the juno-py parts record is not valid JSON ({one_line(str(e), 120)})") from None
        if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
            return {}
        groups = rec.get("groups")
        problem = f"field groups is {show(groups)}"
        if isinstance(groups, dict) and all(
            isinstance(parts, list) and all(isinstance(p, dict) for p in parts) for parts in groups.values()
        ):
            return groups
    raise MergeError(f"{where}: the juno-py parts record {problem}, expected an object of lists of part objects")


RowsOf = Callable[[int, str], Optional[tuple[int, int]]]


def split_by_record(
    records: list[dict], A: np.ndarray, B: np.ndarray, magnitude: Optional[np.ndarray], where: str, rows_of: RowsOf
):
    """Undo `stack_parts`: per record (key, A, B, magnitude, alpha, scaling, init, mode), rows in B's order.

    `rows_of(layer, target)` gives the rows of B that the entry owns, or None when the entry does not live in this
    pair: every part is checked against it, so a record that does not describe this pair is refused."""
    out = []
    for i, rec in enumerate(records):
        part = f"{where}: juno-py record part {i}"
        missing = [k for k in ("key", "rows", "cols", "alpha", "scaling", "init", "mode", "bake") if k not in rec]
        if missing:
            raise MergeError(f"{part}: field {missing[0]} is missing")
        key = rec["key"]
        try:
            layer, target = parse_key(key) if isinstance(key, str) else parse_key("")
        except ValueError:
            raise MergeError(f"{part}: key is {show(key)}, expected '<layer>:<target>' such as '0:wq'") from None
        part = f"{where}: juno-py record part {i} ({key})"
        (lo, hi), (c0, c1) = _index_pair(rec["rows"], part, "rows"), _index_pair(rec["cols"], part, "cols")
        alpha = number(rec["alpha"], part, "alpha", MAX_ABS_ALPHA)
        bake = rec["bake"]
        if bake is not None:
            bake = number(bake, part, "bake", MAX_ABS_ALPHA)
            if bake == 0:
                raise MergeError(f"{part}: bake is 0, expected a non-zero factor or null")
        scaling = _member(Scaling, rec["scaling"], part, "scaling")
        init = _member(Init, rec["init"], part, "init")
        mode = _member(Mode, rec["mode"], part, "mode")
        if mode not in (Mode.LORA, Mode.DORA) or (mode == Mode.DORA) != (magnitude is not None):
            has = "has" if magnitude is not None else "has no"
            raise MergeError(f"{part}: mode {mode.name.lower()} but the pair {has} DoRA magnitude")
        expected = rows_of(layer, target)
        if expected is None:
            raise MergeError(f"{part}: the entry does not live in this pair (an adapter for another model?)")
        if (lo, hi) != expected or not 0 <= c0 < c1 <= A.shape[0]:
            raise MergeError(
                f"{part}: rows {lo}..{hi}, columns {c0}..{c1}; expected rows {expected[0]}..{expected[1]} and "
                f"columns within the {A.shape[0]} of A {A.shape}"
            )
        b = B[lo:hi, c0:c1]
        if bake is not None:
            b = (b.astype(np.float64) / bake).astype(np.float32)
        mag = magnitude[lo:hi] if magnitude is not None else None
        out.append((key, np.ascontiguousarray(A[c0:c1]), np.ascontiguousarray(b), mag, alpha, scaling, init, mode))
    return out


def check_entry_values(e: AdapterEntry, where: str) -> None:
    """What adapter.bin's reader requires of an entry's numbers, with a message naming the source."""
    if not abs(e.alpha) <= MAX_ABS_ALPHA:
        raise MergeError(f"{where}: alpha {show(e.alpha)}, expected a finite number within +-{MAX_ABS_ALPHA:g}")
    if e.mode not in (Mode.LORA, Mode.DORA) or (e.mode == Mode.DORA) != (e.magnitude is not None):
        raise MergeError(f"{where}: mode {e.mode.name.lower()} with{'out' if e.magnitude is None else ''} a magnitude")
    if e.A.ndim != 2 or e.B.ndim != 2 or e.A.shape[0] < 1 or e.B.shape[1] != e.A.shape[0]:
        raise MergeError(f"{where}: A {e.A.shape} and B {e.B.shape}, expected (r, in) and (out, r) with r >= 1")
    if e.magnitude is not None and e.magnitude.shape != (e.B.shape[0],):
        raise MergeError(f"{where}: magnitude {e.magnitude.shape}, expected ({e.B.shape[0]},)")
    for field, x in (("A", e.A), ("B", e.B), ("magnitude", e.magnitude)):
        if x is not None and x.size and not float(np.abs(x).max()) <= MAX_ABS_VALUE:  # NaN fails too
            raise MergeError(
                f"{where}: {field} holds values beyond +-{MAX_ABS_VALUE:g} or not finite "
                f"(largest {float(np.abs(x).max()):g}); adapter.bin refuses them"
            )


def finish_import(targets: ModelTargets, entries: list[AdapterEntry], source, output) -> Path:
    """Give each entry its base fingerprint, check it fits the model, write adapter.bin (atomically). What is
    written is read back with adapter.bin's own reader first: an import never leaves a file that does not load."""
    from juno_py.merge.merge import check_output_path

    if not entries:
        raise MergeError(f"{source}: no adapter tensors found")
    check_output_path(Path(output), [Path(source)])
    seen = set()
    for e in entries:
        where = f"{source}: entry {show(e.key)}"
        if e.key in seen:
            raise MergeError(f"{where}: two adapters for it")
        seen.add(e.key)
        check_entry_values(e, where)
        slot = targets.slot(e.key, f"{where}: ")
        e.fingerprint = targets.fingerprint(slot.tensor)
        targets.check_entry(e, source)
    blob = encode_adapter(sorted(entries, key=lambda e: sort_key(e.key)))
    try:
        parse_adapter(blob, str(output))
    except JunoError as err:  # a check above is missing: say so rather than write a file that does not load
        raise MergeError(f"{source}: the imported adapter would not load: {err}") from None
    return atomic_write_bytes(output, blob)
