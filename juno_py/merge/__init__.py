"""Merging adapters (or dense deltas) into standalone GGUFs with a per-tensor report, and the exchange of
adapters with PEFT and llama.cpp (GGUF-LoRA): export and import.

- `merge_model(base, output, adapters=[...], deltas={...}, requant="source"|"auto"|TYPE)` → `MergeReport`
- `export_peft(base, adapter, folder)` / `import_peft(base, folder, adapter_out)`
- `export_gguf_lora(base, adapter, file)` / `import_gguf_lora(base, file, adapter_out)`
"""

from juno_py.merge.gguf_lora import export_gguf_lora, import_gguf_lora
from juno_py.merge.merge import PROVENANCE_KEY, merge_model
from juno_py.merge.peft import export_peft, import_peft
from juno_py.merge.report import MergeReport, TensorReport
from juno_py.merge.requant import ladder, parse_requant
from juno_py.merge.targets import MergeError

__all__ = ["merge_model", "MergeReport", "TensorReport", "MergeError", "PROVENANCE_KEY", "ladder", "parse_requant",
           "export_peft", "import_peft", "export_gguf_lora", "import_gguf_lora"]
