"""Choices made before a run starts: the adapter's default path and the run identity (compute dtype and weights
cache: `juno_py.precision`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from juno_py.metrics import Identity


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
