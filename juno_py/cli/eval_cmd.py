"""`juno-py eval`: token-weighted loss and perplexity of a model (with adapters) on a data file."""

from __future__ import annotations

import json
import math

import click

from juno_py.cli.common import one_line_errors
from juno_py.cli.options import model_options, progress_options
from juno_py.errors import JunoError


@click.command("eval")
@model_options
@click.option(
    "--data",
    "data",
    required=True,
    multiple=True,
    help="Data file(s): .txt, JSON array or JSONL of text, prompt/completion, messages or Q/A records.",
)
@click.option(
    "--max-seq-len",
    default=1024,
    show_default=True,
    help="Longest sequence; longer texts are split, longer chat/prompt records dropped (counted).",
)
@click.option("--batch-size", default=8, show_default=True, help="Sequences per forward pass.")
@click.option("--skip-bad-records", is_flag=True, help="Skip malformed records (counted) instead of stopping.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@progress_options
@one_line_errors
def eval_cmd(data, max_seq_len, batch_size, skip_bad_records, as_json, progress, progress_interval, **model_kw) -> None:
    """Loss and perplexity over the supervised tokens of DATA (assistant turns, completions, or all text)."""
    import torch

    from juno_py.playback import open_model
    from juno_py.train.data import load_examples
    from juno_py.train.steps import evaluate

    model = open_model(**model_kw, announce=False)  # said with the data's summary, after the records are read
    examples, stats = load_examples(data, model.tokenizer, max_seq_len, skip_bad=skip_bad_records)
    click.echo(f"juno-py eval: {model.resolution}; {stats.line()}", err=True)
    from juno_py.progress import Progress

    with (
        torch.no_grad(),
        Progress(len(examples), "eval", "sequence", enabled=progress, interval=progress_interval) as bar,
    ):
        result = evaluate(model, examples, batch_size, pad_id=model.tokenizer.pad_id or 0, progress=bar)
    if result["tokens"] and not math.isfinite(result["loss"]):
        raise JunoError(
            f"the loss over {result['tokens']} tokens is not finite: the model's weights or the adapters played on "
            f"it ({model_kw.get('lora_play') or 'none'}) hold extreme values"
        )
    result = {
        "model": str(model.gguf.path),
        "adapters": model_kw.get("lora_play"),
        **result,
        "sequences": len(examples),
    }
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"loss {result['loss']:.4f}  perplexity {result['ppl']:.3f}  over {result['tokens']} tokens")
