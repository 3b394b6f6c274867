"""Test and benchmark material shipped with the package: tiny GGUF model writers, random valid quantized blocks,
synthetic real-shape models and small record sets.

Importing these modules needs only juno-py's own dependencies; `tiny_models.hf_tiny_model` and
`tiny_models.transformers_logits` import transformers when called, `ggml_reference.load_ggml` needs llama.cpp's
library (llama-cpp-python or $GGML_BASE_LIB).

- `tiny_models`: tiny random-weight models of every architecture, converted as llama.cpp's converter does.
- `blocks`: random valid blocks of every GGML type (`random_rows`) and a GGUF of one layer per type.
- `synthetic`: llama-architecture models of real shapes (7B, SmolLM2-135M) from random valid blocks.
- `records`: a small mixed-format training set (`MIXED_RECORDS`) and `write_jsonl`.
- `ggml_reference`: llama.cpp's reference quantizer through ctypes.
"""
