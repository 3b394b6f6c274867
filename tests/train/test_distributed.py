"""Data-parallel training with torchrun and Gloo on the CPU: two processes give the adapters of one process on the
same global batches; a two-process run resumes in one process; a rank that raises or stops answering ends the
whole job with its error; `juno-py lora --nproc 2` trains and only rank 0 writes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from juno_py.cli.main import cli
from juno_py.lora import read_adapter
from juno_py.train.distributed import World, shard_rows
from juno_py.train.state import load_state, state_path
from tests.train import dist_worker

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 600  # a job that hangs fails the test here instead of blocking CI; it is not a speed bound


def launch(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]


def run(cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
    )


def weights(adapters) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in adapters.named_parameters()}


def assert_same_weights(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-4) -> None:
    """‖got − want‖ ≤ rel·‖want‖, tensor by tensor. The two runs' gradients differ in the last bits (each rank
    normalizes its own loss, and the sums run in another order). Where an element's micro-batch gradients nearly
    cancel in a step, those bits become a large part of its gradient, and AdamW, which scales each element by its
    own second moment, carries that into the weight. On an AVX2 CPU one element of a [4, 64] A, whose step-2
    gradient was −0.0018005 + 0.0017999, differed by 1.3e-4 relative while the rest agreed to 1e-6 (the tensor's
    norm to 5e-6). A wrong loss scale, shard or all-reduce moves whole tensors by a percent or more."""
    diff = (got - want).norm().item()
    assert diff <= rel * want.norm().item(), f"{what}: ‖difference‖ {diff:.3g}, ‖weights‖ {want.norm().item():.3g}"


@pytest.fixture(scope="module")
def two_processes(tiny_path, data, tmp_path_factory):
    """Every run of dist_worker.RUNS, and `lora` interrupted after PART_STEPS, on two processes."""
    out = tmp_path_factory.mktemp("ddp")
    r = run(launch("-m", "tests.train.dist_worker", "equal", tiny_path, data, out))
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def one_process(tiny_path, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return {name: dist_worker.train_run(tiny_path, data, out / f"{name}.bin", name) for name in dist_worker.RUNS}


def assert_same_steps(two: list, one: list) -> None:
    """Step by step, the global batch's loss and the norm of the all-reduced gradient equal one process's."""
    assert len(two) == len(one)
    for i, ((loss2, norm2), (loss1, norm1)) in enumerate(zip(two, one), 1):
        assert loss2 == pytest.approx(loss1, rel=1e-5), f"loss of step {i}"
        assert norm2 == pytest.approx(norm1, rel=1e-5), f"gradient norm of step {i}"


@pytest.mark.parametrize("name", list(dist_worker.RUNS))
def test_two_processes_equal_one_process_on_the_same_global_batches(name, two_processes, one_process):
    two = json.loads((two_processes / f"{name}.json").read_text())
    one, adapters = one_process[name]
    assert two["steps"] == one["steps"] == 6 and two["tokens"] == one["tokens"]
    assert two["best_step"] == one["best_step"] and two["stop_reason"] == one["stop_reason"]
    assert two["best_validation"] == pytest.approx(one["best_validation"], rel=1e-5)
    # a wrong loss scale across ranks (DDP averages) shows in the gradient norm, even where Adam would hide it
    assert_same_steps(two["loss_and_grad_norm"], one["loss_and_grad_norm"])
    rank0 = load_file(two_processes / f"rank0-{name}.safetensors")
    rank1 = load_file(two_processes / f"rank1-{name}.safetensors")
    written = {e.key: e for e in read_adapter(two_processes / f"{name}.bin")[1]}
    for n, w in weights(adapters).items():
        assert torch.equal(rank0[n], rank1[n]), f"{n}: the replicas drifted apart"
        assert_same_weights(rank0[n], w, n)
        key, what = n.rsplit(".", 1)
        saved = {"lora_A": written[key].A, "lora_B": written[key].B, "magnitude": written[key].magnitude}[what]
        assert torch.equal(torch.from_numpy(saved), rank0[n]), f"{n}: adapter.bin differs from rank 0's weights"


def test_a_two_process_run_resumes_in_one_process(tiny_path, data, two_processes, one_process, tmp_path):
    for f in ("part.bin", "part.bin.state"):
        shutil.copy(two_processes / f, tmp_path / f)
    _, meta = load_state(state_path(tmp_path / "part.bin"))
    assert meta["run"]["step"] == dist_worker.PART_STEPS
    rest, adapters = dist_worker.train_run(tiny_path, data, tmp_path / "part.bin", "lora", resume=True)
    whole, whole_adapters = one_process["lora"]
    assert rest["steps"] == whole["steps"] and rest["best_step"] == whole["best_step"]
    # the data position was global: the resumed steps see the same batches as the uninterrupted run's last steps
    assert_same_steps(rest["loss_and_grad_norm"], whole["loss_and_grad_norm"][dist_worker.PART_STEPS :])
    expected = weights(whole_adapters)
    for n, w in weights(adapters).items():
        assert_same_weights(w, expected[n], n)


def test_ranks_with_different_data_refuse_to_start(two_processes):
    for rank in (0, 1):
        message = (two_processes / f"mismatch-rank{rank}.txt").read_text()
        assert message.startswith("the ranks hold different training data") and "same files" in message
    assert not (two_processes / "mismatch.bin").exists()


def test_a_rank_raising_an_error_ends_the_job_with_that_error(tiny_path, data, tmp_path):
    r = run(launch("-m", "tests.train.dist_worker", "raise", tiny_path, data, tmp_path))
    assert r.returncode != 0
    assert f"RuntimeError: {dist_worker.FAIL_MESSAGE}" in r.stderr
    assert "rank      : 1 (local_rank: 1)" in r.stderr.split("Root Cause")[1]  # torchrun names the failing rank
    assert not (tmp_path / "fail.bin").exists()  # rank 0 was stopped before the end


def test_a_rank_that_stops_answering_ends_the_job_by_the_collective_timeout(tiny_path, data, tmp_path):
    # 15 s: far above the skew of two processes started together, far below the guard
    r = run(launch("-m", "tests.train.dist_worker", "hang", tiny_path, data, tmp_path), JUNO_PY_DIST_TIMEOUT="15")
    assert r.returncode != 0
    rank0 = "\n".join(line for line in r.stderr.splitlines() if line.startswith("[rank0]"))
    assert "agree_stop" in rank0 and "Timed out" in rank0  # waiting for rank 1 after step 2, then gave up


def test_lora_nproc_2_trains_like_one_process_and_only_rank_0_writes(tiny_path, data, tmp_path):
    args = [
        "--model-path",
        tiny_path,
        "--data",
        data,
        "--max-steps",
        3,
        "--lora-rank",
        4,
        "--batch-size",
        3,
        "--validation-split",
        0.2,
        "--compute-dtype",
        "fp32",
        "--no-progress",
    ]
    out = tmp_path / "two.bin"
    r = run(
        [
            sys.executable,
            "-m",
            "juno_py",
            "lora",
            "--nproc",
            "2",
            *map(str, args),
            "--lora-path",
            str(out),
            "--events-out",
            str(tmp_path / "events.jsonl"),
            "--metrics-out",
            str(tmp_path / "metrics.json"),
        ]
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout == f"{out}\n"  # the adapter path, once: rank 1 prints nothing
    assert r.stderr.count("trained 3 steps") == 1 and "data parallel: 2 processes (gloo)" in r.stderr
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "train_step"] == [1, 2, 3]
    assert json.loads((tmp_path / "metrics.json").read_text())["series"]["train_step.loss"]["count"] == 3

    one = tmp_path / "one.bin"
    r1 = CliRunner().invoke(cli, ["lora", *map(str, args), "--lora-path", str(one)], catch_exceptions=False)
    assert r1.exit_code == 0, r1.stderr
    expected = {e.key: e for e in read_adapter(one)[1]}
    for e in read_adapter(out)[1]:
        assert_same_weights(torch.from_numpy(e.A), torch.from_numpy(expected[e.key].A), f"{e.key}.A")
        assert_same_weights(torch.from_numpy(e.B), torch.from_numpy(expected[e.key].B), f"{e.key}.B")


def test_lora_nproc_errors_are_one_line_per_rank(tiny_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"Q": "no answer"}\n')
    r = run(
        [
            sys.executable,
            "-m",
            "juno_py",
            "lora",
            "--nproc",
            "2",
            "--model-path",
            str(tiny_path),
            "--data",
            str(bad),
            "--lora-path",
            str(tmp_path / "x.bin"),
        ]
    )
    assert r.returncode == 1 and r.stdout == ""
    for rank in (0, 1):
        assert f'juno-py: error (rank {rank}): {bad}:2: field "A" missing' in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("juno-py: error: the process of rank ")


def test_each_rank_takes_its_share_of_the_global_batch():
    rows = list(range(11))
    shares = [shard_rows(rows, 3, World(rank=r, size=2, backend="gloo")) for r in range(2)]
    assert shares == [[[0, 2, 4], [6, 8, 10]], [[1, 3, 5], [7, 9]]]
    assert shard_rows(rows, 4, World()) == [rows[0:4], rows[4:8], rows[8:11]]  # one process: the plan's batches
    assert shard_rows([7], 2, World(rank=1, size=2, backend="gloo")) == []  # an idle rank
    three = [shard_rows(rows, 2, World(rank=r, size=3, backend="gloo")) for r in range(3)]
    assert sorted(x for share in three for batch in share for x in batch) == rows


def test_nproc_forwards_the_given_options_to_the_ranks():
    import click

    from juno_py.cli.launch import torchrun_argv

    cmd = cli.commands["lora"]
    ctx = cmd.make_context(
        "lora",
        [
            "--nproc",
            "2",
            "--data",
            "a.jsonl",
            "--data",
            "b.jsonl",
            "--lora-lr",
            "0.001",
            "--resume",
            "--no-progress",
            "--lora-path",
            "x y.bin",
        ],
    )
    argv = torchrun_argv(ctx, 2)
    assert argv[:6] == ["--standalone", "--nproc-per-node", "2", "--module", "juno_py", "lora"]
    forwarded = argv[6:]
    assert "--nproc" not in forwarded and "--epochs" not in forwarded  # defaults stay the child's own
    again = cmd.make_context("lora", forwarded)
    for name in ("data", "lora_lr", "resume", "progress", "lora_path"):
        assert again.params[name] == ctx.params[name], name
    assert isinstance(ctx, click.Context)
