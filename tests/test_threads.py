"""CPU thread counts: the choice from the allowed CPUs and their idle share, OMP_NUM_THREADS and --threads taking
precedence, the guard that drops a thread when steps stall (and returns), and --threads on every command that
computes."""

import os

import pytest
import torch
from click.testing import CliRunner

from juno_py import threads
from juno_py.cli.main import cli


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads(), threads.native_threads()
    yield
    threads.apply(before[1])
    torch.set_num_threads(before[0])


def test_an_explicit_count_wins_then_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose(5) == 5
    assert threads.choose() == 3
    with pytest.raises(ValueError, match="at least 1"):
        threads.choose(0)


def test_without_a_count_the_idle_allowed_cpus_are_taken(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    allowed = len(os.sched_getaffinity(0))
    idle = threads.idle_cpus(0.02)
    assert 0.0 <= idle <= allowed
    assert 1 <= threads.choose(sample_s=0.02) <= allowed
    # a machine whose allowed CPUs are all busy gets one thread; an idle one all of them
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.05, cpus=None: 0.2)
    assert threads.choose() == 1
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.05, cpus=None: float(len(cpus)))
    assert threads.choose() == allowed


def test_the_load_average_stands_in_when_proc_stat_cannot_be_read(monkeypatch):
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: None)
    idle = threads.idle_cpus(0.0, cpus=[0])
    load = float(open("/proc/loadavg").read().split()[0])
    assert idle == pytest.approx(max(0.0, 1 - load / max(os.cpu_count() or 1, 1)), abs=0.05)


def test_apply_sets_torch_and_the_native_products():
    threads.apply(1)
    assert torch.get_num_threads() == 1 and threads.native_threads() == 1
    threads.apply(2)
    assert torch.get_num_threads() == 2 and threads.native_threads() == 2


def test_stalled_steps_drop_a_thread_and_a_worse_count_goes_back(monkeypatch):
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.05, cpus=None: 0.0)
    threads.apply(2)
    guard = threads.StallGuard(2, slack=1.5, recheck=1000)
    for _ in range(4):
        assert guard.observe(1.0, 100) == 2  # the first step after a start is not judged; steady steps keep 2
    assert guard.observe(2.5, 100) == 2  # one slow step is no stall
    assert guard.observe(2.5, 100) == 1  # two are: one thread fewer
    assert torch.get_num_threads() == 1 and threads.native_threads() == 1
    assert guard.changes == [(2, 1)]
    guard.observe(1.6, 100)  # the warm-up step at 1 thread
    assert guard.observe(1.6, 100) == 1  # faster than the stalled 2-thread steps: stays
    # the other process left: a step at 1 thread is now slower than 2 threads were when stalled, by the slack
    assert guard.observe(6.0, 100) == 2
    assert guard.changes == [(2, 1), (1, 2)]


def test_one_step_far_slower_is_a_stall_and_the_core_is_looked_for_soon(monkeypatch):
    idle = {"now": 0.0}
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.05, cpus=None: idle["now"])
    threads.apply(2)
    guard = threads.StallGuard(2, slack=1.5, recheck=50)
    for _ in range(3):
        guard.observe(1.0, 100)
    assert guard.observe(3.1, 100) == 1  # over 2 · slack times the best: no second such step is waited for
    steps = 0
    while guard.observe(1.8, 100) == 1:  # a hiccup, not another process: both cores idle while the guard samples
        idle["now"] = 2.0
        steps += 1
        assert steps < threads.QUICK_RECHECK + 2, "the idle core was not tried again soon after the drop"
    assert guard.changes == [(2, 1), (1, 2)]


def test_an_idle_core_is_tried_again_after_recheck_steps(monkeypatch):
    idle = {"now": 0.0}
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.05, cpus=None: idle["now"])
    threads.apply(2)
    guard = threads.StallGuard(2, recheck=5)
    for t in (1.0, 1.0, 1.0, 4.0, 4.0):
        guard.observe(t, 10)
    assert guard.threads == 1
    for _ in range(8):
        guard.observe(2.0, 10)
    assert guard.threads == 1  # no idle CPU: stays
    idle["now"] = 1.0  # the guard samples while this process sleeps: its own core is the idle one, stays
    for _ in range(8):
        guard.observe(2.0, 10)
    assert guard.threads == 1
    idle["now"] = 2.0
    for _ in range(5):
        if guard.observe(2.0, 10) == 2:
            break
    assert guard.threads == 2 and guard.changes == [(2, 1), (1, 2)]


def test_a_fixed_count_is_never_changed():
    threads.apply(2)
    guard = threads.StallGuard(2, fixed=True)
    for t in (1.0, 1.0, 9.0, 9.0, 9.0):
        assert guard.observe(t, 10) == 2
    assert guard.changes == []


@pytest.mark.parametrize("command", ["local", "eval", "merge", "export", "lora", "full"])
def test_every_computing_command_takes_threads(command):
    res = CliRunner().invoke(cli, [command, "--help"])
    assert res.exit_code == 0 and "--threads" in res.output


def test_local_runs_on_the_threads_asked_for(tiny_gguf):
    res = CliRunner().invoke(
        cli,
        ["local", "--model-path", str(tiny_gguf("llama")), "--prompt", "hi", "--temperature", "0"]
        + ["--max-tokens", "3", "--threads", "1"],
    )
    assert res.exit_code == 0, res.output
    assert torch.get_num_threads() == 1 and threads.native_threads() == 1
