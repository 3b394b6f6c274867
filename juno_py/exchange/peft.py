"""PEFT export and import: `adapter_config.json` + `adapter_model.safetensors` for transformers' model of the
same architecture.

Module names and row permutations come from the architecture's `ArchSpec` (`hf_modules`, `hf_permuted_rows`).
Where Hugging Face fuses several targets into one module (Phi-3's `qkv_proj`, `gate_up_proj`), the targets
adapted there become one module adapter with A stacked and B block-diagonal; each module's scale is expressed
exactly through `alpha_pattern` (or, when its parts' scales differ, baked into B under a module scale of 1).
Where the GGUF stores rows permuted relative to Hugging Face (llama's Q and K, by llama.cpp's converter), B's rows
and the DoRA magnitude are un-permuted per head (head count for wq, KV-head count for wk); A never changes.

Mixture-of-experts targets live in parameters, not modules (`hf_parameters`), and are exported through PEFT's
`target_parameters` (its `ParamWrapper`, LoRA only): the router as a 2-D pair like a module's, each expert
parameter as one pair over its `n_expert` experts, A `[n_expert·R, n_in]` expert-major and B `[n_out, R·n_expert]`
rank-major, R the largest rank any expert needs (the others padded with zeros). Gate and up, one
`gate_up_proj` there, stack per expert as a fused module's targets do (gate‖up, or interleaved where
`hf_interleaved` says so); an every-expert entry is repeated on each expert.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from juno_py.atomic import atomic_output
from juno_py.errors import one_line, show
from juno_py.exchange.interop import (
    Part,
    dump_record,
    finish_import,
    load_record,
    number,
    part_records,
    split_by_record,
    stack_parts,
)
from juno_py.gguf import GGUFFile
from juno_py.lora.format import MAX_ABS_ALPHA, AdapterEntry, Init, Mode, Scaling, read_adapter
from juno_py.merge.targets import MergeError, ModelTargets
from juno_py.models.config import ArchSpec
from juno_py.models.layout import ALL_TARGETS, MOE_TARGETS, TARGETS
from juno_py.progress import DEFAULT_INTERVAL, Progress

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
RECORD_KEY = "juno_py"
PREFIX = "base_model.model."
LAYER_MODULE = "model.layers.{layer}.{module}"

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|"
    r"lora_magnitude_vector(?:\.weight)?)$"
)
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<module>[^.]+\.[^.]+)$")


# ----------------------------------------------------------------------------------------------- layout
def hf_table(spec: ArchSpec) -> dict[str, str]:
    """Every target's Hugging Face module (`hf_modules`) or, for mixture-of-experts targets, parameter."""
    return {**spec.hf_modules, **spec.hf_parameters}


def module_rows(targets: ModelTargets, target: str) -> tuple[int, int, int]:
    """(lo, hi, rows of the module) of a logical target inside its Hugging Face module or parameter (for an expert
    target: inside one expert's rows), in target order."""
    a = targets.args
    sizes = {
        "wq": a.q_dim,
        "wk": a.kv_dim,
        "wv": a.v_dim,
        "wo": a.n_embd,
        "wgate": a.n_ff,
        "wup": a.n_ff,
        "wdown": a.n_embd,
        "wrouter": a.n_expert,
        "wgate_exps": a.n_ff_exp,
        "wup_exps": a.n_ff_exp,
        "wdown_exps": a.n_embd,
    }
    table = hf_table(targets.spec)
    members = [t for t in ALL_TARGETS if table.get(t) == table[target]]
    lo = sum(sizes[t] for t in members[: members.index(target)])
    return lo, lo + sizes[target], sum(sizes[t] for t in members)


def interleaved_rows(n_rows: int, n_parts: int) -> np.ndarray:
    """Row i of a module whose `n_parts` equal targets alternate row by row is row `order[i]` in target order."""
    return np.arange(n_rows).reshape(n_parts, n_rows // n_parts).T.reshape(-1)


def peft_paths(parameters: Iterable[str], spec: ArchSpec) -> dict[str, str]:
    """The module path under which PEFT saves each adapted parameter's pair (`model.layers.N.<parameter>`, without
    the `base_model.model.` prefix). PEFT wraps a module's adapted parameters one inside the next, in the order
    transformers registers them (`hf_parameters`' order), and names each pair by its wrapper: the last one at the
    module's path, each earlier one a `.base_layer` deeper per adapted parameter of its module registered after it."""
    order = list(dict.fromkeys(spec.hf_parameters.values()))
    names = list(parameters)
    out = {}
    for name in names:
        module = name.rpartition(".")[0]
        rank = order.index(name.split(".", 3)[3])
        later = [n for n in names if n.rpartition(".")[0] == module and order.index(n.split(".", 3)[3]) > rank]
        out[name] = module + ".base_layer" * len(later)
    return out


def hf_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF's llama Q/K row order → Hugging Face's (inverse of the converter's permutation), per head."""
    return x.reshape(n_head, x.shape[0] // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def gguf_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's Q/K row order → GGUF's llama order (llama.cpp's converter permutation)."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _reorder(targets: ModelTargets, target: str, x: Optional[np.ndarray], to_hf: bool) -> Optional[np.ndarray]:
    heads = targets.spec.hf_permuted_rows.get(target)
    if x is None or heads is None:
        return x
    n = getattr(targets.args, heads)
    return np.ascontiguousarray((hf_rows if to_hf else gguf_rows)(np.asarray(x), n))


# ----------------------------------------------------------------------------------------------- export
def _module_scale(parts: list[Part], rank: int, rslora: bool) -> tuple[float, list[Optional[float]]]:
    """(PEFT alpha of the module, factor baked into each part's B or None): PEFT's scale alpha/r (alpha/sqrt(r)
    with rsLoRA) must equal every part's own scale."""
    e0 = parts[0].entry
    if len(parts) == 1 and rank == e0.rank and (e0.scaling == Scaling.RSLORA) == rslora:
        return e0.alpha, [None]
    if len({p.entry.scale for p in parts}) == 1:
        return e0.scale * (math.sqrt(rank) if rslora else rank), [None] * len(parts)
    return (math.sqrt(rank) if rslora else float(rank)), [p.entry.scale for p in parts]


def _base_row_norms(gguf, targets: ModelTargets, layer: int, target: str) -> np.ndarray:
    import torch

    slot = targets.layout.blocks[layer].targets[target]
    w = gguf.dequantize(slot.tensor, rows=slice(*slot.rows))
    return torch.linalg.vector_norm(w, dim=1).numpy()


@dataclass
class _Pair:
    """What one Hugging Face module (`target_modules`) or parameter (`target_parameters`) receives: its parts per
    expert of a 3-D expert parameter, or under None for a 2-D weight."""

    n_rows: int  # rows of the module (of one expert)
    parameter: bool
    parts: dict[Optional[int], list[Part]] = field(default_factory=dict)

    def flat(self) -> list[Part]:
        """Every part, experts in order, each expert's parts by rows (the order factors are listed in)."""
        return [p for x in sorted(self.parts, key=lambda x: -1 if x is None else x) for p in self.parts[x]]


def stack_experts(
    parts: dict[Optional[int], list[Part]], n_expert: int, n_rows: int, rank: int, factors: Sequence[Optional[float]]
) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's pair of a 3-D expert parameter (`ParamWrapper`): A `[n_expert·rank, n_in]` with expert e's rows at
    e·rank + k, B `[n_rows, rank·n_expert]` with expert e's column k at k·n_expert + e, so that PEFT's delta of
    expert e is its scale times B_e·A_e. Each expert's parts stack as `stack_parts` stacks a fused module's, padded
    with zeros to `rank`; an expert without parts gets zeros. `factors`: per part, in `_Pair.flat`'s order."""
    n_in = next(p for ps in parts.values() for p in ps).entry.in_dim
    A = np.zeros((n_expert, rank, n_in), dtype=np.float32)
    B = np.zeros((n_rows, rank, n_expert), dtype=np.float32)
    i = 0
    for x in sorted(parts):
        a, b, _ = stack_parts(parts[x], n_rows, factors[i : i + len(parts[x])])
        i += len(parts[x])
        A[x, : a.shape[0]] = a
        B[:, : b.shape[1], x] = b
    return A.reshape(n_expert * rank, n_in), B.reshape(n_rows, rank * n_expert)


def _target_list(names: list[str], n_layer: int, short) -> list[str]:
    """PEFT's target_modules / target_parameters: `short(inner name)` for each when every layer has all of them,
    else the full names (`model.layers.N.<inner>`)."""
    inner = {n.split(".", 3)[3] for n in names}
    layers_of = {s: {int(n.split(".")[2]) for n in names if n.split(".", 3)[3] == s} for s in inner}
    if all(layers_of[s] == set(range(n_layer)) for s in inner):
        return sorted(short(s) for s in inner)
    return sorted(names)


def export_peft(
    base, adapter, output, progress: Optional[bool] = False, progress_interval: float = DEFAULT_INTERVAL
) -> Path:
    """Write `output/adapter_config.json` and `output/adapter_model.safetensors`; returns the folder.
    `progress`: over the adapted modules on stderr (`juno_py.progress`)."""
    from safetensors.numpy import save

    from juno_py.store import resolve_model

    base_path = Path(resolve_model(base))
    _, entries = read_adapter(adapter)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise MergeError(f"output {output}: exists and is not a folder (a PEFT adapter is a folder)")
    moe_dora = [e.key for e in entries if e.target in MOE_TARGETS and e.mode == Mode.DORA]
    if moe_dora:
        raise MergeError(
            f"{adapter}: entry {moe_dora[0][:80]!r} is DoRA on a mixture-of-experts router or expert: PEFT adapts "
            f"those parameters (target_parameters) with LoRA only, expected LoRA entries there (or merge it: "
            f"juno-py merge --adapter {adapter})"
        )
    modes = {e.mode for e in entries}
    if len(modes) > 1:
        raise MergeError(f"{adapter}: mixes LoRA and DoRA entries; PEFT's use_dora is one flag per adapter")
    dora = Mode.DORA in modes
    rslora = bool(entries) and all(e.scaling == Scaling.RSLORA for e in entries)
    with GGUFFile(base_path) as gguf:
        targets = ModelTargets(gguf)
        spec, n_expert = targets.spec, targets.args.n_expert
        table = hf_table(spec)
        pairs: dict[str, _Pair] = {}
        for e in entries:
            targets.check_entry(e, adapter, force=True)  # a differing fingerprint warns (below); PEFT decides
            if e.target not in table:
                raise MergeError(
                    f"{adapter}: entry {e.key[:80]!r}: no Hugging Face module or parameter is known for {e.target} "
                    f"in {targets.args.architecture}, expected one of {', '.join(sorted(table))} (merge it instead)"
                )
            lo, hi, n_rows = module_rows(targets, e.target)
            name = LAYER_MODULE.format(layer=e.layer, module=table[e.target])
            pair = pairs.setdefault(name, _Pair(n_rows, e.target in MOE_TARGETS))
            B, mag = _reorder(targets, e.target, e.B, True), _reorder(targets, e.target, e.magnitude, True)
            places = [e.expert] if e.expert is not None or not e.on_experts else list(range(n_expert))
            for x in places:
                pair.parts.setdefault(x, []).append(Part(e, (lo, hi), B, mag))
        targets.warn_mismatches()
        paths = peft_paths([n for n, p in pairs.items() if p.parameter], spec)
        tensors, ranks, alphas, records = {}, {}, {}, {}
        bar = Progress(len(pairs), "export", "module", enabled=progress, interval=progress_interval)
        for name, pair in pairs.items():
            for ps in pair.parts.values():
                ps.sort(key=lambda p: p.rows)
            parts = pair.flat()
            e0 = parts[0].entry
            rank = max(sum(p.entry.rank for p in ps) for ps in pair.parts.values())
            alpha, factors = _module_scale(parts, rank, rslora)
            mag = None
            if None in pair.parts:  # a 2-D weight
                A, B, cols = stack_parts(parts, pair.n_rows, factors)
                records[name] = part_records(parts, cols, factors)
                if dora:
                    mag = np.empty(pair.n_rows, dtype=np.float32)
                    covered = np.zeros(pair.n_rows, dtype=bool)
                    for p in parts:
                        mag[p.rows[0] : p.rows[1]] = p.magnitude
                        covered[p.rows[0] : p.rows[1]] = True
                    # rows of the module no entry adapts: m = ‖W‖_row makes PEFT's g = 1 there
                    for t in TARGETS:
                        if spec.hf_modules[t] == spec.hf_modules[e0.target]:
                            lo, hi, _ = module_rows(targets, t)
                            if not covered[lo:hi].any():
                                mag[lo:hi] = _reorder(targets, t, _base_row_norms(gguf, targets, e0.layer, t), True)
            else:
                A, B = stack_experts(pair.parts, n_expert, pair.n_rows, rank, factors)
            if table[e0.target] in spec.hf_interleaved:
                order = interleaved_rows(pair.n_rows, sum(v == table[e0.target] for v in table.values()))
                B = B[order]
                mag = None if mag is None else mag[order]
            path = paths.get(name, name)
            tensors[f"{PREFIX}{path}.lora_A.weight"] = A
            tensors[f"{PREFIX}{path}.lora_B.weight"] = B
            if mag is not None:
                tensors[f"{PREFIX}{path}.lora_magnitude_vector"] = mag
            ranks[name], alphas[name] = rank, alpha
            bar.update(1, name)
        bar.close()
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 8
    alpha = Counter(alphas.values()).most_common(1)[0][0] if alphas else 8.0
    modules = [n for n, p in pairs.items() if not p.parameter]
    parameters = [n for n, p in pairs.items() if p.parameter]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path.name,
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "use_dora": dora,
        "target_modules": _target_list(modules, targets.n_layer, lambda s: s.rsplit(".", 1)[1]),
        **({"target_parameters": _target_list(parameters, targets.n_layer, lambda s: s)} if parameters else {}),
        "rank_pattern": {n: v for n, v in sorted(ranks.items()) if v != r},
        "alpha_pattern": {n: v for n, v in sorted(alphas.items()) if v != alpha},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    for name, x in tensors.items():  # B times a baked scale, or a base row norm, can still overflow float32
        if not np.isfinite(x).all():
            raise MergeError(f"{adapter}: tensor {name} is not finite in float32; nothing written")
    output.mkdir(parents=True, exist_ok=True)
    blob = save(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        metadata={"format": "pt", RECORD_KEY: dump_record(records)},
    )
    with atomic_output(output / WEIGHTS_FILE) as f:
        f.write(blob)
    with atomic_output(output / CONFIG_FILE, "w") as f:
        json.dump(config, f, indent=2)
    return output


# ----------------------------------------------------------------------------------------------- import
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes to a few KiB in practice
MAX_PATTERN_CHARS = 512
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# a pattern key quantifies nothing more than this, and no group: PEFT's regex runs over every module name, and
# a nested or repeated quantifier ('(a+)+', 'a*a*a*a*a*') backtracks for minutes on a 30-character name
_QUANTIFIED_GROUP = re.compile(r"\)(?:[*+?]|\{\d)")
_QUANTIFIER = re.compile(r"(?<!\\)(?:[*+?]|\{\d)")
MAX_QUANTIFIERS = 2


def _pattern_value(patterns: dict, name: str, default, where: str):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key), for patterns checked to
    compile and to run in bounded time."""
    for key, value in patterns.items():
        if len(key) > MAX_PATTERN_CHARS:
            raise MergeError(f"{where}: pattern {show(key)} of {len(key)} characters, expected <= {MAX_PATTERN_CHARS}")
        if _QUANTIFIED_GROUP.search(key) or len(_QUANTIFIER.findall(key)) > MAX_QUANTIFIERS:
            raise MergeError(
                f"{where}: pattern {show(key)} quantifies a group or repeats more than {MAX_QUANTIFIERS} times: "
                f"expected a module name or a simple regular expression"
            )
        try:
            matched = re.match(rf"(.*\.)?({key})$", name)
        except (re.error, RecursionError, OverflowError) as e:
            raise MergeError(f"{where}: pattern {show(key)} is not a valid regular expression ({e})") from None
        if matched:
            return value
    return default


def _config(cfg_path: Path) -> dict:
    """adapter_config.json, checked for everything the import reads."""
    size = cfg_path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise MergeError(f"{cfg_path}: {size} bytes, expected at most {MAX_CONFIG_BYTES} for an adapter config")
    try:
        cfg = json.loads(cfg_path.read_bytes())
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
        raise MergeError(f"{cfg_path}: not valid JSON ({one_line(str(e), 160)})") from None
    if not isinstance(cfg, dict):
        raise MergeError(f"{cfg_path}: a JSON {type(cfg).__name__}, expected an object")

    def flag(name: str) -> bool:
        v = cfg.get(name)
        if v is not None and not isinstance(v, bool):
            raise MergeError(f"{cfg_path}: field {name} is {show(v)}, expected true or false")
        return bool(v)

    if cfg.get("peft_type", "LORA") != "LORA":
        raise MergeError(f"{cfg_path}: field peft_type is {show(cfg.get('peft_type'))}, expected 'LORA'")
    if flag("fan_in_fan_out") or flag("lora_bias") or cfg.get("bias", "none") not in ("none", None):
        raise MergeError(f"{cfg_path}: fan_in_fan_out, lora_bias and trained biases are not supported")
    out = {"use_rslora": flag("use_rslora"), "use_dora": flag("use_dora")}
    out["lora_alpha"] = number(cfg.get("lora_alpha", 8), str(cfg_path), "field lora_alpha", MAX_ABS_ALPHA)
    patterns = cfg.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise MergeError(f"{cfg_path}: field alpha_pattern is {show(patterns)}, expected an object")
    out["alpha_pattern"] = {
        k: number(v, str(cfg_path), f"field alpha_pattern[{show(k)}]", MAX_ABS_ALPHA) for k, v in patterns.items()
    }
    return out


def _weights(path: Path) -> tuple[Optional[str], dict[str, np.ndarray]]:
    """(the juno-py record or None, tensors as float32) of adapter_model.safetensors."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            record = (f.metadata() or {}).get(RECORD_KEY)
            tensors = {}
            for k in f.keys():
                dtype = f.get_slice(k).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    raise MergeError(
                        f"{path}: tensor {show(k)} has dtype {show(dtype)}, expected one of {', '.join(sorted(FLOAT_DTYPES))}"
                    )
                tensors[k] = f.get_tensor(k).to(torch.float32).numpy()
    except SafetensorError as e:
        raise MergeError(f"{path}: not a valid safetensors file ({one_line(str(e), 160)})") from None
    return record, tensors


def _adapts_parameters(module: str, parameter_modules: set[str]) -> bool:
    """Whether a saved module path is PEFT's wrapper of parameters of one of `parameter_modules` in a layer
    (`model.layers.N.mlp.experts`, with any `.base_layer` nesting)."""
    names = module.split(".")
    end = len(names)
    while end and names[end - 1] == "base_layer":
        end -= 1
    for inner in parameter_modules:
        k = inner.count(".") + 1
        if end >= k + 2 and names[end - k - 2] == "layers" and names[end - k - 1].isdigit():
            if ".".join(names[end - k : end]) == inner:
                return True
    return False


def import_peft(base, folder, output) -> Path:
    """Read a PEFT LoRA/DoRA folder (ours or another tool's) into adapter.bin for `base`."""
    from juno_py.store import resolve_model

    folder = Path(folder)
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise MergeError(
                f"{folder}: {p.name} is missing (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    cfg = _config(cfg_path)
    rslora = cfg["use_rslora"]
    record_text, tensors = _weights(weights_path)
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise MergeError(f"{weights_path}: tensor {show(key)} is not a LoRA A, B or DoRA magnitude")
        kind = m.group("kind").split(".")[0]
        if kind in modules.setdefault(m.group("module"), {}):
            raise MergeError(f"{weights_path}: tensor {show(key)}: a second {kind} for its module")
        modules[m.group("module")][kind] = value
    records = load_record(record_text, str(weights_path))
    base_path = Path(resolve_model(base))
    entries: list[AdapterEntry] = []
    with GGUFFile(base_path) as gguf:
        targets = ModelTargets(gguf)
        table = targets.spec.hf_modules
        moe_modules = {p.rpartition(".")[0] for p in targets.spec.hf_parameters.values()}
        for module, parts in sorted(modules.items()):
            where = f"{weights_path}: module {show(module)}"
            m = _LAYER.search(module)
            members = [t for t in TARGETS if m and table[t] == m.group("module")]
            if _adapts_parameters(module, moe_modules):
                raise MergeError(
                    f"{where}: a mixture-of-experts router or expert adapter (PEFT target_parameters), which the "
                    f"import does not read: expected attention or dense MLP modules"
                )
            if not m or not members or not m.group("layer").isascii() or len(m.group("layer")) > 9:
                raise MergeError(
                    f"{where}: not a module juno-py adapts in {targets.args.architecture} "
                    f"({', '.join(sorted(set(table.values())))} of model.layers.N)"
                )
            if "lora_A" not in parts or "lora_B" not in parts:
                raise MergeError(f"{where}: lora_A or lora_B is missing")
            layer = int(m.group("layer"))
            A, B, mag = parts["lora_A"], parts["lora_B"], parts.get("lora_magnitude_vector")
            n_rows = module_rows(targets, members[0])[2]
            if A.ndim != 2 or B.ndim != 2 or A.shape[0] < 1 or B.shape != (n_rows, A.shape[0]):
                raise MergeError(
                    f"{where}: A {A.shape} and B {B.shape} do not fit the module's {n_rows} rows: expected "
                    f"(r, in) and ({n_rows}, r) with r >= 1 (an adapter for another model?)"
                )
            if mag is not None and mag.shape != (n_rows,):
                raise MergeError(f"{where}: lora_magnitude_vector {mag.shape}, expected ({n_rows},)")
            if (mag is not None) != cfg["use_dora"]:  # PEFT would load such a module as the other kind, or fail
                raise MergeError(
                    f"{where}: {cfg_path.name} field use_dora is {str(cfg['use_dora']).lower()}, but the module "
                    + ("has a lora_magnitude_vector" if mag is not None else "has no lora_magnitude_vector")
                    + ": expected both to say DoRA, or neither"
                )
            name = LAYER_MODULE.format(layer=layer, module=m.group("module"))

            def rows_of(il: int, t: str, layer=layer, members=members) -> Optional[tuple[int, int]]:
                return module_rows(targets, t)[:2] if il == layer and t in members else None

            if name in records:
                split = split_by_record(records[name], A, B, mag, where, rows_of)
            else:
                # the rank is A's; PEFT's rank_pattern only decides the shapes it creates
                alpha = _pattern_value(cfg["alpha_pattern"], name, cfg["lora_alpha"], str(cfg_path))
                split = []
                for t in members:
                    lo, hi, _ = module_rows(targets, t)
                    if mag is None and len(members) > 1 and not B[lo:hi].any():
                        continue  # a fused module's target this adapter leaves alone
                    split.append(
                        (
                            f"{layer}:{t}",
                            A,
                            B[lo:hi],
                            None if mag is None else mag[lo:hi],
                            alpha,
                            Scaling.RSLORA if rslora else Scaling.STANDARD,
                            Init.KAIMING_UNIFORM,
                            Mode.DORA if mag is not None else Mode.LORA,
                        )
                    )
            for key, a, b, mg, alpha, scaling, init, mode in split:
                target = key.split(":", 1)[1]
                entries.append(
                    AdapterEntry(
                        key,
                        np.ascontiguousarray(a, np.float32),
                        _reorder(targets, target, np.ascontiguousarray(b, np.float32), False),
                        alpha,
                        scaling,
                        init,
                        mode,
                        _reorder(targets, target, mg, False),
                    )
                )
        return finish_import(targets, entries, folder, output)
