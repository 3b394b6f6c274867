"""Typed metrics events, their JSONL stream, and the `metrics.json` summary (count, mean, last, p95 per series).

An event is a kind (`train_step`, `validation`, `norm_refresh`, `checkpoint`, `playback`, `merge`, `galore`,
`expert_load`, `threads`) plus identity fields shared by a whole run and the numbers of that moment.
`MetricsRecorder` turns every numeric field of every event into a series named `<kind>.<field>`; a series that never
received a value reports 0.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from juno_py.atomic import atomic_output

EVENT_KINDS = (
    "train_step",
    "validation",
    "norm_refresh",
    "checkpoint",
    "playback",
    "merge",
    "galore",
    "expert_load",
    "threads",
)

# series every summary carries, so consumers can rely on them (0 when the run produced none)
STANDARD_SERIES = (
    "train_step.loss",
    "train_step.grad_norm",
    "train_step.tokens",
    "train_step.lr_a",
    "train_step.lr_b",
    "train_step.forward_ms",
    "train_step.backward_ms",
    "train_step.optimizer_ms",
    "validation.loss",
)


@dataclass
class Identity:
    """What a run is: attached to every event."""

    algorithm: str = "lora"
    scaling: str = "standard"
    init: str = "kaiming-uniform"
    architecture: str = ""
    device: str = "cpu"
    rank: int = 0
    alpha: float = 0.0
    targets: str = ""


@dataclass
class Event:
    kind: str
    values: dict[str, Any]
    time: float = field(default_factory=time.time)

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown metrics event kind {self.kind!r}: expected one of {', '.join(EVENT_KINDS)}")


def _p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(0.95 * len(s)) - 1))]


class MetricsRecorder:
    """Keeps every event and its numeric series; `events_out` appends each as a JSON line; each of `sinks` (a
    callable `(kind, values)`, with `close()` if it has one) sees each event too (`--report-to tensorboard`)."""

    def __init__(
        self, identity: Optional[Identity] = None, events_out: Optional[Path] = None, sinks: Sequence[Any] = ()
    ):
        self.identity = identity or Identity()
        self.series: dict[str, list[float]] = {}
        self.events: list[Event] = []
        self.sinks = list(sinks)
        self._events_file = open(events_out, "a", encoding="utf-8") if events_out else None

    def emit(self, kind: str, **values: Any) -> Event:
        ev = Event(kind, values)
        self.events.append(ev)
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v):
                self.series.setdefault(f"{kind}.{k}", []).append(float(v))
        if self._events_file is not None:
            record = {"kind": kind, "time": ev.time, **self.identity.__dict__, **values}
            self._events_file.write(json.dumps(record, default=str) + "\n")
            self._events_file.flush()
        for sink in self.sinks:
            sink(kind, values)
        return ev

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"identity": dict(self.identity.__dict__), "series": {}}
        for name in sorted(set(STANDARD_SERIES) | set(self.series)):
            vals = self.series.get(name, [])
            out["series"][name] = {
                "count": len(vals),
                "mean": sum(vals) / len(vals) if vals else 0.0,
                "last": vals[-1] if vals else 0.0,
                "p95": _p95(vals) if vals else 0.0,
            }
        return out

    def write_summary(self, path) -> Path:
        with atomic_output(path, "w") as f:
            json.dump(self.summary(), f, indent=2)
        return Path(path)

    def close(self) -> None:
        if self._events_file is not None:
            self._events_file.close()
            self._events_file = None
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close()
        self.sinks = []


# ------------------------------------------------------------------------------------------------ memory
def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
