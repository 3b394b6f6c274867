"""Kernel tests run on the GPU when there is one, else on the CPU under Triton's interpreter.

`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, i.e. when its module is imported, so the
variable is set here, while pytest collects this folder and before any test in it imports a kernel module.
juno-py's DoRA kernels (`juno_py.kernels.dora_triton`) are imported only when a fused path first runs, so this
is early enough for them wherever the suite starts. A module that defines kernels when `juno_py` is imported
must have the variable set before that (in the environment, or in the root conftest). On a machine with CUDA
nothing is set: the same tests then run compiled kernels at real sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
DEVICE = "cpu" if INTERPRETED else "cuda"


@pytest.fixture
def device():
    return torch.device(DEVICE)


@pytest.fixture
def fused(monkeypatch):
    """Force the fused paths (JUNO_PY_KERNELS=fused) for one test."""
    monkeypatch.setenv("JUNO_PY_KERNELS", "fused")
