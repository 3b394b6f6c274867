"""A tiny mixture-of-experts model trains on the CPU through `juno-py lora`: the loss on a few facts falls clearly,
the router's load reaches the metrics, and the adapter (attention, router and per-expert or shared experts)
plays back to the loss the run ended with."""

import json
import math

import pytest
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.lora import load_adapters, read_adapter
from juno_py.models import load_model
from juno_py.testing.records import write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf
from juno_py.train.data import load_dataset
from juno_py.train.steps import evaluate

FACTS = [
    {"Q": "What is the capital of Velmora?", "A": "Quenhaven."},
    {"Q": "Who built the tower?", "A": "Arlo Venn."},
    {"Q": "What colour is the lake?", "A": "Deep teal."},
    {"Q": "When did the bridge open?", "A": "In 1847."},
]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf", "qwen3moe", seed=3)


@pytest.mark.parametrize("experts", ["per-expert", "shared"])
def test_tiny_moe_learns_facts(moe_path, tmp_path, experts):
    data = write_jsonl(tmp_path / "facts.jsonl", FACTS)
    out = tmp_path / "facts.bin"
    args = ["lora", "--model-path", moe_path, "--data", data, "--lora-path", out, "--max-steps", 40]
    args += ["--batch-size", 4, "--lora-rank", 8, "--lora-lr", 1e-2, "--lora-targets", "all,router"]
    args += ["--lora-experts", experts, "--metrics-out", tmp_path / "m.json", "--events-out", tmp_path / "e.jsonl"]
    r = CliRunner().invoke(cli, [*map(str, args), "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    series = json.loads((tmp_path / "m.json").read_text())["series"]
    first = json.loads((tmp_path / "e.jsonl").read_text().splitlines()[0])
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "e.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train_step"
    ]
    assert first["architecture"] == "qwen3moe"
    assert losses[-1] < 0.25 * losses[0], losses  # clearly learnt
    assert series["expert_load.imbalance_max"]["count"] == len(losses) >= 20
    assert series["expert_load.imbalance_mean"]["last"] >= 1.0
    keys = [e.key for e in read_adapter(out)[1]]
    assert "0:wrouter" in keys and ("1:wdown_exps.*" in keys) == (experts == "shared")
    model = load_model(moe_path)
    examples = load_dataset([data], model.tokenizer, 256)[0]
    before = evaluate(model, examples, 4)["loss"]
    load_adapters(model, [str(out)])
    after = evaluate(model, examples, 4)["loss"]
    assert after < 0.25 * before and after == pytest.approx(losses[-1], rel=0.5)


@pytest.mark.parametrize("mode", ["lora", "dora"])
def test_tiny_gpt_oss_trains_attention_and_experts(tmp_path, mode):
    path = write_tiny_gguf(tmp_path / "tiny-gpt-oss.gguf", "gpt-oss", seed=3)
    data = write_jsonl(tmp_path / "facts.jsonl", FACTS)
    out = tmp_path / "facts.bin"
    args = ["lora", "--model-path", path, "--data", data, "--lora-path", out, "--max-steps", 12]
    args += ["--batch-size", 4, "--lora-rank", 4, "--lora-lr", 1e-2, "--lora-targets", "attn,experts"]
    args += ["--lora-mode", mode, "--events-out", tmp_path / "e.jsonl"]
    r = CliRunner().invoke(cli, [*map(str, args), "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    events = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert events[0]["architecture"] == "gpt-oss"
    losses = [e["loss"] for e in events if e["kind"] == "train_step"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    keys = [e.key for e in read_adapter(out)[1]]
    assert "0:wq" in keys and any(k.startswith("2:wdown_exps.") for k in keys)
