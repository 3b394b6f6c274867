"""llama.cpp's LoRA adapter GGUF (`llama-cli --lora`, Ollama's ADAPTER): export and import.

What llama.cpp expects (`src/llama-adapter.cpp`, `llama_adapter_lora_init_impl`, and `src/llama-adapter.h`):
- metadata `general.type = "adapter"`, `general.architecture` equal to the model's, `adapter.type = "lora"`,
  `adapter.lora.alpha` read with `gguf_get_val_f32` (so it must be FLOAT32; absent means 0);
- tensors `<model tensor name>.lora_a` and `.lora_b` (any other suffix is an error, except `_norm.weight`,
  skipped); shapes `a.ne = [n_in, r]`, `b.ne = [r, n_out]` (numpy `(r, n_in)` and `(n_out, r)`): it checks
  `model.ne[0] == a.ne[0]`, `model.ne[1] == b.ne[1]` and `a.ne[1] == b.ne[0]`;
- the scale (`llama_adapter_lora_weight::get_scale`): `alpha ? user_scale * alpha / r : user_scale` with
  r = `b.ne[0]` per tensor and one alpha per file.

So a pair's effective scale is alpha/R with R its rank. We keep B as trained and write the one alpha that makes
alpha/R equal every pair's scale when there is one (same ranks and scales, rsLoRA included: alpha·√r); otherwise
alpha = 0 and each target's scale is baked into its B. A fused tensor adapted on several targets (`attn_qkv`,
fused `ffn_up`) is one pair: A stacked, B block-diagonal over the targets' rows. llama.cpp has no DoRA.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from juno_py.errors import show
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
from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType
from juno_py.gguf.quants import dequantize, quantize
from juno_py.lora.format import MAX_ABS_ALPHA, AdapterEntry, Init, Mode, Scaling, read_adapter
from juno_py.merge.targets import MergeError, ModelTargets, entries_by_tensor
from juno_py.progress import DEFAULT_INTERVAL, Progress

RECORD_KEY = "juno_py.adapter_parts"
ALPHA_KEY = "adapter.lora.alpha"
DTYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16}


def _pair_alpha(parts: list[Part], rank: int) -> Optional[float]:
    """The alpha for which llama.cpp's alpha/rank equals every part's scale, None if the parts' scales differ."""
    e0 = parts[0].entry
    if any((p.entry.alpha, p.entry.rank, p.entry.scaling) != (e0.alpha, e0.rank, e0.scaling) for p in parts):
        return None if len({p.entry.scale for p in parts}) > 1 else e0.scale * rank
    if e0.scaling == Scaling.STANDARD:
        return e0.alpha if rank == e0.rank else e0.alpha * (rank / e0.rank)
    return e0.scale * rank


def llama_cpp_scale(alpha: float, rank: int, user_scale: float = 1.0) -> float:
    """llama.cpp's effective scale of one pair (llama_adapter_lora_weight::get_scale), in float32 as there."""
    a, r, u = np.float32(alpha), np.float32(rank), np.float32(user_scale)
    return float(u * a / r) if a else float(u)


def export_gguf_lora(
    base,
    adapter,
    output,
    dtype: str = "f32",
    progress: Optional[bool] = False,
    progress_interval: float = DEFAULT_INTERVAL,
) -> Path:
    """Write llama.cpp's adapter GGUF for `adapter` (adapter.bin) on `base`; returns the output path.
    `progress`: over the adapted tensors on stderr (`juno_py.progress`)."""
    from juno_py.merge.merge import check_output_path
    from juno_py.store import resolve_model

    if dtype not in DTYPES:
        raise MergeError(f"--dtype {show(dtype)}: expected one of {', '.join(DTYPES)}")
    qtype = DTYPES[dtype]
    base_path, output = Path(resolve_model(base)), Path(output)
    _, entries = read_adapter(adapter)
    dora = [e.key for e in entries if e.mode == Mode.DORA]
    if dora:
        raise MergeError(
            f"{adapter}: entry {show(dora[0])} is DoRA; llama.cpp's LoRA adapters cannot express DoRA's "
            f"magnitude: merge it into the model instead (juno-py merge --adapter {adapter})"
        )
    experts = [e.key for e in entries if e.on_experts]
    if experts:
        raise MergeError(
            f"{adapter}: entry {experts[0][:80]!r} adapts experts; juno-py writes llama.cpp adapters for 2-D "
            f"tensors only (attention, dense MLP, router): merge it instead (juno-py merge --adapter {adapter})"
        )
    check_output_path(output, [base_path, Path(adapter)])
    with GGUFFile(base_path) as gguf:
        targets = ModelTargets(gguf)
        pairs = []
        for tensor, items in entries_by_tensor(targets, entries, adapter).items():
            parts = [Part(e, slot.rows, e.B) for e, slot in items]
            rank = sum(p.entry.rank for p in parts)
            pairs.append((tensor, gguf.tensor(tensor).n_rows, parts, _pair_alpha(parts, rank)))
        alphas = {a for *_, a in pairs}
        alpha = alphas.pop() if len(alphas) == 1 else None
        if not alpha:  # None (scales differ) or 0 (which llama.cpp reads as "no alpha"): bake
            alpha = 0.0
        with GGUFWriter(output) as w:
            w.add_field("general.architecture", targets.args.architecture, ValueType.STRING)
            w.add_field("general.type", "adapter", ValueType.STRING)
            w.add_field("general.name", Path(adapter).stem, ValueType.STRING)
            w.add_field("adapter.type", "lora", ValueType.STRING)
            w.add_field(ALPHA_KEY, float(alpha), ValueType.FLOAT32)
            records = {}
            bar = Progress(len(pairs), "export", "tensor", enabled=progress, interval=progress_interval)
            for tensor, n_rows, parts, _ in pairs:
                factors = [None if alpha else p.entry.scale for p in parts]
                A, B, cols = stack_parts(parts, n_rows, factors)
                for suffix, x in (("lora_a", A), ("lora_b", B)):
                    raw = quantize(qtype, x)
                    if not torch.isfinite(dequantize(qtype, raw, x.shape[-1])).all():
                        raise MergeError(
                            f"{adapter}: tensor {tensor}.{suffix} is not finite in {dtype} (values up to "
                            f"{float(np.abs(x).max()):g}); nothing written"
                        )
                    w.add_tensor(f"{tensor}.{suffix}", raw, qtype, x.shape)
                records[tensor] = part_records(parts, cols, factors)
                bar.update(1, tensor)
            bar.close()
            w.add_field(RECORD_KEY, dump_record(records), ValueType.STRING)
    return output


def _pairs(f: GGUFFile) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name in f.tensors:
        for suffix in (".lora_a", ".lora_b"):
            if name.endswith(suffix):
                out.setdefault(name[: -len(suffix)], {})[suffix[1:]] = name
                break
        else:
            if name.endswith("_norm.weight"):
                warnings.warn(
                    f"{f.path}: tensor {show(name)} skipped (llama.cpp skips norm tensors of adapters too)",
                    stacklevel=3,
                )
                continue
            raise MergeError(f"{f.path}: tensor {show(name)} has an unexpected suffix, expected .lora_a or .lora_b")
    for base, ab in out.items():
        if len(ab) != 2:
            missing = "lora_b" if "lora_a" in ab else "lora_a"
            raise MergeError(f"{f.path}: the LoRA pair of {show(base)} is missing its {missing}")
    return out


def import_gguf_lora(base, path, output) -> Path:
    """Read a llama.cpp LoRA adapter GGUF (ours or another tool's) into adapter.bin for `base`."""
    from juno_py.store import resolve_model

    path = Path(path)
    with GGUFFile(path) as f, GGUFFile(Path(resolve_model(base))) as gguf:
        md = f.metadata
        if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
            raise MergeError(
                f"{path}: general.type {show(md.get('general.type'))} / adapter.type "
                f"{show(md.get('adapter.type'))}, expected 'adapter' / 'lora' (not a LoRA adapter GGUF)"
            )
        targets = ModelTargets(gguf)
        if md.get("general.architecture") != targets.args.architecture:
            raise MergeError(
                f"{path}: architecture {show(md.get('general.architecture'))} does not match the model's "
                f"{show(targets.args.architecture)} ({gguf.path})"
            )
        field = f.fields.get(ALPHA_KEY)
        if field is not None and field.vtype != ValueType.FLOAT32:
            raise MergeError(
                f"{path}: metadata {ALPHA_KEY} is {field.vtype.name}, expected FLOAT32 (llama.cpp "
                f"aborts on any other type)"
            )
        alpha = number(field.value, str(path), f"metadata {ALPHA_KEY}", MAX_ABS_ALPHA) if field is not None else 0.0
        records = load_record(md.get(RECORD_KEY), str(path))
        entries: list[AdapterEntry] = []
        for tensor, ab in _pairs(f).items():
            where = f"{path}: tensor {show(tensor)}"
            if tensor not in gguf.tensors:
                raise MergeError(f"{where}: does not exist in the model {gguf.path} (an adapter for another model?)")
            slots = targets.slots_of_tensor(tensor)
            if not slots:
                raise MergeError(f"{where}: not a linear target juno-py adapts (wq wk wv wo wgate wup wdown)")
            A, B = f.dequantize(ab["lora_a"]).numpy(), f.dequantize(ab["lora_b"]).numpy()
            info = gguf.tensor(tensor)
            if (
                A.ndim != 2
                or B.ndim != 2
                or A.shape[1] != info.n_cols
                or B.shape[0] != info.n_rows
                or A.shape[0] != B.shape[1]
                or A.shape[0] < 1
            ):
                raise MergeError(
                    f"{where}: lora_a {A.shape} and lora_b {B.shape} do not fit the model tensor "
                    f"{info.shape}: expected (r, {info.n_cols}) and ({info.n_rows}, r) with r >= 1"
                )
            if tensor in records:

                def rows_of(il: int, t: str, tensor=tensor) -> Optional[tuple[int, int]]:
                    slot = targets.layout.blocks[il].targets.get(t) if il < targets.n_layer else None
                    return slot.rows if slot is not None and slot.tensor == tensor else None

                split = split_by_record(records[tensor], A, B, None, where, rows_of)
            else:
                rank = A.shape[0]
                # standard scaling with alpha' such that alpha'/r is llama.cpp's scale
                a_entry = alpha if alpha else float(rank)
                split = [
                    (
                        f"{il}:{t}",
                        A,
                        B[s.rows[0] : s.rows[1]],
                        None,
                        a_entry,
                        Scaling.STANDARD,
                        Init.KAIMING_UNIFORM,
                        Mode.LORA,
                    )
                    for il, t, s in slots
                    if len(slots) == 1 or B[s.rows[0] : s.rows[1]].any()
                ]
            for key, a, b, _, al, scaling, init, mode in split:
                entries.append(
                    AdapterEntry(
                        key,
                        np.ascontiguousarray(a, np.float32),
                        np.ascontiguousarray(b, np.float32),
                        al,
                        scaling,
                        init,
                        mode,
                    )
                )
        return finish_import(targets, entries, path, output)
