"""Merging adapters (or dense deltas) into a standalone GGUF, one tensor at a time.

Every metadata key of the base is copied and one provenance key added; untouched tensors are copied byte for
byte; each patched tensor is encoded under the requant policy (`requant.py`) and measured (`report.py`). The
writer spills tensors to a temporary file and renames the finished file over the output, so a failure leaves
no partial file. Memory holds one tensor's float values (in chunks of rows for very large ones) at a time.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

from juno_py.atomic import check_space, check_writable
from juno_py.errors import show
from juno_py.gguf import GGUFFile, GGUFWriter, ValueType
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.merge.report import MergeReport, TensorReport
from juno_py.merge.requant import choose_encoding, extreme_code_count, parse_requant
from juno_py.merge.targets import AdapterSource, DenseDelta, MergeError, ModelTargets, plan_patches, read_sources
from juno_py.metrics import peak_rss_bytes
from juno_py.progress import DEFAULT_INTERVAL, Progress
from juno_py.store import _sha256 as sha256_file

if TYPE_CHECKING:
    from juno_py.train.dense import DenseTargets

PROVENANCE_KEY = "juno_py.merge"
# a split base (name-0000k-of-0000n.gguf) is written as one file: its split keys would send readers looking
# for shards that do not exist
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def check_output_path(output: Path, inputs: Sequence[Path] = ()) -> None:
    """Fail early, in one line, on an output we could not write (before any work is done): a directory in its
    place, a missing folder, a folder that takes no new files (`juno_py.atomic.check_writable`), or one of the
    command's inputs."""
    check_writable(output)
    for p in inputs:
        if output.exists() and p.exists() and os.path.samefile(output, p):
            raise MergeError(f"output {output}: is an input of this command; choose another path")


def output_bytes(gguf: GGUFFile, plan, policy) -> int:
    """About the tensor data the merged file holds: each tensor at its own size, a patched one at the size of the
    type a named --requant policy writes it in ('source' and 'auto' keep the base's size)."""
    total = 0
    for name, info in gguf.tensors.items():
        if name in plan and not isinstance(policy, str) and info.n_elements % GGML_BLOCK_SIZES[policy][0] == 0:
            block, size = GGML_BLOCK_SIZES[policy]
            total += info.n_elements // block * size
        else:
            total += info.nbytes
    return total


def _provenance(base: Path, sources: Sequence[AdapterSource], deltas, policy, min_retention) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tool = f"juno-py {version('juno-py')}"
    except PackageNotFoundError:
        tool = "juno-py"
    return json.dumps(
        {
            "tool": tool,
            "base": base.name,
            "base_bytes": base.stat().st_size,
            "adapters": [
                {
                    "file": s.path.name,
                    "sha256": sha256_file(s.path),
                    "scale": s.scale,
                    "mode": "dora" if s.is_dora else "lora",
                    "entries": len(s.entries),
                }
                for s in sources
            ],
            "dense_deltas": sorted(deltas or {}),
            "requant": policy if isinstance(policy, str) else policy.name,
            "min_retention": min_retention if policy == "auto" else None,
        },
        sort_keys=True,
    )


def merge_model(
    base,
    output,
    adapters: Sequence[Union[str, Path, tuple]] = (),
    deltas: Optional[Mapping[str, DenseDelta]] = None,
    requant="source",
    min_retention: float = 0.9,
    force: bool = False,
    eval_data: Sequence = (),
    eval_max_seq_len: int = 512,
    recorder=None,
    log: Optional[Callable[[str], None]] = None,
    progress: Optional[bool] = False,
    progress_interval: float = DEFAULT_INTERVAL,
) -> MergeReport:
    """Merge adapter files ('a.bin', 'a.bin:0.5') and/or dense deltas (tensor name or '<layer>:<target>' →
    array, or a callable returning it) into `base`, writing `output`.

    requant: 'source' (each tensor keeps its type; only changed blocks are re-encoded), 'auto' (per tensor the
    smallest type from its own upward whose retention meets `min_retention`), or a type (name or GGMLType).
    eval_data: data files to measure the merged model's perplexity and its KL divergence from playback.
    progress: over the patched tensors on stderr (`juno_py.progress`: None picks a bar or lines by the stream)."""
    from juno_py.store import resolve_model

    started = time.time()
    policy = parse_requant(requant)
    if not 0.0 <= min_retention <= 1.0:
        raise MergeError(f"--min-retention {min_retention}: expected a number between 0 and 1")
    base_path = Path(resolve_model(base))
    output = Path(output)
    sources = read_sources(adapters)
    if not sources and not deltas:
        raise MergeError("nothing to merge: give an adapter (--adapter) or dense deltas")
    check_output_path(output, [base_path] + [s.path for s in sources])
    for p in eval_data:  # before the work, not after it
        if not Path(p).is_file():
            raise MergeError(f"--eval-data {p}: no such file")
    say = log or (lambda msg: None)

    with GGUFFile(base_path) as gguf:
        targets = ModelTargets(gguf)
        plan = plan_patches(targets, sources, deltas, force)
        report = MergeReport(
            str(base_path),
            str(output),
            policy if isinstance(policy, str) else policy.name,
            min_retention if policy == "auto" else None,
            file_bytes_base=base_path.stat().st_size,
        )
        check_space(output, 2 * output_bytes(gguf, plan, policy))
        bar = Progress(len(plan), "merge", "tensor", enabled=progress, interval=progress_interval)
        with bar, GGUFWriter(output, alignment=gguf.alignment, version=gguf.version) as writer:
            writer.copy_fields(gguf, skip=(PROVENANCE_KEY,) + SPLIT_KEYS)
            writer.add_field(
                PROVENANCE_KEY, _provenance(base_path, sources, deltas, policy, min_retention), ValueType.STRING
            )
            for name, info in gguf.tensors.items():
                patches = plan.get(name)
                if not patches:
                    writer.copy_tensor(gguf, name)
                    report.tensors_copied += 1
                    continue
                choice = choose_encoding(info, patches, policy, min_retention)
                for p in patches:
                    p.release()
                enc = choice.encoding
                # the error is computed from the decoded output, so it is finite only if every written value is
                if not (math.isfinite(enc.max_abs_error) and math.isfinite(enc.delta_sq)):
                    raise MergeError(
                        f"tensor {show(name)}: the merged weights are not finite in {enc.ggml_type.name} (the adapter's "
                        f"delta overflows it); nothing written"
                    )
                writer.add_tensor(name, enc.raw, enc.ggml_type, info.shape)
                base_extreme = extreme_code_count(info.ggml_type, info.raw)
                report.tensors.append(
                    TensorReport(
                        name=name,
                        targets=[p.key for p in patches],
                        source_type=info.type_name,
                        output_type=enc.ggml_type.name,
                        delta_norm=enc.delta_norm,
                        rmse=enc.rmse,
                        max_abs_error=enc.max_abs_error,
                        retention=enc.retention,
                        blocks_reencoded=enc.blocks_reencoded,
                        blocks_rewritten=enc.blocks_rewritten,
                        blocks_total=enc.blocks_total,
                        extreme_fraction=enc.extreme_fraction,
                        extreme_fraction_base=base_extreme[0] / base_extreme[1] if base_extreme else None,
                        bytes_base=info.nbytes,
                        bytes_output=enc.nbytes,
                        bytes_source=choice.source_nbytes,
                        retention_source=choice.source_retention if policy == "auto" else None,
                        tried=[list(t) for t in choice.tried] if choice.climbed else [],
                        requested_type=choice.requested,
                        reason=choice.reason,
                        substituted=choice.substituted,
                    )
                )
                why = f" ({choice.reason})" if choice.substituted else ""
                say(f"{name}: {info.type_name} -> {enc.ggml_type.name}, retention {enc.retention:.4f}{why}")
                bar.update(1, f"{name} {info.type_name} -> {enc.ggml_type.name}")
            writer.finish()
    report.file_bytes_output = output.stat().st_size
    if eval_data:
        from juno_py.merge.evaluate import compare_with_playback

        if deltas:
            raise MergeError("--eval-data compares against adapter playback: not available for dense deltas")
        report.evaluation = compare_with_playback(
            base_path, [(s.path, s.scale) for s in sources], output, eval_data, eval_max_seq_len, force=force
        )
    report.seconds = time.time() - started
    report.peak_rss_bytes = peak_rss_bytes()
    if recorder is not None:
        report.emit(recorder)
    return report


def merge_trained(
    targets: "DenseTargets",
    base,
    output: Union[str, Path],
    requant="auto",
    min_retention: float = 0.9,
    recorder=None,
    log: Optional[Callable[[str], None]] = None,
    progress: Optional[bool] = False,
    progress_interval: float = DEFAULT_INTERVAL,
) -> MergeReport:
    """Write `output`: the base GGUF with every trained target of `targets` (`juno-py full`'s dense weights)
    replaced, through the dense-delta path (ΔW = W_trained − W_base, each tensor encoded under `requant`)."""
    return merge_model(
        base,
        output,
        deltas=targets.deltas(),
        requant=requant,
        min_retention=min_retention,
        recorder=recorder,
        log=log,
        progress=progress,
        progress_interval=progress_interval,
    )
