"""A model whose logits overflow: `juno-py local` and `juno-py eval` stop with one line, not a traceback, a
reply sampled from NaN or a reported loss of nan."""

import json

import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.gguf import GGUFFile
from juno_py.testing.tiny_models import write_tiny_gguf


def test_local_and_eval_refuse_non_finite_logits(tiny_gguf, tmp_path):
    with GGUFFile(tiny_gguf("llama")) as f:
        n_embd = int(f.tensor("output_norm.weight").shape[0])
    model = write_tiny_gguf(
        tmp_path / "inf.gguf", "llama", extra={"output_norm.weight": torch.full((n_embd,), float("inf"))}
    )
    runner = CliRunner()
    res = runner.invoke(cli, ["local", "--model-path", str(model), "--prompt", "hi", "--max-tokens", "3"])
    assert res.exit_code == 1, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("juno-py: error: ")]
    assert len(errors) == 1 and "logits for generated token 1 are not finite" in errors[0], res.stderr
    assert res.stdout == "" and "Traceback" not in res.output

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the capital of France is Paris"}) + "\n")
    res = runner.invoke(cli, ["eval", "--model-path", str(model), "--data", str(data), "--json"])
    assert res.exit_code == 1, res.output
    assert "juno-py: error: the loss over" in res.stderr and "is not finite" in res.stderr, res.stderr
    assert res.stdout == ""

    # a sound model is unaffected
    res = runner.invoke(cli, ["eval", "--model-path", str(tiny_gguf("llama")), "--data", str(data), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["tokens"] > 0, res.output
