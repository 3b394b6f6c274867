"""What every benchmark shares: timing on the GPU and the CPU, peak RSS of a configuration run in its own process,
the machine and software a run saw, and the results file `benchmarks/results/<capability>.json` that
`python -m benchmarks.report` turns into docs/performance.md.

Results schema (one file per capability):
    {"capability", "title", "command", "date", "hardware", "software": {package: version}, "load_average",
     "columns": [...], "rows": [[...], ...], "notes": [...]}
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
SOFTWARE = ("torch", "triton", "transformers", "peft", "numpy", "gguf", "bitsandbytes", "liger_kernel")


# ------------------------------------------------------------------------------------------------- GPU memory
def peak_breakdown(trace: Sequence[dict], top: int = 12) -> tuple[int, list[tuple[str, int, int]]]:
    """What was allocated at the allocator's peak, from one device's trace of `torch.cuda.memory._snapshot()`
    (recorded with `torch.cuda.memory._record_memory_history`): (peak bytes over the trace's own baseline, the
    `top` largest groups of live blocks at that moment as (where, bytes, blocks)). A block is grouped under its
    innermost Python frame in juno_py, benchmarks, transformers, peft or liger_kernel ("?" without one). Blocks
    allocated before recording began are not in the trace: the peak is counted from the trace's start."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for e in trace:
        action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if action == "alloc":
            live[addr] = (size, _where(e.get("frames", ())))
            total += size
            if total > best:
                best, best_live = total, dict(live)
        elif action == "free_requested" and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, list[int]] = {}
    for size, where in best_live.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(((w, b, n) for w, (b, n) in groups.items()), key=lambda r: -r[1])
    return best, ranked[:top]


OWN_CODE = ("juno_py/", "benchmarks/", "transformers/", "peft/", "liger_kernel/")


def _where(frames: Sequence[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        for mark in OWN_CODE:
            if mark in name:
                return f"{mark}{name.split(mark, 1)[1]}:{f.get('line')} {f.get('name')}"
    return "?"


# ------------------------------------------------------------------------------------------------- CPU timing
def cpu_times(fn: Callable[[], object], reps: int, warmup: int = 0, clock=time.perf_counter) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` untimed ones (`clock`: perf_counter for wall time,
    time.thread_time for the calling thread's CPU time)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = clock()
        fn()
        out.append(clock() - start)
    return out


def cpu_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall milliseconds of `reps` calls after `warmup` untimed ones."""
    return statistics.median(cpu_times(fn, reps, warmup)) * 1e3


def fastest_call(fn: Callable[[], object], min_seconds: float = 0.1, min_calls: int = 10) -> float:
    """Seconds of the fastest of repeated single calls (after one warm-up call), calling until both `min_seconds`
    have been spent and `min_calls` made: on a shared machine the minimum is the call no other process interrupted."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while spent < min_seconds or calls < min_calls:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def best_interleaved(runs: dict[str, Callable[[], object]], repeat: int, clock=time.perf_counter) -> dict[str, float]:
    """Seconds of the fastest of `repeat` rounds of each run, the runs called in turn within a round, so that a
    busy spell of the machine reaches every run alike."""
    best = {name: float("inf") for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start = clock()
            run()
            best[name] = min(best[name], clock() - start)
    return best


# ------------------------------------------------------------------------------------------------- GPU timing
def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def event_ms(
    fn: Callable[[], object], reps: int, warmup: int = 3, setup: Optional[Callable[[], object]] = None
) -> float:
    """Median GPU milliseconds of `fn` between two CUDA events, `reps` calls after `warmup`; `setup` (untimed)
    runs before every call, e.g. to restore an input the call overwrites."""
    import torch

    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    out = []
    for _ in range(reps):
        if setup is not None:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def do_bench_ms(fn: Callable[[], object], rep: int = 100, warmup: int = 10) -> float:
    """Median milliseconds from `triton.testing.do_bench` (CUDA events, L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def capture(step: Callable[[], object]):
    """`step` captured once in a CUDA graph, after three warm-up calls on a side stream (as torch asks)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graphed_ms(step: Callable[[], object], reps: int, warmup: int) -> float:
    """Median GPU ms of `step` captured once in a CUDA graph and replayed from an idle GPU: the GPU's time alone,
    no launches (juno-py's whole-model training replays each step's graph this way)."""
    import torch

    graph = capture(step)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def host_us(fn: Callable[[], object], reps: int = 50) -> float:
    """Host microseconds per call to issue `fn` (one warm-up call, the GPU idle before the first timed call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = (time.perf_counter() - t0) * 1e6 / reps
    torch.cuda.synchronize()
    return t


class Clock:
    """CUDA events on a GPU (GPU time between the call's start and end), perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, start):
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return (start, e)
        return time.perf_counter() - start

    def ms(self, mark) -> float:
        if self.cuda:
            return mark[0].elapsed_time(mark[1])
        return mark * 1e3

    def sync(self) -> None:
        _sync(self.cuda)


def interleaved(calls: dict, reps: int, warmup: int, device, batch: int = 1) -> dict:
    """Median ms per call of each callable, called in turn `reps` times after warm-up, in a new (seeded) random order
    each round: with a fixed or rotating order each call always follows the same other one, and a call right after
    a slow one can measure slower than it does elsewhere.

    batch 1: each call is timed alone from an idle GPU (its CPU time to launch counts where it is the longer).
    batch > 1: each sample times `batch` calls back to back from an idle GPU, divided by `batch`: the launches
    overlap the GPU's work, so the time is the kernels' own (what a bandwidth figure means)."""
    clock = Clock(device)
    names = list(calls)
    for _ in range(warmup):
        for n in names:
            calls[n]()
    clock.sync()
    marks = {n: [] for n in names}
    rng = random.Random(0)
    for _ in range(reps):
        for n in rng.sample(names, len(names)):
            clock.sync()  # each call starts on an idle GPU: no queued work of another implementation hides its CPU time
            t0 = clock.start()
            for _ in range(batch):
                calls[n]()
            marks[n].append(clock.stop(t0))
    clock.sync()
    return {n: statistics.median(clock.ms(m) for m in marks[n]) / batch for n in names}


# ---------------------------------------------------------------------------------------------------- memory
def peak_rss_gib() -> float:
    """This process's peak resident set (ru_maxrss, memory-mapped file pages included), GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_json(cmd: Sequence[str], what: str = "") -> dict:
    """Run one configuration in its own process (so its peak RSS is its own) and return the JSON object it printed
    as its last stdout line; a failure exits with the child's stderr tail."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{what or cmd[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def module_cmd(module: str, *args: str) -> list[str]:
    """The command line that runs `python -m <module> args...` with this interpreter (`run_json` runs it from the
    repository root)."""
    return [sys.executable, "-m", module, *args]


# ----------------------------------------------------------------------------------------------- environment
def versions(names: Sequence[str] = SOFTWARE) -> dict[str, str]:
    """Installed versions of `names` (the distributions that are installed) and Python's."""
    import importlib.metadata

    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_vector_isa() -> str:
    """The widest vector instructions the CPU has for matrix products, from /proc/cpuinfo's flags ("" where they
    cannot be read): hosts of one name differ (bf16 products run on AVX-512 BF16 or AMX, a slow path on AVX2)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return ""


def hardware(device: str = "cpu") -> str:
    """The CPU (model, vector instructions, core count) and, for a CUDA device, the GPU's name and count."""
    isa = cpu_vector_isa()
    text = f"{cpu_name()}{f' ({isa})' if isa else ''}, {os.cpu_count()} CPUs"
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            text = f"{n} x {torch.cuda.get_device_name(0)}; " + text
    return text


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def environment(device: str = "cpu") -> dict:
    """hardware, software, date (UTC) and load average of this run."""
    return dict(
        hardware=hardware(device),
        software=versions(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        load_average=load_average(),
    )


# -------------------------------------------------------------------------------------------------- results
def add_output_args(ap: argparse.ArgumentParser) -> None:
    """--results-dir and --out: where `write_results` puts the file (a smoke run points them elsewhere)."""
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="folder of <capability>.json results (default benchmarks/results)",
    )
    ap.add_argument("--out", type=Path, help="write the results JSON to this file instead")
    ap.add_argument("--no-results", action="store_true", help="print the table only, write no results file")


def command_line(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """`python -m <module> <args>` as run, without the output options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--results-dir", "--out"):
            skip = True
            continue
        if a.startswith(("--results-dir=", "--out=")) or a == "--no-results":
            continue
        kept.append(a)
    return " ".join(["python", "-m", module, *map(shlex.quote, kept)])


def results(
    capability: str,
    title: str,
    command: str,
    columns: Sequence[str],
    rows: Sequence[Sequence],
    notes: Sequence[str] = (),
    device: str = "cpu",
    env: Optional[dict] = None,
) -> dict:
    """A results record in the schema above; `env` defaults to this run's `environment(device)`."""
    env = environment(device) if env is None else env

    def cell(v):  # JSON has no NaN or infinity
        return "-" if isinstance(v, float) and not math.isfinite(v) else v

    return dict(
        capability=capability,
        title=title,
        command=command,
        date=env["date"],
        hardware=env["hardware"],
        software=env["software"],
        load_average=env["load_average"],
        columns=list(columns),
        rows=[[cell(v) for v in r] for r in rows],
        notes=list(notes),
    )


def write_json(path: Path, record: dict) -> Path:
    """Write `record` to `path` atomically (a temporary file in the same folder, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_results(args: argparse.Namespace, record: dict, part: str = "") -> Optional[Path]:
    """Write `record` where `add_output_args`'s options say (`--out`, else `--results-dir`/<capability>.json);
    None with --no-results. `part` names a script's second record: with --out it goes to `<stem>-<part>.json`
    beside it. Prints the path to stderr."""
    if getattr(args, "no_results", False):
        return None
    if getattr(args, "out", None):
        out = args.out.with_name(f"{args.out.stem}-{part}{args.out.suffix}") if part else args.out
    else:
        out = Path(args.results_dir) / f"{record['capability']}.json"
    path = write_json(out, record)
    print(f"wrote {path}", file=sys.stderr)
    return path


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table of `rows` under `columns` (cells as they are: strings, or numbers as Python writes them)."""

    def cell(v) -> str:
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
