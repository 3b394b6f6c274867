"""`juno-py inspect`: what is in a GGUF file."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Optional

import click

from juno_py.cli.common import one_line_errors

if TYPE_CHECKING:
    from juno_py.gguf import GGUFFile

_HYPER = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "vocab_size",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
)


def summarize(f: GGUFFile) -> dict:
    from juno_py.gguf.quants import bits_per_weight

    meta = f.metadata
    arch = meta.get("general.architecture", "?")
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in f.tensors.values():
        by_type[t.type_name][0] += 1
        by_type[t.type_name][1] += t.nbytes
        by_type[t.type_name][2] = int(t.ggml_type)
    tokens = meta.get("tokenizer.ggml.tokens")
    return {
        "path": str(f.path),
        "gguf_version": f.version,
        "architecture": arch,
        "name": meta.get("general.name"),
        "hyperparameters": {k: meta[f"{arch}.{k}"] for k in _HYPER if f"{arch}.{k}" in meta},
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens) if isinstance(tokens, list) else None,
            "chat_template": "tokenizer.chat_template" in meta,
        },
        "alignment": f.alignment,
        "metadata_keys": len(f.fields),
        "tensor_count": len(f.tensors),
        "tensor_bytes": sum(t.nbytes for t in f.tensors.values()),
        "types": {
            k: {"tensors": v[0], "bytes": v[1], "bits_per_weight": bits_per_weight(v[2])}
            for k, v in sorted(by_type.items())
        },
    }


@click.command()
@click.argument("model", required=False)
@click.option("--tensors", is_flag=True, help="List every tensor: name, type, row-major shape, bytes.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option(
    "--types",
    "list_types",
    is_flag=True,
    help="List every GGML type juno-py reads (values and bytes per block, bits per weight, whether a merge can "
    "write it) instead of a model.",
)
@one_line_errors
def inspect(model: Optional[str], tensors: bool, as_json: bool, list_types: bool) -> None:
    """Show what MODEL (a .gguf path or a model-store name) holds."""
    from juno_py.gguf import GGUFFile
    from juno_py.gguf.quants import type_table, type_table_markdown
    from juno_py.store import resolve_model

    if list_types:
        if model is not None:
            raise click.UsageError("--types lists the supported types; give it without MODEL")
        click.echo(json.dumps(type_table(), indent=2) if as_json else type_table_markdown())
        return
    if model is None:
        raise click.UsageError("missing argument MODEL (or --types)")
    with GGUFFile(resolve_model(model)) as f:
        info = summarize(f)
        rows = [
            {"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.nbytes} for t in f.tensors.values()
        ]
    if as_json:
        if tensors:
            info["tensors"] = rows
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"{info['path']}  (GGUF v{info['gguf_version']}, alignment {info['alignment']})")
    click.echo(f"architecture: {info['architecture']}  name: {info['name']}")
    for k, v in info["hyperparameters"].items():
        click.echo(f"  {k}: {v}")
    tok = info["tokenizer"]
    click.echo(
        f"tokenizer: {tok['model']} (pre {tok['pre']}), {tok['vocab_size']} tokens, "
        f"chat template: {'yes' if tok['chat_template'] else 'no'}"
    )
    click.echo(f"tensors: {info['tensor_count']}, {info['tensor_bytes'] / 1e6:.1f} MB")
    for k, v in info["types"].items():
        click.echo(
            f"  {k:8s} {v['tensors']:5d} tensors  {v['bytes'] / 1e6:9.2f} MB  {v['bits_per_weight']:g} bits/weight"
        )
    if tensors:
        for r in rows:
            click.echo(f"{r['name']:40s} {r['type']:7s} {str(tuple(r['shape'])):20s} {r['bytes']}")
