"""Sharded training (FSDP2, `--shard`) with torchrun and Gloo on the CPU, on the tiny model with Q8_0 bytes: 2 and 3
processes train the adapters one process trains (LoRA and DoRA, step by step), each holds about 1/N of the quantized
base (measured from the tensors it holds) plus the block running, a run resumes from its shards bit for bit, and
adapter.bin is the file one process writes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.lora import read_adapter
from juno_py.models import load_model
from juno_py.testing.tiny_models import write_tiny_gguf
from juno_py.train.loop import TrainConfig, train
from juno_py.train.sharded import frozen_linears
from tests.train import dist_worker
from tests.train.shard_worker import SHARD_RUNS

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 600  # a job that hangs fails the test here instead of blocking CI; it is not a speed bound
REL = 1e-6  # fp32 sums in another order: the target of sharded training, for the losses and gradient norms
# the trained weights: AdamW scales each element by its own second moment, so where an element's gradient nearly
# cancels across the batch the last bits of the sums (another order on every rank) become a visible part of its
# step (test_distributed.assert_same_weights). On an AVX-512 CPU a DoRA B of the 2-process run differed by 1.2e-6.
WEIGHTS_REL = 1e-5


def run(cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
    )


def launch(n: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *map(str, args)]


@pytest.fixture(scope="module")
def sharded_runs(q8_path, data, tmp_path_factory):
    """shard_worker on 2 processes (the runs and the resume) and on 3 (the runs)."""
    out = tmp_path_factory.mktemp("sharded")
    for n, scenarios in ((2, "train,float8,resume"), (3, "train")):
        r = run(launch(n, "-m", "tests.train.shard_worker", q8_path, data, out, scenarios))
        assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def one_process(q8_path, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    runs = {}
    for name, extra in SHARD_RUNS.items():
        extra = {k: v for k, v in extra.items() if k != "prefetch"}
        runs[name] = dist_worker.train_run(q8_path, data, out / f"{name}.bin", name, **extra)[0]
    return out, runs


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).norm().item() / max(want.norm().item(), 1e-30)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(SHARD_RUNS))
def test_sharded_runs_train_the_adapter_of_one_process(name, n, sharded_runs, one_process):
    folder, runs = one_process
    one, got = runs[name], json.loads((sharded_runs / f"{name}-{n}.json").read_text())
    assert got["steps"] == one["steps"] == 6 and got["tokens"] == one["tokens"]
    assert got["best_step"] == one["best_step"] and got["stop_reason"] == one["stop_reason"]
    assert got["best_validation"] == pytest.approx(one["best_validation"], rel=REL)
    # the loss of each global batch and the norm of its summed gradient: a wrong loss scale or a lost shard shows
    for i, ((loss, norm), (loss1, norm1)) in enumerate(zip(got["loss_and_grad_norm"], one["loss_and_grad_norm"]), 1):
        assert loss == pytest.approx(loss1, rel=REL), f"loss of step {i}"
        assert norm == pytest.approx(norm1, rel=REL), f"gradient norm of step {i}"
    meta_one, entries_one = read_adapter(folder / f"{name}.bin")
    meta, entries = read_adapter(sharded_runs / f"{name}-{n}.bin")
    assert meta == meta_one
    want = {e.key: e for e in entries_one}
    assert [e.key for e in entries] == [e.key for e in entries_one]
    for e in entries:
        w = want[e.key]
        assert (e.alpha, e.mode, e.scaling, e.init, e.fingerprint) == (
            w.alpha,
            w.mode,
            w.scaling,
            w.init,
            w.fingerprint,
        )
        for field in ("A", "B", "magnitude"):
            a, b = getattr(e, field), getattr(w, field)
            assert (a is None) == (b is None), f"{e.key}.{field}"
            if a is not None:
                assert a.shape == b.shape and a.dtype == b.dtype
                diff = rel_diff(torch.from_numpy(a), torch.from_numpy(b))
                assert diff <= WEIGHTS_REL, f"{e.key}.{field}: relative difference {diff:.3g}"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(SHARD_RUNS))
def test_each_rank_holds_its_part_of_the_quantized_base_and_the_block_running(name, n, sharded_runs, q8_path):
    model = load_model(q8_path)
    linears = list(frozen_linears(model))
    base = sum(lin.raw.numel() for lin in linears)
    # each rank's rows of every quantized tensor, rounded up: the most 1/N can be
    part = sum(math.ceil(lin.raw.shape[0] / n) * lin.raw.shape[1] for lin in linears)
    blocks = [sum(lin.raw.numel() for lin in frozen_linears(blk)) for blk in model.blocks]
    # a block gathered: every rank's padded part of each of its tensors
    gathered = max(
        sum(math.ceil(lin.raw.shape[0] / n) * n * lin.raw.shape[1] for lin in frozen_linears(blk))
        for blk in model.blocks
    )
    ranks = [json.loads((sharded_runs / f"{name}-{n}-rank{r}.json").read_text()) for r in range(n)]
    for r, q in enumerate(ranks):
        assert q["base"] == base and q["largest_block"] >= max(blocks)
        assert base / n <= q["after_shard"] <= part, f"rank {r}: {q['after_shard']} bytes of {base}"
        ahead = SHARD_RUNS[name].get("prefetch", 0)
        # the gathered block (and with prefetching the next one in flight), each counted whole
        assert q["peak"] <= q["after_shard"] + (1 + ahead) * gathered, f"rank {r}: peak {q['peak']}"
        assert q["peak"] >= q["after_shard"] + min(blocks) * (n - 1) / n  # the gathers were seen


def test_frozen_bytes_sharded_as_float8_train_the_same_bits(sharded_runs):
    """Torch before 2.13 gets the quantized bytes as float8_e5m2 parameters: FSDP2 only copies them, so the run is
    the uint8 run bit for bit, and each rank still holds its part of the base."""
    assert (sharded_runs / "lora-float8-2.bin").read_bytes() == (sharded_runs / "lora-2.bin").read_bytes()
    got = json.loads((sharded_runs / "lora-float8-2.json").read_text())
    assert got["loss_and_grad_norm"] == json.loads((sharded_runs / "lora-2.json").read_text())["loss_and_grad_norm"]
    for r in range(2):
        f8 = json.loads((sharded_runs / f"lora-float8-2-rank{r}.json").read_text())
        assert f8 == json.loads((sharded_runs / f"lora-2-rank{r}.json").read_text())


def test_a_sharded_run_resumes_from_its_shards_bit_for_bit(sharded_runs):
    whole = json.loads((sharded_runs / "lora-2.json").read_text())
    resumed = json.loads((sharded_runs / "resumed-2.json").read_text())
    assert resumed["steps"] == whole["steps"] and resumed["best_step"] == whole["best_step"]
    assert resumed["loss_and_grad_norm"] == whole["loss_and_grad_norm"][dist_worker.PART_STEPS :]
    assert (sharded_runs / "part-2.bin").read_bytes() == (sharded_runs / "lora-2.bin").read_bytes()
    for r in (0, 1):
        assert (sharded_runs / f"part-2.bin.state.rank{r}-of-2").is_file()
    assert not (sharded_runs / "part-2.bin.state").exists()  # no whole-state file beside the shards


def test_resuming_on_another_number_of_processes_is_refused(sharded_runs):
    for r in range(3):
        message = (sharded_runs / f"refused-rank{r}.txt").read_text()
        assert f"no sharded resume state for rank {r} of 3" in message and "rank0-of-2" in message


def test_shard_needs_several_processes(q8_path, data):
    model = load_model(q8_path)
    from juno_py.lora import attach
    from juno_py.train.data import load_dataset

    train_set, _, _ = load_dataset([data], model.tokenizer, 256, validation_split=0.0, seed=3)
    adapters = attach(model, "all", rank=4)
    with pytest.raises(Exception, match="--shard needs several processes"):
        train(model, adapters, train_set, TrainConfig(shard=True, max_steps=1), progress=False, log=lambda s: None)
    r = CliRunner().invoke(cli, ["lora", "--model-path", str(q8_path), "--data", str(data), "--shard"])
    assert r.exit_code == 2 and "--shard splits the model across processes" in r.output


def test_lora_nproc_2_shard_trains_like_one_process(q8_path, data, tmp_path):
    args = ["--model-path", q8_path, "--data", data, "--max-steps", 2, "--lora-rank", 4, "--batch-size", 3]
    args += ["--validation-split", 0.2, "--compute-dtype", "fp32", "--no-progress"]
    out = tmp_path / "sharded.bin"
    r = run([sys.executable, "-m", "juno_py", "lora", "--nproc", "2", "--shard", *map(str, args), "--lora-path", out])
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout == f"{out}\n" and r.stderr.count("trained 2 steps") == 1
    assert "sharded: the quantized base, the adapters and their optimizer state are split" in r.stderr
    one = tmp_path / "one.bin"
    r1 = CliRunner().invoke(cli, ["lora", *map(str, args), "--lora-path", str(one)], catch_exceptions=False)
    assert r1.exit_code == 0, r1.stderr
    want = {e.key: e for e in read_adapter(one)[1]}
    for e in read_adapter(out)[1]:
        for field in ("A", "B"):
            diff = rel_diff(torch.from_numpy(getattr(e, field)), torch.from_numpy(getattr(want[e.key], field)))
            assert diff <= WEIGHTS_REL, f"{e.key}.{field}: {diff:.3g}"


def test_full_nproc_2_trains_data_parallel_like_one_process(tmp_path, data):
    """`juno-py full` joins torchrun (DDP over the dense targets); rank 0 writes the GGUF."""
    from juno_py.gguf import GGUFFile

    base = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", seed=3)
    args = ["--model-path", base, "--data", data, "--optimizer", "adamw", "--max-steps", 3, "--batch-size", 3]
    args += ["--validation-split", 0.2, "--compute-dtype", "fp32", "--no-progress", "--requant", "source"]
    two, one = tmp_path / "two.gguf", tmp_path / "one.gguf"
    r = run([sys.executable, "-m", "juno_py", "full", "--nproc", "2", *map(str, args), "--output", str(two)])
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout == f"{two}\n" and r.stderr.count("trained 3 steps") == 1
    assert "data parallel: 2 processes (gloo)" in r.stderr
    r1 = CliRunner().invoke(cli, ["full", *map(str, args), "--output", str(one)], catch_exceptions=False)
    assert r1.exit_code == 0, r1.stderr
    a, b, b0 = GGUFFile(two), GGUFFile(one), GGUFFile(base)
    trained = 0
    for name in b.tensors:
        got, want, before = (f.dequantize(name).float() for f in (a, b, b0))
        if not torch.equal(want, before):
            trained += 1
            assert rel_diff(got, want) <= WEIGHTS_REL, name
    assert trained == 14  # every target of both blocks moved
