"""Merging adapters (or dense deltas) into standalone GGUFs, with requantization and a per-tensor retention report.

- `merge_model(base, output, adapters=[...], deltas={...}, requant="source"|"auto"|TYPE)` → `MergeReport`
- `merge_trained(dense_targets, base, output, requant=...)`: the same for what `juno-py full` trained
"""

from juno_py.merge.merge import PROVENANCE_KEY, merge_model, merge_trained
from juno_py.merge.report import MergeReport, TensorReport
from juno_py.merge.requant import ladder, parse_requant
from juno_py.merge.targets import MergeError

__all__ = [
    "merge_model",
    "merge_trained",
    "MergeReport",
    "TensorReport",
    "MergeError",
    "PROVENANCE_KEY",
    "ladder",
    "parse_requant",
]
