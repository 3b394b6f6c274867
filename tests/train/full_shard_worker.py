"""Sharded full-parameter training runs of the tests (`juno-py full --shard`), on the tiny model with Q8_0 bytes,
started by torchrun on every rank; one process imports `full_run` for the references:

    python -m torch.distributed.run --standalone --nproc-per-node N -m tests.train.full_shard_worker TINY DATA OUT SCENARIOS

SCENARIOS, comma-separated: `train` (each run of FULL_RUNS into OUT/<name>-<N>.gguf, rank 0 writing it and
OUT/<name>-<N>.json, the result with the steps' losses and gradient norms; each rank writes what it was measured to
hold to OUT/<name>-<N>-rank<r>.json), `resume` (`galore` interrupted after PART_STEPS steps into OUT/part-<N>.gguf's
shards, then resumed: OUT/resumed-<N>.json and OUT/part-<N>.gguf).
"""

from __future__ import annotations

import gc
import itertools
import json
import sys
import weakref
from pathlib import Path
from typing import Optional

from juno_py.merge import merge_trained
from juno_py.metrics import MetricsRecorder
from juno_py.models import load_model
from juno_py.train import distributed, sharded
from juno_py.train.data import load_dataset
from juno_py.train.dense import build_dense_optimizer, densify
from juno_py.train.galore import GaLoreConfig
from juno_py.train.loop import TrainConfig, train
from juno_py.train.sharded import is_sharded, local_part

# three of the seven targets train (the others stay quantized, sharded as `lora --shard` shards them)
TARGETS = "q,v,down"
# steps of 6 rows (3 + 3 micro-batches), validation every step; GaLore rank 4 refreshed every 2 steps (staggered),
# randomized SVD; `galore` clips each matrix to a norm its gradients exceed, `adamw` clips the global norm
FULL_RUNS = {
    "galore": dict(optimizer="galore", galore=dict(rank=4, update_gap=2, max_matrix_norm=0.05), max_grad_norm=0.0),
    "adamw": dict(optimizer="adamw", max_grad_norm=0.05),
}
COMMON = dict(batch_size=3, accumulation=2, max_steps=4, epochs=None, validation_every=1, patience=0, overfit_ratio=0)
PART_STEPS = 2


def full_run(
    tiny,
    data,
    output: Path,
    name: str,
    shard: bool = False,
    row_chunks: int = 1,
    resume: bool = False,
    stop_at: Optional[int] = None,
    watch: Optional[dict] = None,
):
    """One run of FULL_RUNS[name]; rank 0 (or the one process) writes `output`, the merged GGUF (f32 targets).
    `watch`: filled with the bytes this rank holds (sharded), and how many of the whole matrices decoded for the
    sharding were still alive before each block's decoding and after the sharding (weak references)."""
    spec = FULL_RUNS[name]
    model = load_model(tiny)
    train_set, val_set, _ = load_dataset([data], model.tokenizer, 256, qa_variants_n=2, validation_split=0.2, seed=3)
    dense = densify(model, TARGETS, deferred=shard)
    recorder = MetricsRecorder()
    galore = GaLoreConfig(**spec.get("galore", {}), row_chunks=row_chunks)
    lr = 1e-3 if spec["optimizer"] == "galore" else 1e-4
    built: list = []

    def build():
        built.append(build_dense_optimizer(spec["optimizer"], dense, lr, 0.01, galore, seed=3, recorder=recorder))
        return built[-1]

    cfg = TrainConfig(lr=lr, seed=3, lora_path=output, shard=shard, max_grad_norm=spec["max_grad_norm"], **COMMON)
    steps = itertools.count(1)
    held: dict = {"whole_alive_before_block": []}
    shard_fn = sharded.shard
    decoded: list = []  # weak references to the whole matrices decoded for the sharding
    materialize = dense.materialize

    def watching_materialize(module=None):
        gc.collect()  # the whole matrices of the blocks sharded so far: still alive?
        held["whole_alive_before_block"].append(sum(r() is not None for r in decoded))
        materialize(module)
        fresh = [lin.weight for lin in dense.linears.values() if not (lin.weight.is_meta or is_sharded(lin.weight))]
        decoded.extend(weakref.ref(w) for w in fresh)
        del fresh

    def watching(model, world, prefetch=None, frozen_dtype=None, before_block=None):
        s = shard_fn(model, world, prefetch, frozen_dtype, before_block)
        gc.collect()
        held["whole_alive_after_shard"], held["whole_decoded"] = sum(r() is not None for r in decoded), len(decoded)
        held["quantized_after_shard"] = s.quantized_bytes()
        held["quantized_base"] = s.base_bytes()[0]
        return s

    if shard:
        dense.materialize = watching_materialize  # type: ignore[method-assign]

    sharded.shard = watching
    try:
        result = train(
            model,
            dense,
            train_set,
            cfg,
            val_set,
            recorder=recorder,
            resume=resume,
            stop_requested=lambda: stop_at is not None and next(steps) >= stop_at,
            optimizer=build,
            progress=False,
            log=lambda s: None,
        )
    finally:
        sharded.shard = shard_fn
    world = distributed.current()
    if watch is not None:
        params = list(dense.parameters())
        watch.update(held)
        watch["dense"] = sum(local_part(p).untyped_storage().nbytes() for p in params)
        watch["dense_whole"] = sum(4 * p.numel() for p in params)
        watch["dense_rows"] = {k: list(local_part(lin.weight).shape) for k, lin in dense.linears.items()}
        watch["dense_shapes"] = {k: list(lin.weight.shape) for k, lin in dense.linears.items()}
        if spec["optimizer"] == "galore":
            watch["galore_state"] = built[-1].state_size()
    if result.stop_reason != "interrupted":
        dense.gather(keep=world.is_main)
        if world.is_main:
            merge_trained(dense, tiny, output, "f32")
        world.barrier()
    events = [e.values for e in recorder.events if e.kind == "train_step"]
    clipped = [e.values["clipped_matrices"] for e in recorder.events if e.kind == "galore"]
    out = {
        **result.__dict__,
        "loss_and_grad_norm": [(e["loss"], e["grad_norm"]) for e in events],
        "clipped": [bool(e["clipped"]) for e in events],
        "clipped_matrices": clipped,
    }
    if spec["optimizer"] == "galore" and not shard:
        out["galore_state"] = built[-1].state_size()
    return out


def main(argv: list[str]) -> None:
    tiny, data, out, scenarios = argv[0], argv[1], Path(argv[2]), argv[3].split(",")
    world = distributed.init_from_env("cpu")
    n = world.size
    try:
        if "train" in scenarios:
            for name in FULL_RUNS:
                held: dict = {}
                result = full_run(tiny, data, out / f"{name}-{n}.gguf", name, shard=True, watch=held)
                (out / f"{name}-{n}-rank{world.rank}.json").write_text(json.dumps(held))
                if world.is_main:
                    (out / f"{name}-{n}.json").write_text(json.dumps(result))
        if "resume" in scenarios:
            part = out / f"part-{n}.gguf"
            full_run(tiny, data, part, "galore", shard=True, stop_at=PART_STEPS)
            result = full_run(tiny, data, part, "galore", shard=True, resume=True)
            if world.is_main:
                (out / f"resumed-{n}.json").write_text(json.dumps(result))
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
