"""Merging adapters (or dense deltas) into standalone GGUFs, with requantization and a per-tensor retention report.

- `merge_model(base, output, adapters=[...], deltas={...}, requant="source"|"auto"|TYPE)` → `MergeReport`
"""

from juno_py.merge.merge import PROVENANCE_KEY, merge_model
from juno_py.merge.report import MergeReport, TensorReport
from juno_py.merge.requant import ladder, parse_requant
from juno_py.merge.targets import MergeError

__all__ = ["merge_model", "MergeReport", "TensorReport", "MergeError", "PROVENANCE_KEY", "ladder", "parse_requant"]
