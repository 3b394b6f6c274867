"""How many CPU threads the computation uses: torch's intra-op threads and the native matrix-vector pool.

`choose()` takes an explicit count (an option, else OMP_NUM_THREADS), or picks one from the CPUs this process may run on (`os.sched_getaffinity`) and how busy they are now:
the idle share of those CPUs over a short sample of `/proc/stat` (or, where that cannot be read, the 1-minute load
average of `/proc/loadavg`). Threads beyond the idle CPUs do not add speed; they wait for a core while the others
wait for them at every synchronisation, which on a shared machine makes a step several times slower than one thread.

`apply(n)` sets both pools; `native_threads()` is what the native products use. `StallGuard` watches a long run's
steps and drops a thread when a step's wall time shows stalls (see its docstring).
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch

_native_threads = 1


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_times(cpus: list[int]) -> Optional[tuple[int, int]]:
    """(idle, total) jiffies summed over `cpus` from /proc/stat, or None where it cannot be read."""
    wanted = {f"cpu{c}" for c in cpus}
    idle = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in wanted:
                    values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
                    idle += values[3] + values[4]
                    total += sum(values)
    except (OSError, ValueError):
        return None
    return (idle, total) if total else None


def idle_cpus(sample_s: float = 0.05, cpus: Optional[list[int]] = None) -> float:
    """How many of `cpus` (default: the allowed ones) were idle over the last `sample_s` seconds: the idle share
    of their time in /proc/stat, times their number; else their number less the 1-minute load average."""
    cpus = allowed_cpus() if cpus is None else cpus
    first = _cpu_times(cpus)
    if first is not None:
        time.sleep(sample_s)
        second = _cpu_times(cpus)
        if second is not None and second[1] > first[1]:
            return len(cpus) * (second[0] - first[0]) / (second[1] - first[1])
    try:
        with open("/proc/loadavg") as f:
            load = float(f.read().split()[0])
        # the load counts runnable tasks on every CPU of the machine: scale to our share of them
        return max(0.0, len(cpus) - load * len(cpus) / max(os.cpu_count() or 1, len(cpus)))
    except (OSError, ValueError, IndexError):
        return float(len(cpus))


def env_threads() -> Optional[int]:
    """OMP_NUM_THREADS when it is set to a positive whole number (a launcher's or the user's choice), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def choose(requested: Optional[int] = None, sample_s: float = 0.05) -> int:
    """`requested` if given, else OMP_NUM_THREADS if set; otherwise the idle allowed CPUs, rounded to the nearest
    whole one (at least one, at most the allowed CPUs)."""
    if requested is None:
        requested = env_threads()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be at least 1, got {requested}")
        return int(requested)
    cpus = allowed_cpus()
    if len(cpus) <= 1:
        return 1
    return max(1, min(len(cpus), math.floor(idle_cpus(sample_s, cpus) + 0.5)))


def apply(n: int) -> int:
    """Use `n` threads from now on: torch's intra-op pool and the native products. Returns n."""
    global _native_threads
    n = max(1, int(n))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _native_threads = n
    return n


def setup(requested: Optional[int] = None) -> int:
    """`apply(choose(requested))`: what a command runs before it computes."""
    return apply(choose(requested))


def native_threads() -> int:
    """Threads of the native matrix-vector products."""
    return _native_threads


# steps after a drop until the guard first looks for an idle core again
QUICK_RECHECK = 5


class StallGuard:
    """Drops a thread during a long run when the steps' wall time shows stalls.

    `observe(seconds, work)` takes each step's wall time and its amount of work (tokens, say). The first steps at a
    thread count set its rate (the best seconds per unit of work seen at that count). A step `slack` times slower
    than that rate, twice in a row, is a stall: another process took a core, and threads that wait for one another
    at every synchronisation slow the whole step. One step `2·slack` times slower is one already (a busy core makes
    a 2-thread step about 4 times slower: waiting for a second such step doubles what the stall costs). The guard
    then moves to one thread fewer (`apply`) and keeps the count whose recent steps are fastest: if the fewer
    threads are slower than the stalled steps were, it goes back. Below `max_threads` (default: the allowed CPUs) it
    looks at the idle CPUs and tries one thread more where they allow: `QUICK_RECHECK` steps after a drop (a single
    slow step may have been a passing hiccup), then every `recheck` steps. `one_step_stalls=False` waits for two
    slow steps whatever their size (token-by-token decoding, whose millisecond steps a scheduler tick can triple).
    Nothing changes when the count was given explicitly (`fixed`)."""

    def __init__(
        self,
        threads: int,
        fixed: bool = False,
        slack: float = 1.5,
        recheck: int = 50,
        max_threads: Optional[int] = None,
        one_step_stalls: bool = True,
    ):
        self.threads, self.fixed, self.slack, self.recheck = int(threads), fixed, slack, recheck
        # the most it may return to: the allowed CPUs (a run that started on a busy machine may grow)
        self.max_threads = max(int(threads), len(allowed_cpus()) if max_threads is None else int(max_threads))
        self.best: dict[int, float] = {}  # best seconds per unit of work at each count
        self.recent: dict[int, float] = {}  # the last step's seconds per unit at each count
        self._slow = 0
        self._since_change = 0
        self._next_check = recheck
        self.one_step_stalls = one_step_stalls
        self.changes: list[tuple[int, int]] = []  # (from, to) in order: what the guard did

    def observe(self, seconds: float, work: float = 1.0) -> int:
        """Record one step; returns the thread count for the next one."""
        if self.fixed or work <= 0 or seconds <= 0:
            return self.threads
        rate = seconds / work
        n = self.threads
        self.recent[n] = rate
        self._since_change += 1
        if self._since_change <= 1:  # the first step after a change warms caches and pools: not judged
            return n
        best = self.best.get(n)
        self.best[n] = rate if best is None else min(best, rate)
        if best is not None and rate > self.slack * best:
            self._slow += 1
        else:
            self._slow = 0
        fewer = self.recent.get(n - 1)
        severe = self.one_step_stalls and best is not None and rate > 2 * self.slack * best
        if n > 1 and (self._slow >= 2 or severe):
            self._move(n - 1)
        elif n < self.max_threads and self.recent.get(n + 1, math.inf) < rate / self.slack:
            self._move(n + 1)  # the stalled count was still faster than this one: back to it
        elif fewer is not None and fewer < rate / self.slack:
            self._move(n - 1)
        elif n < self.max_threads and self._since_change >= self._next_check:
            # the sample runs while this process sleeps between steps: its own n cores show as idle too, so a core
            # more than those must be free
            if idle_cpus(0.02) >= n + 0.5:
                self._move(n + 1)
            else:
                self._since_change, self._next_check = 1, self.recheck
        return self.threads

    def _move(self, n: int) -> None:
        self._next_check = min(self.recheck, QUICK_RECHECK) if n < self.threads else self.recheck
        self.changes.append((self.threads, n))
        self.threads = apply(n)
        self._slow = 0
        self._since_change = 0


__all__ = [
    "allowed_cpus",
    "idle_cpus",
    "env_threads",
    "choose",
    "apply",
    "setup",
    "native_threads",
    "StallGuard",
    "QUICK_RECHECK",
]
