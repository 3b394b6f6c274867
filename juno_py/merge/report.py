"""The merge report: per patched tensor what the encoding kept of the delta, and a summary for the file.

Formulas (W0: the base values, W*: the target `W0 + ΔW`, Ŵ: what the output file decodes to):
`delta_norm = ‖W* − W0‖`, `rmse = sqrt(mean((W* − Ŵ)²))`, `max_abs_error = max |W* − Ŵ|`,
`retention = 1 − ‖Δtarget − Δretained‖ / ‖Δtarget‖` with `Δtarget = W* − W0`, `Δretained = Ŵ − W0`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from juno_py.atomic import atomic_output
from juno_py.metrics import format_bytes


@dataclass
class TensorReport:
    name: str
    targets: list[str]  # the patched keys ('<layer>:<target>' or a tensor name)
    source_type: str
    output_type: str
    delta_norm: float
    rmse: float
    max_abs_error: float
    retention: float
    blocks_reencoded: int
    blocks_rewritten: int
    blocks_total: int
    extreme_fraction: Optional[float]  # share of values at the lowest or highest code (None for float types)
    extreme_fraction_base: Optional[float]
    bytes_base: int
    bytes_output: int
    bytes_source: int  # what `--requant source` would write for this tensor
    retention_source: Optional[float] = None  # auto: the retention in the source type
    tried: list = field(default_factory=list)  # auto: [type, retention, bytes] per candidate, in order
    requested_type: str = ""  # the type the policy asked for: the tensor's own under source/auto, else the forced one
    reason: Optional[str] = None  # why output_type differs from requested_type (None when it does not)
    substituted: bool = False  # the requested type could not be written (no encoder, or its blocks do not fit)


@dataclass
class MergeReport:
    base: str
    output: str
    requant: str
    min_retention: Optional[float]
    tensors: list[TensorReport] = field(default_factory=list)
    file_bytes_base: int = 0
    file_bytes_output: int = 0
    tensors_copied: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    evaluation: Optional[dict[str, Any]] = None  # --eval-data: perplexities and KL against playback

    # ------------------------------------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        ret = [t.retention for t in self.tensors]
        out_bytes = sum(t.bytes_output for t in self.tensors)
        src_bytes = sum(t.bytes_source for t in self.tensors)
        s = {
            "tensors_patched": len(self.tensors),
            "tensors_copied": self.tensors_copied,
            "retention_mean": sum(ret) / len(ret) if ret else 1.0,
            "retention_min": min(ret) if ret else 1.0,
            "tensors_below_target": sum(r < self.min_retention for r in ret) if self.min_retention is not None else 0,
            "tensors_substituted": sum(t.substituted for t in self.tensors),
            "blocks_rewritten": sum(t.blocks_rewritten for t in self.tensors),
            "file_bytes_base": self.file_bytes_base,
            "file_bytes_output": self.file_bytes_output,
            "size_ratio": self.file_bytes_output / self.file_bytes_base if self.file_bytes_base else 0.0,
            "patched_bytes_output": out_bytes,
            "patched_bytes_source": src_bytes,
            "size_cost_vs_source_bytes": out_bytes - src_bytes,
            "seconds": self.seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
        }
        if self.evaluation:
            s.update({f"eval_{k}": v for k, v in self.evaluation.items()})
        return s

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "output": self.output,
            "requant": self.requant,
            "min_retention": self.min_retention,
            "summary": self.summary(),
            "tensors": [asdict(t) for t in self.tensors],
        }

    def write_json(self, path) -> Path:
        with atomic_output(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return Path(path)

    def emit(self, recorder) -> None:
        """One `merge` metrics event carrying the summary's numbers."""
        recorder.emit(
            "merge",
            requant=self.requant,
            base=self.base,
            output=self.output,
            **{k: v for k, v in self.summary().items() if isinstance(v, (int, float))},
        )

    def auto_line(self) -> str:
        """`--requant auto`'s choice in one line: per source -> output type the tensor count, and for a group that
        climbed, the type below its choice whose retention missed the target (and the best retention there)."""
        groups: dict[tuple[str, str], list[TensorReport]] = {}
        for t in self.tensors:
            groups.setdefault((t.source_type, t.output_type), []).append(t)
        parts = []
        for (src, out), ts in sorted(groups.items(), key=lambda g: -len(g[1])):
            part = f"{len(ts)} {'tensor' if len(ts) == 1 else 'tensors'} {src} -> {out}"
            missed = [t.tried[-2] for t in ts if len(t.tried) >= 2]  # the last type rejected on the way up
            if missed:
                below = max({m[0] for m in missed}, key=lambda name: sum(m[0] == name for m in missed))
                best = max(m[1] for m in missed if m[0] == below)
                part += f" (retention below {self.min_retention:g} at {below}, best {best:.3f})"
            short = sum(t.retention < self.min_retention for t in ts) if self.min_retention is not None else 0
            if short:
                part += f" ({short} still below {self.min_retention:g}: no type of the ladder reaches it)"
            parts.append(part)
        return "auto: " + ", ".join(parts)

    # --------------------------------------------------------------------------------------------- table
    def table(self) -> str:
        head = ("tensor", "type", "|ΔW|", "rmse", "max err", "retention", "blocks", "extreme")
        rows = []
        for t in self.tensors:
            kind = t.source_type if t.source_type == t.output_type else f"{t.source_type}->{t.output_type}"
            ext = "-" if t.extreme_fraction is None else f"{100 * t.extreme_fraction:.2f}%"
            rows.append(
                (
                    t.name,
                    kind,
                    f"{t.delta_norm:.4g}",
                    f"{t.rmse:.3g}",
                    f"{t.max_abs_error:.3g}",
                    f"{t.retention:.4f}",
                    f"{t.blocks_rewritten}/{t.blocks_total}",
                    ext,
                )
            )
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in [head] + rows
        ]
        for t in self.tensors:
            if t.substituted:
                lines.append(f"{t.name}: asked {t.requested_type}, wrote {t.output_type}: {t.reason}")
        s = self.summary()
        below = f" ({s['tensors_below_target']} below {self.min_retention})" if s["tensors_below_target"] else ""
        lines.append(
            f"{s['tensors_patched']} tensors patched, {s['tensors_copied']} copied; retention mean "
            f"{s['retention_mean']:.4f}, min {s['retention_min']:.4f}{below}"
        )
        if self.requant == "auto" and self.tensors:
            lines.append(self.auto_line())
        cost = s["size_cost_vs_source_bytes"]
        lines.append(
            f"size {format_bytes(s['file_bytes_output'])} vs base {format_bytes(s['file_bytes_base'])} "
            f"({100 * (s['size_ratio'] - 1):+.2f}%); patched tensors {format_bytes(s['patched_bytes_output'])}"
            f", {'+' if cost >= 0 else '-'}{format_bytes(abs(cost))} against --requant source"
        )
        if self.evaluation:
            e = self.evaluation
            lines.append(
                f"eval on {e['tokens']} tokens: perplexity merged {e['ppl_merged']:.4f}, playback "
                f"{e['ppl_playback']:.4f} ({100 * (e['ppl_merged'] / e['ppl_playback'] - 1):+.3f}%), "
                f"mean KL(playback || merged) {e['kl_mean']:.3g}"
            )
        return "\n".join(lines)
