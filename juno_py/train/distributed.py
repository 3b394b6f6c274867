"""Data-parallel training on PyTorch's own engine: torchrun starts one process per device, torch.distributed
connects them (Gloo on CPU, NCCL on CUDA), DistributedDataParallel averages the trainable's gradients.

Every rank loads the quantized base and sets up the same trainable (same seed; DDP also broadcasts rank 0's
values). An optimizer step's global batch is the same as in one process (`--batch-size` rows times
`--lora-gradient-accumulation`, whatever the number of processes); `StepShare` deals its rows round robin over
the ranks. Token weighting stays exact across ranks: the supervised tokens of the global batch are all-reduced
first, and each rank's loss is divided by `global tokens / world size`, so DDP's average of the ranks' gradients
is the gradient of the global batch's mean token loss. Losses, counts, validation sums and stop decisions are
all-reduced, so every rank takes the same decisions; only rank 0 writes files.

A rank that fails ends its process; torchrun then stops the others at once. Collectives also time out
(`JUNO_PY_DIST_TIMEOUT` seconds, default 1800), so even without torchrun nothing waits forever.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from juno_py.errors import JunoError
from juno_py.train.data import Batch, collate
from juno_py.train.state import FORMAT, StateError, parse_state, read_state_bytes
from juno_py.train.steps import evaluate as evaluate_local

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "JUNO_PY_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


class DistributedError(JunoError, RuntimeError):
    """A data-parallel setup that cannot work (devices, launcher, environment)."""


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel ranks; `World()` is a single process (nothing to reduce)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: Optional[str] = None  # None: not distributed

    @property
    def active(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files, metrics and progress."""
        return self.rank == 0

    # --- collectives (identity in a single process) ---------------------------------------------------------
    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over the ranks, in float64 (exact for token counts below 2**53)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def max(self, value: int) -> int:
        if not self.active:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def same(self, value: int) -> bool:
        """Whether every rank holds the same integer (one all-reduce of (v, -v) with MAX)."""
        if not self.active:
            return True
        t = torch.tensor([int(value), -int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0]) == -int(t[1])

    def barrier(self) -> None:
        """Wait for every rank (an all-reduce, which both backends run on this rank's own device)."""
        if self.active:
            self.max(0)

    def broadcast_bytes(self, data: Optional[bytes]) -> Optional[bytes]:
        """Rank 0's bytes on every rank; None everywhere when rank 0 passes None. No pickling: a length, then raw
        uint8."""
        if not self.active:
            return data
        n = torch.tensor(
            [len(data) if (self.is_main and data is not None) else -1], dtype=torch.int64, device=self.device
        )
        dist.broadcast(n, src=0)
        size = int(n.item())
        if size < 0:
            return None
        if self.is_main:
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                if size
                else torch.empty(0, dtype=torch.uint8, device=self.device)
            )
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=0)
        return data if self.is_main else buf.cpu().numpy().tobytes()


SINGLE = World()
_world: Optional[World] = None


# ------------------------------------------------------------------------------------------------ joining
def launched_by_torchrun() -> bool:
    """torchrun (or another launcher that sets its variables) started this process as one rank of a job."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistributedError(f"environment variable {TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def rank_device(device: str, local_rank: int, local_size: int) -> torch.device:
    """The device of one rank: `cuda` becomes this rank's GPU (`cuda:LOCAL_RANK`); CPU stays CPU."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DistributedError(f"--device {device}: data-parallel training runs on cpu (Gloo) or cuda (NCCL)")
    if dev.index is not None and local_size > 1:
        raise DistributedError(
            f"--device {device} with {local_size} processes on this host: give --device cuda, "
            f"each rank then uses GPU LOCAL_RANK"
        )
    index = dev.index if dev.index is not None else local_rank
    available = torch.cuda.device_count()
    if index >= available:
        raise DistributedError(
            f"rank with LOCAL_RANK {local_rank}: GPU {index} requested, {available} visible; "
            f"start at most {available} processes per host"
        )
    return torch.device("cuda", index)


def init_from_env(device: str = "cpu") -> World:
    """Join the process group torchrun describes in the environment: NCCL for `cuda` (each rank on GPU
    LOCAL_RANK), Gloo for `cpu`. Outside torchrun: the single-process `World()`."""
    global _world
    if not launched_by_torchrun():
        return SINGLE
    if dist.is_initialized():
        return current()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    dev = rank_device(device, local_rank, local_size)
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    _world = World(rank, size, local_rank, dev, dist.get_backend())
    return _world


def current() -> World:
    """The world of this process: the one `init_from_env` joined, one set up by the caller's own
    `init_process_group`, or a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return SINGLE
    if _world is not None:
        return _world
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device, backend)


SHUTDOWN_BARRIER_S = 60.0


def shutdown() -> None:
    """Leave the process group. On Gloo, after a run that ended without an exception, every rank first waits for
    the others (a monitored barrier, bounded): a rank that tore its group down while a peer was still finishing
    aborted now and then ("terminate called without an active exception": 2 to 5 runs in 12 of
    tests/train/dist_worker.py on 2 CPUs, none in 16 with the barrier). With an exception in flight a peer may be
    dead or hung, and nothing waits for it."""
    global _world
    if dist.is_available() and dist.is_initialized():
        if sys.exc_info()[0] is None and dist.get_backend() == "gloo":
            try:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=SHUTDOWN_BARRIER_S))
            except RuntimeError:  # a peer that did not arrive: leave anyway
                pass
        dist.destroy_process_group()
    _world = None


def local_first(world: World, fn: Callable, *args):
    """fn(*args) on each host's local rank 0 first, then on the other ranks: a model pulled into the store's cache
    on first use is downloaded once per host, not once per process."""
    if world.active and world.local_rank != 0:
        world.barrier()
    out = fn(*args)
    if world.active and world.local_rank == 0:
        world.barrier()
    return out


# ------------------------------------------------------------------------------------------ the gradients
def check_same_data(world: World, fingerprints: dict[str, str]) -> None:
    """Every rank must plan the same epochs: compare the data fingerprints (sha256 hex) across the ranks."""
    for what, digest in fingerprints.items():
        if not world.same(int(digest[:15], 16)):
            raise DistributedError(
                f"the ranks hold different {what} (rank {world.rank}: sha256 {digest[:12]}...): "
                f"give every host the same files"
            )


def wrap(model: torch.nn.Module, world: World, updates_in_backward: bool = False):
    """DistributedDataParallel over the whole model, when distributed; None otherwise.

    Only the trainable's parameters require gradients, so only they are bucketed and all-reduced. The frozen base
    lives in buffers (quantized bytes memory-mapped from the GGUF, norms, RoPE tables) and in frozen parameters:
    all of them are excluded from DDP's broadcast at construction and before each forward, since every rank
    loaded the same file, and a broadcast would write into the read-only mapping."""
    if not world.active:
        return None
    if updates_in_backward:
        raise DistributedError(
            "an optimizer that updates weights during backward (GaLore's per-layer mode) cannot "
            "run data-parallel: the gradients must be all-reduced first"
        )
    from torch.nn.parallel import DistributedDataParallel as DDP

    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    buffers = [n for n, _ in model.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, frozen + buffers)
    return DDP(model, device_ids=None, find_unused_parameters=False)


# ------------------------------------------------------------------------------------------- the data
def shard_rows(rows: Sequence, batch_size: int, world: World) -> list[list]:
    """This rank's micro-batches of one step: the step's rows (every row of its micro-batches, in order) dealt
    round robin, regrouped into micro-batches of at most `batch_size` rows. In one process: the step's own
    micro-batches. Empty when the step has fewer rows than there are ranks."""
    mine = list(rows)[world.rank :: world.size]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


class StepShare:
    """One rank's part of one optimizer step: its batches, and the global supervised and real token counts."""

    def __init__(
        self,
        step_batches: Sequence[Sequence],
        batch_size: int,
        pad_id: int,
        world: World,
        seed: int = 0,
        step: int = 0,
        sharded: bool = False,
    ):
        self.world, self.seed, self.step, self.sharded = world, seed, step, sharded
        rows = [row for batch in step_batches for row in batch]
        self.batches: list[Batch] = [collate(part, pad_id) for part in shard_rows(rows, batch_size, world)]
        # an idle rank (fewer rows than ranks) still runs one row with weight 0, so its DDP backward matches
        # the others' all-reduces. Sharded, every rank runs as many micro-batches as the busiest one (each forward
        # and backward gathers the blocks in a collective): the extra ones are a row with weight 0.
        self.idle: Optional[Batch] = None if self.batches else collate(rows[:1], pad_id)
        self.fillers = world.max(len(self.batches)) - len(self.batches) if sharded else 0
        if sharded and not self.batches:
            self.fillers -= 1  # the idle row is one of them
        local = (sum(b.n_supervised for b in self.batches), sum(b.n_real for b in self.batches))
        n_sup, n_tok = world.sum(local)
        self.n_supervised, self.n_tokens = int(n_sup), int(n_tok)

    def forward_backward(self, fb: Callable[..., float], model, net, window: int, times: dict) -> float:
        """Run `fb` (`steps.forward_backward`) over this rank's batches with the per-rank denominator; DDP syncs in
        the last backward. Returns the global batch's summed token loss (all-reduced).

        Denominator: DDP averages the ranks' gradients, so each rank divides by `global tokens / world size`; the
        sharded reduce-scatter sums them, so each divides by the global tokens."""
        world = self.world
        if world.rank:  # rank 0 keeps the single-process dropout stream (the resume state stores it)
            torch.manual_seed(dropout_seed(self.seed, world.rank, self.step))
        batches = self.batches or [self.idle]
        share = 1 if self.sharded else world.size
        denominator = max(self.n_supervised, 1) / share if self.batches else math.inf
        runs = [(b, denominator) for b in batches] + [(batches[0], math.inf)] * self.fillers
        total = 0.0
        for i, (b, d) in enumerate(runs):
            value = fb(model, b, d, window, times, net=net, sync=i == len(runs) - 1)
            total += value if math.isfinite(d) else 0.0
        return world.sum([total if self.batches else 0.0])[0]


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """The dropout seed of rank > 0 at a step: a function of (seed, rank, step), so a resume, on any number of
    processes, draws the same masks as the uninterrupted run."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729) % (2**63)


# ---------------------------------------------------------------------------------------- agreement
def evaluate(model, examples: Sequence, batch_size: int, pad_id: int, world: World, sharded: bool = False) -> dict:
    """`steps.evaluate` over the ranks: each scores its share of `examples`, the sums are all-reduced, so every rank
    gets the same {"loss", "ppl", "tokens"}. `sharded`: every rank runs as many batches as the busiest one."""
    if not world.active:
        return evaluate_local(model, examples, batch_size, pad_id)
    mine = list(examples)[world.rank :: world.size]
    batches = world.max(math.ceil(len(mine) / max(1, batch_size))) if sharded else 0
    part = evaluate_local(model, mine, batch_size, pad_id, min_batches=batches, filler=list(examples)[:1])
    total, n = world.sum([part["loss"] * part["tokens"] if part["tokens"] else 0.0, part["tokens"]])
    loss = total / n if n else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)) if n else float("nan"), "tokens": int(n)}


def agree_stop(reason: Optional[str], world: World) -> Optional[str]:
    """Every rank stops at the same step. The stop rules see the same all-reduced numbers on every rank; a signal
    (Ctrl-C, torchrun forwarding SIGINT) may reach the ranks at different steps, so the decision is all-reduced."""
    if not world.active:
        return reason
    anyone = world.max(1 if reason is not None else 0)
    return reason if reason is not None or not anyone else "interrupted"


def read_state(path, fmt: str = FORMAT) -> tuple[dict, dict]:
    """state.load_state, read by rank 0 and broadcast: on several hosts only rank 0's disk needs the file."""
    world = current()
    if not world.active:
        return parse_state(read_state_bytes(path), path, fmt)
    data, problem = None, None
    if world.is_main:
        try:
            data = read_state_bytes(path)
        except StateError as e:
            problem = e
    data = world.broadcast_bytes(data)
    if problem is not None:
        raise problem
    if data is None:
        raise StateError(f"{Path(path)}: rank 0 found no resume state to share")
    return parse_state(data, path, fmt)
