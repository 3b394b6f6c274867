"""Training runs of the data-parallel tests, on the tiny model: one process imports `train_run` (the reference),
torchrun starts this module on every rank:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.train.dist_worker SCENARIO TINY DATA OUT

Scenarios: `equal` (the runs of RUNS, and `lora` interrupted after PART_STEPS steps, into OUT/<name>.bin; every
rank also dumps its final adapter weights to OUT/rank<r>-<name>.safetensors; then rank 1 is given other data and
each rank writes the error it refused with to OUT/mismatch-rank<r>.txt), `raise` (rank 1 raises after its
second step while rank 0 goes on into the next step's collectives), `hang` (rank 1 stops answering there instead:
the collectives' timeout, JUNO_PY_DIST_TIMEOUT, ends rank 0).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from juno_py.lora import Mode, attach
from juno_py.metrics import MetricsRecorder
from juno_py.models import load_model
from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.train import distributed
from juno_py.train.data import load_dataset
from juno_py.train.loop import TrainConfig, train

# 11 training sequences and 2 validation ones (juno_py.testing.records MIXED_RECORDS, two Q&A variants)
RUNS = {
    # steps of 6 rows split 3 + 3 and then 5 rows split 3 + 2; validation every step (one sequence per rank)
    "lora": dict(
        mode=Mode.LORA,
        batch_size=3,
        accumulation=2,
        epochs=3,
        validation_every=1,
        patience=0,
        overfit_ratio=0,
        warmup_steps=1,
        min_lr=1e-4,
    ),
    # each epoch's last step has one row: rank 1 sits idle; windows of truncated BPTT; activation checkpointing
    "dora": dict(mode=Mode.DORA, batch_size=2, accumulation=1, epochs=1, bptt_window=16, grad_checkpoint=True),
}
PART_STEPS = 3
FAIL_MESSAGE = "rank 1 fails on purpose after step 2"


def train_run(tiny, data, lora_path, name: str, resume: bool = False, stop_at=None, fault=None, **options):
    """One run of RUNS[name] (`options`: more TrainConfig fields, such as shard=True)."""
    model = load_model(tiny)
    kw = {**RUNS[name], **options}
    train_set, val_set, _ = load_dataset([data], model.tokenizer, 256, qa_variants_n=2, validation_split=0.2, seed=3)
    adapters = attach(model, "all", rank=4, alpha=8, mode=kw.pop("mode"), seed=1)
    cfg = TrainConfig(lr=5e-3, seed=3, lora_path=Path(lora_path), **kw)
    world = distributed.current()
    steps = itertools.count(1)

    def stop() -> bool:
        step = next(steps)
        if fault is not None and world.rank == 1 and step == 2:
            if fault == "hang":
                time.sleep(3600)
            raise RuntimeError(FAIL_MESSAGE)
        return stop_at is not None and step >= stop_at

    recorder = MetricsRecorder()
    result = train(
        model,
        adapters,
        train_set,
        cfg,
        val_set,
        recorder=recorder,
        resume=resume,
        stop_requested=stop,
        progress=False,
        log=lambda s: None,
    )
    steps = [(e.values["loss"], e.values["grad_norm"]) for e in recorder.events if e.kind == "train_step"]
    return {**result.__dict__, "loss_and_grad_norm": steps}, adapters


def _dump(adapters, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({n: p.detach().contiguous() for n, p in adapters.named_parameters()}, str(path))


def main(argv: list[str]) -> None:
    scenario, tiny, data, out = argv[0], argv[1], argv[2], Path(argv[3])
    world = distributed.init_from_env("cpu")
    try:
        if scenario == "equal":
            for name in RUNS:
                result, adapters = train_run(tiny, data, out / f"{name}.bin", name)
                _dump(adapters, out / f"rank{world.rank}-{name}.safetensors")
                if world.is_main:
                    (out / f"{name}.json").write_text(json.dumps(result))
            train_run(tiny, data, out / "part.bin", "lora", stop_at=PART_STEPS)
            if world.rank == 1:  # a host with other data: every rank must refuse to start
                data = write_jsonl(out / "other.jsonl", MIXED_RECORDS[1:])
            try:
                train_run(tiny, data, out / "mismatch.bin", "lora")
            except distributed.DistributedError as e:
                (out / f"mismatch-rank{world.rank}.txt").write_text(str(e))
        elif scenario in ("raise", "hang"):
            train_run(tiny, data, out / "fail.bin", "lora", fault=scenario)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
