"""juno-py: LoRA and DoRA training on quantized GGUF bases."""

__version__ = "0.1.0"


def load_model(path_or_store_name=None, device="cpu", adapters=None, **kwargs):
    """A GGUF model with `.tokenizer` and `.logits(token_ids)`; see `juno_py.models.load_model`."""
    from juno_py.models import load_model as _load_model

    return _load_model(path_or_store_name, device=device, adapters=adapters, **kwargs)
