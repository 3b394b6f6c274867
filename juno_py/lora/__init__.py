"""Adapters on a loaded model: attach fresh ones for training, save them as adapter.bin, load them for playback.

`attach(model, targets=..., config=...)` wraps each chosen frozen linear in an `AdaptedLinear` and returns an
`AdapterSet`, the trainable side of the model. `load_adapters(model, ["a.bin:0.5", "b.bin"])` plays files back.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import nn

from juno_py.errors import AdapterMismatch, show
from juno_py.lora.adapters import AdaptedLinear, AdapterConfig, AdapterSet, LoraAdapter, TensorFingerprints
from juno_py.lora.format import (
    AdapterEntry,
    Fingerprint,
    Init,
    Mode,
    Scaling,
    parse_key,
    read_adapter,
    sort_key,
    write_adapter,
)
from juno_py.models.layout import TARGETS

TARGET_ALIASES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "wgate", "up": "wup", "down": "wdown"}


def parse_targets(spec: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """'qv' | 'all' | 'attn' | 'mlp' | a comma list of targets ('wq,wv' or 'q,v,gate')."""
    groups = {
        "qv": ["wq", "wv"],
        "all": list(TARGETS),
        "attn": ["wq", "wk", "wv", "wo"],
        "mlp": ["wgate", "wup", "wdown"],
    }
    items = list(spec) if not isinstance(spec, str) else [n.strip() for n in spec.split(",") if n.strip()]
    names = [t for n in items for t in groups.get(n, [n])]  # a group may stand alone or in a comma list
    out = []
    for n in names:
        t = TARGET_ALIASES.get(n, n)
        if t not in TARGETS:
            raise ValueError(
                f"unknown target {show(n)}: expected qv, all, attn, mlp or a comma list of {', '.join(TARGETS)}"
            )
        if t not in out:
            out.append(t)
    return tuple(sorted(out, key=TARGETS.index))


def _base_of(module: nn.Module) -> nn.Module:
    return module.base if isinstance(module, AdaptedLinear) else module


def _device_of(module: nn.Module) -> torch.device:
    """Where a frozen base lives (its bytes, else any buffer or parameter): its adapter goes there too."""
    raw = getattr(module, "raw", None)
    if isinstance(raw, torch.Tensor):
        return raw.device
    for t in (*module.buffers(), *module.parameters()):
        return t.device
    return torch.device("cpu")


def attach(
    model,
    targets: Union[str, Sequence[str]] = "qv",
    config: Optional[AdapterConfig] = None,
    seed: int = 0,
    layers: Optional[Iterable[int]] = None,
    **overrides,
) -> AdapterSet:
    """Wrap the chosen targets of every (or the given) layer in fresh adapters; returns the trainable set.

    `config` (or keyword overrides such as rank=, alpha=, mode=Mode.DORA) sets rank, alpha, scaling, init,
    dropout and mode. A is initialised from `seed`; B is zero, so the model's outputs are unchanged.
    """
    config = config or AdapterConfig()
    if overrides:
        config = AdapterConfig(**{**config.__dict__, **overrides})
    names = parse_targets(targets)
    layer_set = set(layers) if layers is not None else None
    gen = torch.Generator().manual_seed(seed)
    modules: dict[str, AdaptedLinear] = {}
    for ref in model.targets(names):
        if layer_set is not None and ref.layer not in layer_set:
            continue
        base = _base_of(ref.module)
        mag = base.row_norms_sq().sqrt() if config.mode == Mode.DORA else None
        # initialised on the CPU (the same A for a given seed on every device), then moved beside its base
        ad = LoraAdapter(
            base.in_features, base.out_features, config, generator=gen, magnitude=None if mag is None else mag.cpu()
        ).to(_device_of(base))
        key = f"{ref.layer}:{ref.target}"
        wrapped = AdaptedLinear(base, [ad], name=key)
        model.blocks[ref.layer].linears[ref.target] = wrapped
        modules[key] = wrapped
    for p in model.parameters():
        p.requires_grad_(False)
    aset = AdapterSet(model, modules)
    for p in aset.parameters():
        p.requires_grad_(True)
    return aset


def detach(model) -> None:
    """Remove every adapter, restoring the frozen base linears."""
    for blk in model.blocks:
        for name, mod in list(blk.linears.items()):
            if isinstance(mod, AdaptedLinear):
                blk.linears[name] = mod.base


def parse_adapter_spec(spec: str) -> tuple[str, float]:
    """'a.bin' → (a.bin, 1.0); 'a.bin:0.5' → (a.bin, 0.5)."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return spec, 1.0


def check_entry_fits(
    model, e: AdapterEntry, path, fps: TensorFingerprints, force: bool = False, mismatches: Optional[list] = None
) -> AdaptedLinear | nn.Module:
    """Check one adapter entry against the model's layout; returns the frozen base linear it applies to.

    A LoRA entry whose fingerprint differs from its base tensor loads anyway: it is appended to `mismatches` as
    (path, key, tensor) when a list is given (the caller warns once for all of them), else warned about."""
    where = f"{path}: entry {show(e.key)}"
    try:
        layer, target = parse_key(e.key)
    except ValueError as err:
        raise AdapterMismatch(f"{where}: {err}") from None
    n_layer = len(model.blocks)
    if layer >= n_layer:
        raise AdapterMismatch(f"{where}: layer {layer} does not exist, the model has {n_layer} layers")
    base = _base_of(model.blocks[layer].linears[target])
    if (e.in_dim, e.out_dim) != (base.in_features, base.out_features):
        raise AdapterMismatch(
            f"{where}: shape in {e.in_dim} x out {e.out_dim} does not fit the model's "
            f"{target} (in {base.in_features} x out {base.out_features})"
        )
    if e.fingerprint is not None:
        tensor = model.layout.blocks[layer].targets[target].tensor
        mine = fps.of(tensor)
        if mine != e.fingerprint:
            what = (
                f"{where}: fingerprint differs from the base tensor {show(tensor)} (type {e.fingerprint.ggml_type} "
                f"dims {e.fingerprint.dims} vs type {mine.ggml_type} dims {mine.dims}): trained on another "
                f"base or quantization"
            )
            if e.mode == Mode.DORA and not force:
                raise AdapterMismatch(
                    what + "; a DoRA adapter's magnitude is tied to its base, refused (use --force to load it anyway)"
                )
            if mismatches is None:
                warnings.warn(what, stacklevel=3)
            else:
                mismatches.append((path, e.key, tensor))
    return base


def warn_mismatches(model, mismatches: list) -> None:
    """One warning for every LoRA entry of a load whose fingerprint differs from its base tensor."""
    if not mismatches:
        return
    files = list(dict.fromkeys(str(p) for p, _, _ in mismatches))
    path, key, tensor = mismatches[0]
    more = f" and {len(mismatches) - 1} more entries" if len(mismatches) > 1 else ""
    where = f"{path}" if len(files) == 1 else f"{path} (and {len(files) - 1} more files)"
    warnings.warn(
        f"{where}: entry {show(key)}{more}: fingerprint differs from the base tensor {show(tensor)} of "
        f"{model.gguf.path}: trained on another base or quantization; playing the LoRA anyway",
        stacklevel=3,
    )


def load_adapters(
    model, specs: Sequence[Union[str, tuple[str, float]]], force: bool = False
) -> dict[str, AdaptedLinear]:
    """Play adapter files back on `model`: LoRAs summed with their scales; a DoRA adapter alone at scale 1."""
    parsed = [parse_adapter_spec(s) if isinstance(s, str) else (str(s[0]), float(s[1])) for s in specs]
    files = []
    for path, scale in parsed:
        _, entries = read_adapter(path)
        files.append((path, scale, entries))
    has_dora = [any(e.mode == Mode.DORA for e in entries) for _, _, entries in files]
    if any(has_dora) and (len(files) > 1 or files[0][1] != 1.0):
        bad = files[has_dora.index(True)][0]
        raise AdapterMismatch(
            f"{bad}: a DoRA adapter plays alone and at scale 1 (got {len(files)} adapter(s), "
            f"scales {[s for _, s, _ in files]}); merge it instead to combine"
        )
    fps = TensorFingerprints(model)
    grouped: dict[str, list[tuple[LoraAdapter, float]]] = defaultdict(list)
    bases: dict[str, nn.Module] = {}
    mismatches: list = []
    for path, scale, entries in files:
        for e in entries:
            bases[e.key] = check_entry_fits(model, e, path, fps, force, mismatches)
            grouped[e.key].append((LoraAdapter.from_entry(e).to(_device_of(bases[e.key])), scale))
    warn_mismatches(model, mismatches)
    detach(model)
    out = {}
    for key, items in sorted(grouped.items(), key=lambda kv: sort_key(kv[0])):
        layer, target = parse_key(key)
        mod = AdaptedLinear(bases[key], [a for a, _ in items], [w for _, w in items], name=key)
        for p in mod.adapters.parameters():
            p.requires_grad_(False)
        mod.eval()
        model.blocks[layer].linears[target] = mod
        out[key] = mod
    return out


__all__ = [
    "attach",
    "detach",
    "load_adapters",
    "parse_targets",
    "parse_adapter_spec",
    "AdapterSet",
    "AdapterConfig",
    "AdaptedLinear",
    "LoraAdapter",
    "Mode",
    "Scaling",
    "Init",
    "read_adapter",
    "write_adapter",
    "AdapterEntry",
    "Fingerprint",
]
