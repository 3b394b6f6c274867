"""The exchange of adapters with PEFT (transformers) and llama.cpp (GGUF-LoRA): export and import.

- `export_peft(base, adapter, folder)` / `import_peft(base, folder, adapter_out)`
- `export_gguf_lora(base, adapter, file)` / `import_gguf_lora(base, file, adapter_out)`
"""

from juno_py.exchange.gguf_lora import export_gguf_lora, import_gguf_lora
from juno_py.exchange.peft import export_peft, import_peft

__all__ = ["export_peft", "import_peft", "export_gguf_lora", "import_gguf_lora"]
