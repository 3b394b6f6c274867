"""Architectures: block structure per `general.architecture`, the layout of logical targets over the file's
tensors, the forward pass, chunked loss and generation."""

from __future__ import annotations

from typing import Optional, Union

import torch

from juno_py.models.config import ARCHITECTURES, ArchSpec, ModelArgs
from juno_py.models.layout import TARGETS, Layout, TargetSlot, resolve_layout
from juno_py.models.loss import chunked_cross_entropy
from juno_py.models.model import KVCache, TargetRef, Transformer

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def load_model(
    path_or_store_name=None,
    device: Union[str, torch.device] = "cpu",
    adapters=None,
    weights_cache: str = "none",
    compute_dtype: Union[str, torch.dtype] = torch.float32,
    n_ctx: Optional[int] = None,
) -> Transformer:
    """A GGUF model (file path or model-store name; None: the default model) ready for `.logits(ids)` and
    `.tokenizer`; `adapters`: adapter.bin paths to play, each optionally `path:scale`.
    `weights_cache`: keep dequantized weights ("bf16", "fp32") or stream them ("none").
    `device="cuda"`: the quantized bytes move to the GPU and stay quantized there (Triton decodes them); with
    bf16 compute the activations run in bf16 there.
    `n_ctx`: the context length you intend to use (picks LongRoPE's long or short factors, as llama.cpp does)."""
    from juno_py.gguf import GGUFFile
    from juno_py.store import resolve_model

    if isinstance(compute_dtype, str):
        if compute_dtype.lower() not in _DTYPES:
            raise ValueError(f"compute_dtype is {compute_dtype!r}: expected fp32 or bf16")
        compute_dtype = _DTYPES[compute_dtype.lower()]
    gguf = GGUFFile(resolve_model(path_or_store_name))
    on_cpu = torch.device(device).type == "cpu"
    # on a GPU a resident cache is decoded there after the move (Transformer.place), never built on the CPU
    model = Transformer.from_gguf(
        gguf, weights_cache=weights_cache if on_cpu else "none", compute_dtype=compute_dtype, n_ctx=n_ctx
    )
    model = model.place(device, weights_cache).eval()
    if adapters:
        from juno_py.lora import load_adapters

        load_adapters(model, [adapters] if isinstance(adapters, str) else list(adapters))
    return model


__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "ModelArgs",
    "TARGETS",
    "Layout",
    "TargetSlot",
    "resolve_layout",
    "chunked_cross_entropy",
    "KVCache",
    "TargetRef",
    "Transformer",
    "load_model",
]
