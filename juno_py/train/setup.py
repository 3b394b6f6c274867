"""Choices made before a run starts: compute dtype, weight cache, the adapter's default path, the run identity."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from juno_py.metrics import Identity

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# a resident bf16 copy of the frozen weights is kept when it is at most this large (and 1/8 of the RAM)
CACHE_LIMIT_BYTES = 4 << 30


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls that run faster than fp32 (llama.cpp's check reads the same flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_compute_dtype(spec: str, device: str = "cpu") -> torch.dtype:
    """'auto' | 'fp32' | 'bf16' -> dtype. auto: bf16 matmuls (fp32 accumulation) where the hardware has native
    bf16, else fp32. Adapters and optimizer state are fp32 either way."""
    if spec != "auto":
        if spec not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {spec!r}: expected auto, fp32 or bf16")
        return COMPUTE_DTYPES[spec]
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def total_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def resolve_weights_cache(spec: str, model_path, compute_dtype: torch.dtype, device: str = "cpu") -> str:
    """'auto' | 'none' | 'bf16' | 'fp32'. auto: with bf16 compute, keep a bf16 copy of the frozen weights when it
    is small (no dequantization per step); with fp32 compute, stream from the quantized bytes (exact). On a GPU
    the copy must also fit in 1/8 of the device's memory; otherwise the bytes stay quantized there."""
    if spec != "auto":
        return spec
    if compute_dtype != torch.bfloat16:
        return "none"
    from juno_py.gguf import GGUFFile

    gguf = GGUFFile(model_path)
    elements = sum(_numel(t.shape) for t in gguf.tensors.values() if len(t.shape) == 2)
    if str(device).startswith("cuda"):
        memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        memory = total_ram_bytes()
    limit = min(CACHE_LIMIT_BYTES, memory // 8 or CACHE_LIMIT_BYTES)
    return "bf16" if 2 * elements <= limit else "none"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def default_adapter_path(model_spec: Optional[str], resolved: Path) -> Path:
    """`<model name>.adapter.bin` in the current folder (the store name, else the file's stem)."""
    name = model_spec if model_spec and not Path(model_spec).suffix == ".gguf" else resolved.stem
    return Path(f"{Path(name).name}.adapter.bin")


def run_identity(model, config, targets, device: str) -> Identity:
    """The identity fields every metrics event carries."""
    return Identity(
        algorithm=config.mode.name.lower(),
        scaling=config.scaling.name.lower().replace("_", "-"),
        init=config.init.name.lower().replace("_", "-"),
        architecture=model.args.architecture,
        device=str(device),
        rank=config.rank,
        alpha=float(config.alpha),
        targets=",".join(targets),
    )
