"""A tiny mixture-of-experts model trains on the CPU through `juno-py lora`: the loss on a few facts falls clearly,
the router's load reaches the metrics, and the adapter (attention, router and per-expert or shared experts)
plays back to the loss the run ended with."""

import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.lora import load_adapters, read_adapter
from juno_py.models import load_model
from juno_py.testing.records import write_jsonl
from juno_py.testing.tiny_models import write_tiny_gguf
from juno_py.train.data import load_dataset
from juno_py.train.steps import evaluate
from tests.train.test_distributed import assert_same_weights, run

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


@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp"])
def test_per_expert_adapters_train_on_two_processes_like_one(moe_path, tmp_path, shard):
    """Two processes, each with tokens of its own rows and so other idle experts: every rank still has a gradient
    for every trainable tensor (an expert's is its row of its projection's stack), so the all-reduce (DDP) or
    reduce-scatter (FSDP2) is the same on both, and the adapter is the one-process run's."""
    data = write_jsonl(tmp_path / "facts.jsonl", FACTS)
    args = ["--model-path", moe_path, "--data", data, "--max-steps", 3, "--batch-size", 4, "--lora-rank", 4]
    args += ["--lora-lr", 1e-2, "--lora-targets", "all,router", "--compute-dtype", "fp32", "--no-progress"]
    two = tmp_path / "two.bin"
    cmd = [sys.executable, "-m", "juno_py", "lora", "--nproc", "2", *(["--shard"] if shard else [])]
    r = run([*cmd, *map(str, args), "--lora-path", str(two)])
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("trained 3 steps") == 1
    one = tmp_path / "one.bin"
    r1 = CliRunner().invoke(cli, ["lora", *map(str, args), "--lora-path", str(one)], catch_exceptions=False)
    assert r1.exit_code == 0, r1.stderr
    expected = {e.key: e for e in read_adapter(one)[1]}
    got = read_adapter(two)[1]
    assert [e.key for e in got] == list(expected) and "1:wdown_exps.7" in expected
    for e in got:
        assert_same_weights(torch.from_numpy(e.A), torch.from_numpy(expected[e.key].A), f"{e.key}.A")
        assert_same_weights(torch.from_numpy(e.B), torch.from_numpy(expected[e.key].B), f"{e.key}.B")
