"""`juno-py merge`: an adapter merged into a standalone GGUF. stdout: the merged file's path; the per-tensor report
goes to stderr (and to --report as JSON)."""

from __future__ import annotations

from pathlib import Path

import click

from juno_py.cli.common import (
    FiniteFloatRange,
    check_output_options,
    one_line_errors,
    say_written,
    warnings_to_stderr,
)
from juno_py.cli.options import deprecated_alias, progress_options, threads_option
from juno_py.store import DEFAULT_MODEL


def default_output(lora_path: str) -> Path:
    first = lora_path.split(",")[0].rpartition(":")[0] or lora_path.split(",")[0]
    return Path(Path(first).stem + ".merged.gguf")


@click.command("merge")
@click.option(
    "--model-path",
    default=DEFAULT_MODEL,
    show_default=True,
    help="The base: a .gguf file or a model-store name (pulled on first use).",
)
@click.option(
    "--adapter",
    "lora_path",
    default=None,
    help="Adapter(s) to merge (required): A[:scale][,B[:scale]] (LoRAs add up; a DoRA adapter merges alone at 1).",
)
@deprecated_alias("--lora-path", "--adapter", "lora_path", required=True)
@click.option("--output", default=None, help="Merged GGUF (default: <adapter name>.merged.gguf in the current folder).")
@click.option(
    "--requant",
    default="source",
    show_default=True,
    help="source: each tensor keeps its type (only changed blocks re-encoded); auto: per tensor the "
    "smallest type from its own upward whose retention meets --min-retention; or a GGML type "
    "(f32, f16, q8_0, q6_k, ...) for every patched tensor.",
)
@click.option(
    "--min-retention",
    default=0.9,
    show_default=True,
    type=FiniteFloatRange(0, 1),
    help="Target of --requant auto: 1 - |ΔW - ΔW_kept| / |ΔW| per tensor.",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the report (per tensor and summary) as JSON.",
)
@click.option(
    "--eval-data",
    multiple=True,
    help="Data file(s): report the merged model's perplexity and its mean KL divergence from the base "
    "with the adapter played at run time.",
)
@click.option(
    "--eval-max-seq-len", default=512, show_default=True, type=click.IntRange(2), help="Longest evaluation sequence."
)
@click.option("--force", is_flag=True, help="Merge a DoRA adapter whose base fingerprint differs.")
@click.option(
    "--metrics-out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a metrics.json summary with the merge event.",
)
@click.option(
    "--events-out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append the merge metrics event as one JSON line.",
)
@progress_options
@threads_option
@one_line_errors
def merge(
    model_path,
    lora_path,
    output,
    requant,
    min_retention,
    report_path,
    eval_data,
    eval_max_seq_len,
    force,
    metrics_out,
    events_out,
    progress,
    progress_interval,
    threads,
) -> None:
    """Merge an adapter into the base model and write a GGUF that llama.cpp runs. Prints its path."""
    from juno_py import threads as cpu_threads
    from juno_py.atomic import check_writable
    from juno_py.merge import merge_model

    cpu_threads.setup(threads)
    from juno_py.metrics import MetricsRecorder

    output = Path(output) if output else default_output(lora_path)
    check_writable(output, "--output")  # before a model is pulled or read
    check_output_options(report=report_path, metrics_out=metrics_out, events_out=events_out)
    recorder = MetricsRecorder(events_out=events_out) if (metrics_out or events_out) else None
    try:
        with warnings_to_stderr():
            report = merge_model(
                model_path,
                output,
                [s for s in lora_path.split(",") if s.strip()],
                requant=requant,
                min_retention=min_retention,
                force=force,
                eval_data=list(eval_data),
                eval_max_seq_len=eval_max_seq_len,
                recorder=recorder,
                progress=progress,
                progress_interval=progress_interval,
            )
    finally:
        if recorder is not None:
            if metrics_out:
                recorder.write_summary(metrics_out)
            recorder.close()
    click.echo(report.table(), err=True)
    say_written("merged model", output)
    if report_path:
        report.write_json(report_path)
    click.echo(str(output))
