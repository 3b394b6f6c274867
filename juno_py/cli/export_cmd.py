"""`juno-py export` (adapter.bin → PEFT folder or llama.cpp GGUF-LoRA) and `juno-py import` (either → adapter.bin).
stdout: the written path only."""

from __future__ import annotations

from pathlib import Path

import click

from juno_py.cli.common import one_line_errors, refuse_overwrite, warnings_to_stderr
from juno_py.cli.options import deprecated_alias, progress_options, threads_option
from juno_py.store import DEFAULT_MODEL

FORMATS = ("peft", "gguf-lora")


@click.command("export")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    required=True,
    help="peft: adapter_config.json + adapter_model.safetensors for transformers; gguf-lora: llama.cpp's "
    "--lora file (LoRA only).",
)
@click.option(
    "--model-path",
    default=DEFAULT_MODEL,
    show_default=True,
    help="The base the adapter was trained on: a .gguf file or a model-store name.",
)
@click.option("--adapter", "lora_path", default=None, help="adapter.bin to export (required).")
@deprecated_alias("--lora-path", "--adapter", "lora_path", required=True)
@click.option(
    "--output",
    default=None,
    help="Folder (peft) or .gguf file (gguf-lora); default: <adapter name>-peft or <adapter name>.lora.gguf.",
)
@click.option(
    "--dtype",
    type=click.Choice(["f32", "f16", "bf16"]),
    default="f32",
    show_default=True,
    help="Tensor type of a GGUF-LoRA export.",
)
@progress_options
@threads_option
@one_line_errors
def export(fmt, model_path, lora_path, output, dtype, progress, progress_interval, threads) -> None:
    """Export an adapter for PEFT or llama.cpp. Prints the output path."""
    from juno_py import threads as cpu_threads
    from juno_py.atomic import check_writable
    from juno_py.exchange import export_gguf_lora, export_peft

    cpu_threads.setup(threads)
    stem = Path(lora_path).stem
    target = Path(output or (f"{stem}-peft" if fmt == "peft" else f"{stem}.lora.gguf"))
    # before a model is pulled or read. A PEFT folder's files go inside it, and the folder is made when missing:
    # then the first missing folder of its path must be creatable
    probe = target
    if fmt == "peft":
        if target.is_dir():
            probe = target / "adapter_config.json"
        else:
            while not probe.parent.exists() and probe.parent != probe.parent.parent:
                probe = probe.parent
    check_writable(probe, "--output")
    with warnings_to_stderr():
        if fmt == "peft":
            out = export_peft(model_path, lora_path, target, progress, progress_interval)
        else:
            out = export_gguf_lora(model_path, lora_path, target, dtype, progress, progress_interval)
    click.echo(str(out))


@click.command("import")
@click.argument("source")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default=None,
    help="Format of SOURCE (default: a folder is peft, a file gguf-lora).",
)
@click.option(
    "--model-path",
    default=DEFAULT_MODEL,
    show_default=True,
    help="The base model the adapter belongs to (fingerprints, layout, Q/K row order).",
)
@click.option("--output", "lora_path", default=None, help="adapter.bin to write (required).")
@deprecated_alias("--lora-path", "--output", "lora_path", required=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing adapter.bin (without it, import refuses to).")
@one_line_errors
def import_(source, fmt, model_path, lora_path, overwrite) -> None:
    """Import a PEFT folder or a llama.cpp GGUF-LoRA file as adapter.bin. Prints its path."""
    from juno_py.exchange import import_gguf_lora, import_peft

    refuse_overwrite(Path(lora_path), "--output", overwrite=overwrite, state=False)

    fmt = fmt or ("peft" if Path(source).is_dir() else "gguf-lora")
    fn = import_peft if fmt == "peft" else import_gguf_lora
    with warnings_to_stderr():
        out = fn(model_path, source, lora_path)
    click.echo(str(out))
