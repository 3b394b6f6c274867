"""Launching Triton kernels cheaply: `launch(kernel, grid, args, ...)` is `kernel[grid](*args, ...)` with the
compiled kernel of each specialization kept and launched directly the second time.

`kernel[grid](...)` costs about 31 µs of CPU a launch on the H200's host, a direct launch about 6
(docs/kernels.md, "Launching Triton kernels"): triton binds and specializes every argument and builds a cache key
on each call. For a kernel launched every step (the DoRA composition and norm, the decode of each quantized tile,
the loss chunk) that is most of the CPU time a training or playback step spends on it. `launch` keeps the compiled kernel (`CompiledKernel[grid]`) under
a key at least as fine as triton's specialization: each tensor's dtype and 16-byte alignment, each int's value
class (== 1, divisible by 16, 32-bit range), every constexpr value, the warps, the stages and the device. The first
launch of a key goes through triton as usual; anything unexpected turns the shortcut off for good (the usual way
is always correct). Under the interpreter (TRITON_INTERPRET=1, CPU tests) every launch goes the usual way.
"""

from __future__ import annotations

import os

import torch

_compiled: dict = {}
# decided at the first launch, not at import: this module is imported with `juno_py` (the decode kernels' launcher),
# before a test's conftest may set TRITON_INTERPRET, and triton itself reads it only when the kernels are defined
_direct: bool | None = None


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (read now: triton reads it when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _arg_key(a):
    t = type(a)
    if t is int:  # exactly int: bool (a subclass) is keyed by value below
        return "i", a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), 0 <= a < (1 << 64)
    if t is float:
        return "f"
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return "?", t.__name__, a


def launch(kernel, grid, args, num_warps=4, num_stages=None, **constexprs):
    """`kernel[grid](*args, **constexprs, num_warps=num_warps)` (and num_stages when given), the compiled kernel
    reused when it can be. Every constexpr must follow the runtime arguments in the kernel's signature."""
    global _direct
    opts = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    if _direct is None:
        _direct = not interpreting()
    if not _direct:
        kernel[grid](*args, **constexprs, **opts)
        return
    key = (kernel, num_warps, num_stages, tuple(constexprs.items()), tuple(map(_arg_key, args)), args[0].device.index)
    hit = _compiled.get(key)
    if hit is not None:
        compiled, names = hit
        try:
            # the compiled kernel's runner reads three grid dimensions (triton's binder pads them; this does too)
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *(constexprs[n] for n in names))
            return
        except Exception:  # noqa: BLE001 - a triton whose internals differ: launch the usual way from now on
            _direct = False
            _compiled.clear()
    compiled = kernel[grid](*args, **constexprs, **opts)
    names = list(getattr(kernel, "arg_names", [])[len(args) :])
    if _direct and hasattr(compiled, "__getitem__") and sorted(names) == sorted(constexprs):
        _compiled[key] = (compiled, names)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for ints: `triton.cdiv` without its constexpr wrapper (about 4 µs a call here, and a DoRA step's
    launches made twenty of them)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two ≥ n (0 for n ≤ 0), as `triton.next_power_of_2`, without its wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def row_warps(block: int) -> int:
    """The warps of a kernel whose program reduces one row of `block` (a power of two) values: the RMSNorm kernels,
    the decode step's `add_rms` and a LoRA's x·Aᵀ (`lora_xa_kernel`). Kernels that must give each other's bits take
    the same count, which fixes the order of a row's sums."""
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def direct() -> bool:
    """Whether the shortcut is on (decided at the first launch; it turns itself off for good on an unexpected
    error)."""
    return bool(_direct)


def compiled_kernels() -> list:
    """The kernels with a kept specialization (tests check that the shortcut is live)."""
    return [key[0] for key in _compiled]


__all__ = ["launch", "interpreting", "direct", "compiled_kernels", "cdiv", "next_pow2"]
