"""Resume state beside an adapter: `adapter.bin.state`, one safetensors file.

Tensors (the trained weights, the optimizer's state, best weights, the torch RNG state) are safetensors tensors;
everything else (step, epoch, data position, schedule, stop-rule counters, the run's settings) is one JSON document in
the safetensors header's metadata. No pickle anywhere. The file is written atomically, and it carries the adapter
weights itself, so a kill between writing adapter.bin and its state never pairs a state with other weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from juno_py.atomic import atomic_write_bytes
from juno_py.errors import JunoError

FORMAT = "juno-py train state"
VERSION = 1
_META_KEY = "juno_py.state"


class StateError(JunoError, ValueError):
    """A resume state that is missing, unreadable or belongs to another run."""


def state_path(adapter_path) -> Path:
    return Path(str(adapter_path) + ".state")


def save_state(path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], fmt: str = FORMAT) -> Path:
    """`fmt`: the schema's name (the trainable's `state_format`: adapters FORMAT, `juno-py full` its own)."""
    doc = {**meta, "format": fmt, "version": VERSION}
    data = st_save(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        metadata={_META_KEY: json.dumps(doc, sort_keys=True)},
    )
    return atomic_write_bytes(path, data)


def load_state(path, fmt: str = FORMAT) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return parse_state(read_state_bytes(path), path, fmt)


def read_state_bytes(path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StateError(f"{path}: no resume state (train once with this --output, or drop --resume)") from None


def parse_state(data: bytes, path, fmt: str = FORMAT) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and the JSON document of a state file's bytes (`path` names the file in errors)."""
    path = Path(path)
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"][_META_KEY])
    except (SafetensorError, KeyError, ValueError, TypeError) as e:
        raise StateError(f"{path}: not a juno-py resume state ({type(e).__name__}: {e})") from None
    if meta.get("format") != fmt or meta.get("version") != VERSION:
        raise StateError(
            f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}, expected {fmt!r} version {VERSION}"
        )
    return tensors, meta
