"""Sharded training runs of the tests (`--shard`), on the tiny model, started by torchrun on every rank:

    python -m torch.distributed.run --standalone --nproc-per-node N -m tests.train.shard_worker TINY DATA OUT SCENARIOS

SCENARIOS, comma-separated: `train` (each run of SHARD_RUNS into OUT/<name>-<N>.bin, rank 0 writing adapter.bin and
OUT/<name>-<N>.json, the result with the steps' losses and gradient norms; each rank writes the quantized bytes it
was measured to hold to OUT/<name>-<N>-rank<r>.json), `float8` (the `lora` run with the frozen bytes sharded as
float8_e5m2 parameters, as on torch before 2.13: OUT/lora-float8-<N>.bin and .json), `resume` (`lora` interrupted after dist_worker.PART_STEPS
steps into OUT/part-<N>.bin and its shards, then resumed: OUT/resumed-<N>.json). Where OUT holds the shards of a
2-process run and N is not 2, every rank also tries to resume it and writes its error to OUT/refused-rank<r>.txt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from juno_py.train import distributed, sharded
from juno_py.train.state import StateError
from tests.train import dist_worker

# the options added to dist_worker.RUNS' runs: the DoRA run takes whole sequences (sharded runs have no truncated
# BPTT) and gathers one block ahead
SHARD_RUNS = {"lora": {}, "dora": {"bptt_window": 0, "prefetch": 1}}


def watched_run(tiny, data, path: Path, name: str, frozen_dtype=None, **kw):
    """dist_worker.train_run with the sharded model's quantized bytes watched: (result, bytes measured)."""
    measured: dict = {}
    shard = sharded.shard

    def watching(model, world, prefetch=None, before_block=None):
        s = shard(model, world, prefetch, frozen_dtype, before_block)
        s.watch_quantized_bytes()
        measured["model"], measured["after_shard"] = s, s.quantized_bytes()
        return s

    sharded.shard = watching
    try:
        result, _ = dist_worker.train_run(tiny, data, path, name, **kw)
    finally:
        sharded.shard = shard
    s = measured["model"]
    total, block = s.base_bytes()
    held = {
        "after_shard": measured["after_shard"],
        "peak": s.peak_quantized_bytes,
        "base": total,
        "largest_block": block,
    }
    return result, held


def main(argv: list[str]) -> None:
    tiny, data, out, scenarios = argv[0], argv[1], Path(argv[2]), argv[3].split(",")
    world = distributed.init_from_env("cpu")
    n = world.size
    try:
        if "train" in scenarios:
            for name in SHARD_RUNS:
                result, held = watched_run(tiny, data, out / f"{name}-{n}.bin", name, shard=True, **SHARD_RUNS[name])
                (out / f"{name}-{n}-rank{world.rank}.json").write_text(json.dumps(held))
                if world.is_main:
                    (out / f"{name}-{n}.json").write_text(json.dumps(result))
        if "float8" in scenarios:
            path = out / f"lora-float8-{n}.bin"
            result, held = watched_run(tiny, data, path, "lora", frozen_dtype=torch.float8_e5m2, shard=True)
            (out / f"lora-float8-{n}-rank{world.rank}.json").write_text(json.dumps(held))
            if world.is_main:
                (out / f"lora-float8-{n}.json").write_text(json.dumps(result))
        if "resume" in scenarios:
            part = out / f"part-{n}.bin"
            dist_worker.train_run(tiny, data, part, "lora", stop_at=dist_worker.PART_STEPS, shard=True)
            result, _ = dist_worker.train_run(tiny, data, part, "lora", resume=True, shard=True)
            if world.is_main:
                (out / f"resumed-{n}.json").write_text(json.dumps(result))
        if n != 2 and (out / "part-2.bin.state.rank0-of-2").exists():
            try:
                dist_worker.train_run(tiny, data, out / "part-2.bin", "lora", resume=True, shard=True)
            except StateError as e:
                (out / f"refused-rank{world.rank}.txt").write_text(str(e))
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
