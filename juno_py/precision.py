"""What `--compute-dtype auto` and `--weights-cache auto` resolve to: one rule for every command that opens a model.

compute auto: bf16 on a GPU with bf16 support, bf16 on a CPU with native bf16 (AVX-512 BF16 or AMX), else fp32.
weights-cache auto: with bf16 compute, a bf16 copy of the 2-D weights when it takes at most
min(CACHE_LIMIT_BYTES, 1/8 of the device's memory: RAM on the CPU, device memory on a GPU); otherwise none (the
bytes stay quantized: streamed on the CPU, decoded in kernels on a GPU)."""

from __future__ import annotations

from typing import Optional

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHTS_CACHES = ("none", "bf16", "fp32")
# a resident bf16 copy of the frozen weights is kept when it is at most this large (and 1/8 of the memory)
CACHE_LIMIT_BYTES = 4 << 30


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls that run faster than fp32 (llama.cpp's check reads the same flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def total_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def on_gpu(device: object) -> bool:
    return str(device).startswith("cuda")


def choose_compute_dtype(spec: str, gpu: bool, native_bf16: bool) -> torch.dtype:
    """The rule alone, from the facts: `native_bf16` is the GPU's bf16 support on a GPU, the CPU's flags else."""
    if spec != "auto":
        if spec not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {spec!r}: expected auto, fp32 or bf16")
        return COMPUTE_DTYPES[spec]
    return torch.bfloat16 if native_bf16 else torch.float32


def resolve_compute_dtype(spec: str, device: str = "cpu") -> torch.dtype:
    """'auto' | 'fp32' | 'bf16' -> dtype on `device`. Adapters and optimizer state are fp32 either way."""
    if spec != "auto":
        return choose_compute_dtype(spec, False, False)
    if on_gpu(device):
        return choose_compute_dtype(spec, True, bool(torch.cuda.is_bf16_supported()))
    return choose_compute_dtype(spec, False, cpu_has_native_bf16())


def choose_weights_cache(spec: str, compute_dtype: torch.dtype, weight_elements: int, memory_bytes: int) -> str:
    """The rule alone, from the facts: the 2-D weights' element count and the device's memory (0: unknown)."""
    if spec != "auto":
        if spec not in WEIGHTS_CACHES:
            raise ValueError(f"weights cache {spec!r}: expected auto, none, bf16 or fp32")
        return spec
    if compute_dtype != torch.bfloat16:
        return "none"
    limit = min(CACHE_LIMIT_BYTES, memory_bytes // 8 or CACHE_LIMIT_BYTES)
    return "bf16" if 2 * weight_elements <= limit else "none"


def device_memory_bytes(device: str) -> int:
    if on_gpu(device):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return total_ram_bytes()


def matrix_elements(model_path: object) -> int:
    from juno_py.gguf import GGUFFile

    with GGUFFile(model_path) as gguf:
        return sum(_numel(t.shape) for t in gguf.tensors.values() if len(t.shape) == 2)


def resolve_weights_cache(
    spec: str, model_path: object, compute_dtype: torch.dtype, device: str = "cpu", memory_bytes: Optional[int] = None
) -> str:
    """'auto' | 'none' | 'bf16' | 'fp32' for `model_path` on `device` (see the module's rule)."""
    if spec != "auto" or compute_dtype != torch.bfloat16:
        return choose_weights_cache(spec, compute_dtype, 0, 0)
    memory = device_memory_bytes(device) if memory_bytes is None else memory_bytes
    return choose_weights_cache(spec, compute_dtype, matrix_elements(model_path), memory)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in COMPUTE_DTYPES.items()}.get(dtype, str(dtype))


def _numel(shape: "tuple[int, ...] | list[int]") -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
