"""`juno-py local` and `juno-py eval` on the default model, through the real command line."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.models import load_model


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.mark.slow
def test_local_answers_paris(runner, smollm2_path):
    res = runner.invoke(
        cli, ["local", "--prompt", "What is the capital of France?", "--temperature", "0", "--max-tokens", "24"]
    )
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout
    assert "tokens/s" in res.stderr and "tokens/s" not in res.stdout


@pytest.mark.slow
def test_eval_is_the_token_weighted_loss(runner, smollm2_path, tmp_path):
    data = tmp_path / "d.jsonl"
    records = [{"text": "The capital of France is Paris."}, {"prompt": "Two plus two is", "completion": " four."}]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    res = runner.invoke(cli, ["eval", "--data", str(data), "--json", "--weights-cache", "none"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    # independent: sum the per-token losses of each record by hand
    model = load_model(smollm2_path)
    tok = model.tokenizer
    total, n = 0.0, 0
    with torch.no_grad():
        ids = tok.encode(records[0]["text"])
        logits = model.logits(ids)
        total += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
        n += len(ids) - 1
        p = tok.encode(records[1]["prompt"])
        c = tok.encode(records[1]["completion"], add_special=False) + [tok.eos_id]
        logits = model.logits(p + c)
        total += float(torch.nn.functional.cross_entropy(logits[len(p) - 1 : -1], torch.tensor(c), reduction="sum"))
        n += len(c)
    assert out["tokens"] == n
    assert out["loss"] == pytest.approx(total / n, rel=1e-5)
    # ppl = exp(loss): a relative error e in the loss is a relative error of about e·loss in ppl, so ppl is checked
    # through its log with the loss's tolerance, and against exp of the CLI's own loss
    assert math.log(out["ppl"]) == pytest.approx(total / n, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(out["loss"]), rel=1e-12)


def test_eval_names_the_bad_line(runner, tmp_path, tiny_gguf):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"txt": 3}\n')
    res = runner.invoke(cli, ["eval", "--model-path", str(tiny_gguf("llama")), "--data", str(data)])
    assert res.exit_code == 1
    assert f"{data}:2" in res.stderr and len(res.stderr.strip().splitlines()) == 1
