"""Run forward and backward through one large FrozenQuantLinear and report its memory, as JSON on stdout.

Run as a subprocess (`python -m tests.weights.memory_probe FILE TENSOR SCRATCH_BYTES TOKENS`) with glibc's
mmap threshold pinned low, so every block-sized allocation is mapped on malloc and unmapped on free and the
resident-set high-water mark sees exactly the memory that was live. Reports:
- `rss_peak_extra`: the high-water mark during the step minus the resident set before it (the whole
  mapping of the file is paged in first, so its pages are not counted as growth);
- `largest_tensor`: the bytes of the largest tensor any torch operation returned during a second step
  (a dispatch mode sees every operation, in forward and backward).
"""

from __future__ import annotations

import gc
import json
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from juno_py.gguf import GGUFFile
from juno_py.weights import FrozenQuantLinear, scratch_bytes_for


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM := VmRSS


def _step(lin: FrozenQuantLinear, x: torch.Tensor, dy: torch.Tensor) -> None:
    y = lin(x)
    y.backward(dy)
    del y


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch operation returns while active (views count at their own size)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.nbytes:
                self.nbytes, self.op = t.numel() * t.element_size(), str(func)
        return out


def main(path: str, name: str, scratch_bytes: int, tokens: int) -> dict:
    torch.set_num_threads(1)  # memory does not depend on it; on a busy 2-core runner it avoids OpenMP stalls
    f = GGUFFile(path)
    info = f.tensor(name)
    n_out, n_in = info.shape
    lin = FrozenQuantLinear.from_gguf(f, name, scratch_bytes=scratch_bytes)
    # warm up BLAS, OpenMP and the autograd engine on a few rows: nothing block-sized stays behind
    few = FrozenQuantLinear.from_gguf(f, name, rows=slice(0, 8))
    _step(few, torch.randn(tokens, n_in, requires_grad=True), torch.randn(tokens, 8))
    int(info.raw.sum(dtype=np.uint64))  # page in the mapped bytes

    x = torch.randn(tokens, n_in, requires_grad=True)
    dy = torch.randn(tokens, n_out)
    gc.collect()
    _reset_high_water_mark()
    before = _status_kib("VmRSS")
    _step(lin, x, dy)
    rss_peak_extra = (_status_kib("VmHWM") - before) * 1024

    x.grad = None
    with LargestTensor() as largest:
        _step(lin, x, dy)
    return {
        "n_out": n_out,
        "n_in": n_in,
        "tokens": tokens,
        "chunk_rows": lin.chunk_rows,
        "scratch_bytes": scratch_bytes_for(lin),
        "io_bytes": 4 * tokens * (2 * n_in + 2 * n_out),  # x, dx, y, dy (fp32)
        "rss_peak_extra": rss_peak_extra,
        "largest_tensor": largest.nbytes,
        "largest_tensor_op": largest.op,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
