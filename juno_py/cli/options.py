"""Options shared by the commands that open a model: where it is, how its weights are kept, its adapters."""

from __future__ import annotations

import functools

import click

from juno_py.store import DEFAULT_MODEL


def model_options(fn):
    @click.option("--model-path", default=DEFAULT_MODEL, show_default=True,
                  help="A .gguf file or a model-store name (pulled on first use).")
    @click.option("--lora-play", "lora_play", default=None,
                  help="Adapters to play: A[:scale][,B[:scale]] (LoRAs add up; a DoRA adapter plays alone at 1).")
    @click.option("--force", is_flag=True, help="Load a DoRA adapter whose base fingerprint differs.")
    @click.option("--weights-cache", type=click.Choice(["auto", "none", "bf16", "fp32"]), default="auto",
                  show_default=True,
                  help="Keep a dequantized copy of the weights (faster, more memory) or stream them from the "
                       "quantized file; auto keeps an fp32 copy when it takes under a quarter of free memory (on a "
                       "GPU: none, the bytes stay quantized there).")
    @click.option("--compute-dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
                  help="Matmul precision of the frozen weights (auto: fp32 on the CPU, bf16 on a GPU, where the "
                       "activations then run in bf16 too).")
    @click.option("--device", default="cpu", show_default=True,
                  help="Torch device; on cuda the weights stay quantized on the GPU (Triton decodes them).")
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def auto_weights_cache(model_path) -> str:
    """'fp32' when a dequantized fp32 copy of the model takes under a quarter of the available memory, else
    'none' (stream from the quantized bytes): decoding one token at a time is bound by dequantization."""
    import os

    from juno_py.gguf import GGUFFile
    from juno_py.store import resolve_model

    with GGUFFile(resolve_model(model_path)) as f:
        fp32_bytes = 4 * sum(t.n_elements for t in f.tensors.values())
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return "none"
    return "fp32" if fp32_bytes < available // 4 else "none"


def open_model(model_path, lora_play=None, force=False, weights_cache="auto", compute_dtype="fp32", device="cpu"):
    from juno_py.lora import load_adapters
    from juno_py.models import load_model

    on_gpu = str(device).startswith("cuda")
    if compute_dtype == "auto":
        compute_dtype = "bf16" if on_gpu else "fp32"
    if weights_cache == "auto":
        # on a GPU the weights stay quantized: the fused dequantize-matvec kernel decodes one token from the bytes
        weights_cache = "none" if on_gpu else auto_weights_cache(model_path)
    model = load_model(model_path, device=device, weights_cache=weights_cache, compute_dtype=compute_dtype)
    if lora_play:
        load_adapters(model, [s for s in lora_play.split(",") if s.strip()], force=force)
    return model
