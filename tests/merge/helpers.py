"""Adapters with a visible effect for the merge and export tests, and independent readers of what a merge wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from juno_py.lora import Mode, Scaling, attach, load_adapters, read_adapter, write_adapter
from juno_py.models import load_model

LLAMA_CPP_NAME = {"general.name": "tiny"}  # llama.cpp special-cases model names containing "phi3"


def make_adapter(
    model_path,
    out,
    targets="all",
    rank=4,
    alpha=8.0,
    mode=Mode.LORA,
    scaling=Scaling.STANDARD,
    seed=1,
    b_std=0.05,
    m_spread=0.05,
    zero_rows: Optional[Sequence[int]] = None,
    layers: Optional[Sequence[int]] = None,
) -> Path:
    """A fresh adapter with random non-zero B (and m moved off its start for DoRA), saved as adapter.bin.
    `zero_rows`: rows of every B left at zero, so those output rows do not change."""
    model = load_model(model_path)
    aset = attach(model, targets, rank=rank, alpha=alpha, mode=mode, scaling=scaling, seed=seed, layers=layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, b_std, generator=g)
            if zero_rows is not None:
                ad.lora_B[list(zero_rows)] = 0
            if ad.magnitude is not None:
                ad.magnitude.mul_(1 + m_spread * torch.randn(ad.magnitude.shape, generator=g))
    return aset.save(out)


def combine(out, *paths) -> Path:
    """One adapter.bin holding the entries of several (disjoint targets, possibly different ranks)."""
    entries = [e for p in paths for e in read_adapter(p)[1]]
    return write_adapter(out, entries)


def playback_logits(model_path, adapter, ids) -> torch.Tensor:
    model = load_model(model_path)
    load_adapters(model, [str(adapter)])
    with torch.no_grad():
        return model.logits(ids)


def model_logits(model_path, ids) -> torch.Tensor:
    with torch.no_grad():
        return load_model(model_path).logits(ids)


def gguf_reference_dequantize(path, name) -> np.ndarray:
    """A tensor decoded by the `gguf` package (an implementation independent of ours), float64 `[rows, cols]`."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(values, dtype=np.float64).reshape(-1, int(t.shape[0]))


def expected_target(base_path, adapter, tensor) -> np.ndarray:
    """W* of a physical tensor from first principles: the base decoded by `gguf`, each entry's s·B·A (DoRA:
    g ⊙ (W + s·B·A)) placed at its rows by the model's layout, all in float64 numpy."""
    from juno_py.gguf import GGUFFile
    from juno_py.merge.targets import ModelTargets

    w = gguf_reference_dequantize(base_path, tensor)
    with GGUFFile(base_path) as g:
        layout = ModelTargets(g).layout
    for e in read_adapter(adapter)[1]:
        slot = layout.blocks[e.layer].targets[e.target]
        if slot.tensor != tensor:
            continue
        lo, hi = slot.rows
        v = w[lo:hi] + e.scale * (e.B.astype(np.float64) @ e.A.astype(np.float64))
        if e.mode == Mode.DORA:
            v = v * (e.magnitude.astype(np.float64) / np.maximum(np.linalg.norm(v, axis=1), 1e-6))[:, None]
        w[lo:hi] = v
    return w
