"""Adapters on a loaded model: attach fresh ones for training, save them as adapter.bin, load them for playback.

`attach(model, targets=..., config=...)` wraps each chosen frozen linear in an `AdaptedLinear` and returns an
`AdapterSet`, the trainable side of the model. `load_adapters(model, ["a.bin:0.5", "b.bin"])` plays files back.

On a mixture-of-experts model the MLP targets (`wgate wup wdown`, as in `mlp` and `all`) mean the experts'
projections (`wgate_exps wup_exps wdown_exps`), each with one adapter per expert (`experts="per-expert"`, keys
`<layer>:<target>.<expert>`) or one adapter shared by all experts of the block (`experts="shared"`, keys
`<layer>:<target>.*`); the router (`wrouter`, `router`) is a target of its own.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Iterable, Optional, Sequence, Union, cast

import numpy as np
import torch
from torch import nn

from juno_py.errors import AdapterMismatch, show
from juno_py.lora.adapters import (
    AdaptedLinear,
    AdapterConfig,
    AdapterSet,
    ExpertAdapter,
    ExpertStack,
    LoraAdapter,
    TensorFingerprints,
    initial_A,
    initial_magnitude,
    ref_tensor,
)
from juno_py.lora.format import (
    EVERY_EXPERT,
    AdapterEntry,
    Fingerprint,
    Init,
    Mode,
    Scaling,
    parse_entry_key,
    read_adapter,
    write_adapter,
)
from juno_py.models.layout import ALL_TARGETS, EXPERT_TARGETS, MOE_TARGETS, TARGETS

TARGET_ALIASES = {
    "q": "wq",
    "k": "wk",
    "v": "wv",
    "o": "wo",
    "gate": "wgate",
    "up": "wup",
    "down": "wdown",
    "router": "wrouter",
}
# how the adapters of expert targets are laid out: one per expert, or one shared by every expert of a block
EXPERT_MODES = ("per-expert", "shared")
# on a mixture-of-experts model the dense MLP targets name the experts' projections
MLP_TO_EXPERTS = {"wgate": "wgate_exps", "wup": "wup_exps", "wdown": "wdown_exps"}


def parse_targets(spec: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """'qv' | 'all' | 'attn' | 'mlp' | 'experts' | a comma list of targets ('wq,wv' or 'q,v,gate,router')."""
    groups = {
        "qv": ["wq", "wv"],
        "all": list(TARGETS),
        "attn": ["wq", "wk", "wv", "wo"],
        "mlp": ["wgate", "wup", "wdown"],
        "experts": list(EXPERT_TARGETS),
    }
    items = list(spec) if not isinstance(spec, str) else [n.strip() for n in spec.split(",") if n.strip()]
    names = [t for n in items for t in groups.get(n, [n])]  # a group may stand alone or in a comma list
    out = []
    for n in names:
        t = TARGET_ALIASES.get(n, n)
        if t not in ALL_TARGETS:
            raise ValueError(
                f"unknown target {show(n)}: expected qv, all, attn, mlp, experts or a comma list of "
                f"{', '.join(ALL_TARGETS)}"
            )
        if t not in out:
            out.append(t)
    return tuple(sorted(out, key=ALL_TARGETS.index))


def model_targets(model, names: Sequence[str]) -> tuple[str, ...]:
    """The targets `names` mean on `model`: on a mixture-of-experts model the dense MLP targets are the experts'
    projections; on a dense model the router and expert targets do not exist (AdapterMismatch)."""
    if getattr(model.args, "n_expert", 0):
        out = []
        for n in names:
            t = MLP_TO_EXPERTS.get(n, n)
            if t not in out:
                out.append(t)
        return tuple(sorted(out, key=ALL_TARGETS.index))
    bad = [n for n in names if n in MOE_TARGETS]
    if bad:
        raise AdapterMismatch(
            f"target {bad[0]} needs a mixture-of-experts model; {model.args.architecture} here has a dense MLP "
            f"(targets {', '.join(TARGETS)})"
        )
    return tuple(names)


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
    experts: str = "per-expert",
    **overrides,
) -> AdapterSet:
    """Wrap the chosen targets of every (or the given) layer in fresh adapters; returns the trainable set.

    `config` (or keyword overrides such as rank=, alpha=, mode=Mode.DORA) sets rank, alpha, scaling, init,
    dropout and mode. A is initialised from `seed`; B is zero, so the model's outputs are unchanged. `experts`
    (one of EXPERT_MODES) lays out the adapters of expert targets: one per expert, or one shared by the block's
    experts (LoRA only: a DoRA magnitude belongs to one weight). One adapter per expert is held as one `ExpertStack`
    per projection and block, registered on the block's `MoEFeedForward`; its experts' A are drawn in the same order
    as separate adapters' would be, so a seed gives the same values either way.
    """
    config = config or AdapterConfig()
    if overrides:
        config = AdapterConfig(**{**config.__dict__, **overrides})
    if experts not in EXPERT_MODES:
        raise ValueError(f"experts {experts!r}: expected one of {', '.join(EXPERT_MODES)}")
    names = model_targets(model, parse_targets(targets))
    shared = experts == "shared"
    if shared and config.mode == Mode.DORA and any(n in EXPERT_TARGETS for n in names):
        raise AdapterMismatch(
            "DoRA on experts needs one adapter per expert (--lora-experts per-expert): a shared adapter has no "
            "single magnitude"
        )
    layer_set = set(layers) if layers is not None else None
    gen = torch.Generator().manual_seed(seed)
    modules: dict[str, AdaptedLinear] = {}
    # per (layer, expert target): each expert's (index, frozen base, A, m), stacked once all are drawn
    rows: dict[tuple[int, str], list[tuple[int, nn.Module, torch.Tensor, Optional[torch.Tensor]]]] = defaultdict(list)
    for ref in model.targets(names):
        if layer_set is not None and ref.layer not in layer_set:
            continue
        base = _base_of(ref.module)
        if ref.expert is not None and not shared:
            mag = base.row_norms_sq().sqrt().cpu() if config.mode == Mode.DORA else None
            A = initial_A(base.in_features, config, gen)
            rows[ref.layer, ref.target].append((ref.expert, base, A, initial_magnitude(config, base.out_features, mag)))
            continue
        if ref.expert is None:
            key = f"{ref.layer}:{ref.target}"
        else:
            key = f"{ref.layer}:{ref.target}.{EVERY_EXPERT if shared else ref.expert}"
        if key in modules:  # a shared adapter, played on one more expert
            ad = cast(LoraAdapter, modules[key].adapters[0])
        else:
            mag = base.row_norms_sq().sqrt() if config.mode == Mode.DORA else None
            # initialised on the CPU (the same A for a given seed on every device), then moved beside its base
            ad = LoraAdapter(
                base.in_features,
                base.out_features,
                config,
                generator=gen,
                magnitude=None if mag is None else mag.cpu(),
            ).to(_device_of(base))
        wrapped = AdaptedLinear(base, [ad], name=key)
        model.set_linear(ref.layer, ref.target, wrapped, ref.expert)
        modules.setdefault(key, wrapped)
    for (layer, target), experts_rows in rows.items():
        _attach_stack(model, layer, target, config, experts_rows, modules)
    for p in model.parameters():
        p.requires_grad_(False)
    aset = AdapterSet(model, modules)
    for p in aset.parameters():
        p.requires_grad_(True)
    return aset


def _attach_stack(
    model,
    layer: int,
    target: str,
    config: AdapterConfig,
    experts_rows: list[tuple[int, nn.Module, torch.Tensor, Optional[torch.Tensor]]],
    modules: dict[str, AdaptedLinear],
) -> None:
    """One adapter per expert of a projection as rows of one `ExpertStack`, registered on the block's experts; row i
    is expert i, every expert of the block has one."""
    experts_rows = sorted(experts_rows, key=lambda row: row[0])
    moe = model.blocks[layer].moe
    if [e for e, _, _, _ in experts_rows] != list(range(len(moe.experts[target]))):
        raise ValueError(f"{layer}:{target}: one adapter per expert needs every expert of the block")
    base0 = experts_rows[0][1]
    d_out = base0.out_features
    mags = [m for _, _, _, m in experts_rows]
    stack = ExpertStack(
        config,
        torch.stack([A for _, _, A, _ in experts_rows]),
        torch.zeros(len(experts_rows), d_out, config.rank),
        None if mags[0] is None else torch.stack(cast(list[torch.Tensor], mags)),
    ).to(_device_of(base0))
    moe.adapter_stacks[target] = stack
    for (e, base, _, _), ad in zip(experts_rows, stack.adapters()):
        key = f"{layer}:{target}.{e}"
        wrapped = AdaptedLinear(base, [ad], name=key)
        model.set_linear(layer, target, wrapped, e)
        modules[key] = wrapped


def _stacked_entries(
    model, entries: Sequence[AdapterEntry], device: torch.device, stacks: list[tuple[int, str, ExpertStack]]
) -> dict[str, LoraAdapter]:
    """The adapters of a file's per-expert entries of one projection that cover every expert of the block with one
    shape and configuration: the rows of one `ExpertStack` (appended to `stacks` as (layer, target, stack)), held as
    in training so that the grouped expert path multiplies it as it is, by entry key. Other entries are not here:
    each gets a LoraAdapter of its own."""
    groups: dict[tuple[int, str], dict[int, AdapterEntry]] = defaultdict(dict)
    for e in entries:
        layer, target, expert = parse_entry_key(e.key)
        if expert is not None:
            groups[layer, target][expert] = e
    out: dict[str, LoraAdapter] = {}
    for (layer, target), by_expert in groups.items():
        if sorted(by_expert) != list(range(model.args.n_expert)):
            continue
        rows = [by_expert[i] for i in range(model.args.n_expert)]
        if len({(e.in_dim, e.out_dim, e.rank, e.alpha, e.scaling, e.init, e.mode) for e in rows}) != 1:
            continue
        e0 = rows[0]
        config = AdapterConfig(rank=e0.rank, alpha=e0.alpha, mode=e0.mode, scaling=e0.scaling, init=e0.init)
        mags = [e.magnitude for e in rows if e.magnitude is not None]
        stack = ExpertStack(
            config,
            torch.from_numpy(np.stack([e.A for e in rows]).astype(np.float32)),
            torch.from_numpy(np.stack([e.B for e in rows]).astype(np.float32)),
            torch.from_numpy(np.stack(mags).astype(np.float32)) if len(mags) == len(rows) else None,
        ).to(device)
        for p in stack.parameters():
            p.requires_grad_(False)
        stacks.append((layer, target, stack))
        out.update((e.key, ad) for e, ad in zip(rows, stack.adapters()))
    return out


def _register_stack(model, layer: int, target: str, stack: ExpertStack) -> None:
    """Register a played-back stack once in the model, on its block's experts, under its target's name (another
    file's stack of the same target under `<target>_<n>`)."""
    registered = model.blocks[layer].moe.adapter_stacks
    name, n = target, 1
    while name in registered:
        name, n = f"{target}_{n}", n + 1
    registered[name] = stack


def detach(model) -> None:
    """Remove every adapter, restoring the frozen base linears."""
    for blk in model.blocks:
        for name, mod in list(blk.linears.items()):
            if isinstance(mod, AdaptedLinear):
                blk.linears[name] = mod.base
        moe = getattr(blk, "moe", None)
        if moe is not None:
            moe.adapter_stacks.clear()
            for mods in moe.experts.values():
                for e, mod in enumerate(mods):
                    if isinstance(mod, AdaptedLinear):
                        mods[e] = mod.base


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
        layer, target, expert = parse_entry_key(e.key)
    except ValueError as err:
        raise AdapterMismatch(f"{where}: {err}") from None
    n_layer = len(model.blocks)
    if layer >= n_layer:
        raise AdapterMismatch(f"{where}: layer {layer} does not exist, the model has {n_layer} layers")
    bl = model.layout.blocks[layer]
    if target not in bl.targets and target not in bl.experts:
        have = ", ".join([*bl.targets, *bl.experts])
        raise AdapterMismatch(f"{where}: block {layer} has no {target} (its targets: {have})")
    if target in bl.experts:
        n_expert = model.args.n_expert
        if expert is not None and expert >= n_expert:
            raise AdapterMismatch(f"{where}: expert {expert} does not exist, the model has {n_expert} experts")
        if expert is None and e.mode == Mode.DORA:
            raise AdapterMismatch(f"{where}: a DoRA adapter on every expert ('.*') has no single magnitude")
    base = _base_of(model.linear(layer, target, None if target not in bl.experts else expert or 0))
    if (e.in_dim, e.out_dim) != (base.in_features, base.out_features):
        raise AdapterMismatch(
            f"{where}: shape in {e.in_dim} x out {e.out_dim} does not fit the model's "
            f"{target} (in {base.in_features} x out {base.out_features})"
        )
    if e.fingerprint is not None:
        tensor = ref_tensor(model, e.key)
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
    """Play adapter files back on `model`: LoRAs summed with their scales; a DoRA adapter alone at scale 1. A file's
    per-expert entries that cover every expert of a projection are loaded into one `ExpertStack`, as training holds
    them."""
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
    # by where each adapter plays: (layer, target, expert or None); an every-expert entry plays on each expert
    grouped: dict[tuple[int, str, Optional[int]], list[tuple[LoraAdapter, float]]] = defaultdict(list)
    mismatches: list = []
    stacks: list[tuple[int, str, ExpertStack]] = []
    for path, scale, entries in files:
        bases = [check_entry_fits(model, e, path, fps, force, mismatches) for e in entries]
        rows = _stacked_entries(model, entries, _device_of(bases[0]) if bases else torch.device("cpu"), stacks)
        for e, base in zip(entries, bases):
            ad = rows[e.key] if e.key in rows else LoraAdapter.from_entry(e).to(_device_of(base))
            layer, target, expert = parse_entry_key(e.key)
            if target not in EXPERT_TARGETS:
                places: list[Optional[int]] = [None]
            else:
                places = [expert] if expert is not None else list(range(model.args.n_expert))
            for place in places:
                grouped[layer, target, place].append((ad, scale))
    warn_mismatches(model, mismatches)
    detach(model)
    for layer, target, stack in stacks:
        _register_stack(model, layer, target, stack)
    out = {}
    for (layer, target, expert), items in sorted(
        grouped.items(), key=lambda kv: (kv[0][0], ALL_TARGETS.index(kv[0][1]), -1 if kv[0][2] is None else kv[0][2])
    ):
        key = f"{layer}:{target}" if expert is None else f"{layer}:{target}.{expert}"
        base = _base_of(model.linear(layer, target, expert))
        mod = AdaptedLinear(base, [a for a, _ in items], [w for _, w in items], name=key)
        for p in mod.adapters.parameters():
            p.requires_grad_(False)
        mod.eval()
        model.set_linear(layer, target, mod, expert)
        out[key] = mod
    return out


__all__ = [
    "attach",
    "detach",
    "load_adapters",
    "parse_targets",
    "model_targets",
    "EXPERT_MODES",
    "parse_adapter_spec",
    "AdapterSet",
    "AdapterConfig",
    "AdaptedLinear",
    "LoraAdapter",
    "ExpertStack",
    "ExpertAdapter",
    "Mode",
    "Scaling",
    "Init",
    "read_adapter",
    "write_adapter",
    "AdapterEntry",
    "Fingerprint",
]
