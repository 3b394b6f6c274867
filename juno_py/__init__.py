"""juno-py: LoRA and DoRA training on quantized GGUF bases."""

__version__ = "0.1.0"
