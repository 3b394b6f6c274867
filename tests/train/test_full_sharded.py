"""`juno-py full --shard` (FSDP2) with torchrun and Gloo on the CPU, on the tiny model with Q8_0 bytes: 2 and 3
processes train what one process trains with the same per-shard algorithm (GaLore with row_chunks N; AdamW), each
holds about 1/N of the dense targets, of the quantized base and of GaLore's state (measured from its tensors), a run
resumes from its shards bit for bit, and on one process `--shard` writes the GGUF a plain run writes."""

import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.gguf import GGUFFile
from juno_py.models import load_model
from juno_py.train.data import load_dataset
from juno_py.train.dense import build_dense_optimizer, densify
from juno_py.train.distributed import DistributedError
from juno_py.train.galore import GaLoreConfigError, resolve_update_mode, row_pieces
from juno_py.train.loop import TrainConfig, train
from juno_py.train.sharded import frozen_linears
from tests.train.full_shard_worker import FULL_RUNS, PART_STEPS, TARGETS, full_run
from tests.train.test_sharded import launch, rel_diff, run

REL = 1e-6  # fp32 sums in another order: the target of sharded training


@pytest.fixture(scope="module")
def sharded_runs(q8_path, data, tmp_path_factory):
    """full_shard_worker on 2 processes (the runs and the resume) and on 3 (the runs)."""
    out = tmp_path_factory.mktemp("full-sharded")
    for n, scenarios in ((2, "train,resume"), (3, "train")):
        r = run(launch(n, "-m", "tests.train.full_shard_worker", q8_path, data, out, scenarios))
        assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def one_process(q8_path, data, tmp_path_factory):
    """The references in one process: GaLore with each matrix split into 1, 2 and 3 row pieces; AdamW."""
    out = tmp_path_factory.mktemp("full-one")
    runs = {}
    for name, chunks in (("galore", 1), ("galore", 2), ("galore", 3), ("adamw", 1)):
        runs[name, chunks] = full_run(q8_path, data, out / f"{name}-{chunks}.gguf", name, row_chunks=chunks)
    return out, runs


def trained_tensors(path, base) -> dict[str, torch.Tensor]:
    got, before = GGUFFile(path), GGUFFile(base)
    out = {}
    for name in got.tensors:
        t = got.dequantize(name).double()
        if not torch.equal(t, before.dequantize(name).double()):
            out[name] = t
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(FULL_RUNS))
def test_sharded_full_training_equals_one_process_running_the_same_pieces(name, n, sharded_runs, one_process, q8_path):
    folder, runs = one_process
    chunks = n if name == "galore" else 1  # AdamW is elementwise: its pieces are the whole matrices' rows
    one, got = runs[name, chunks], json.loads((sharded_runs / f"{name}-{n}.json").read_text())
    assert got["steps"] == one["steps"] == 4 and got["tokens"] == one["tokens"]
    assert got["best_step"] == one["best_step"]
    assert got["best_validation"] == pytest.approx(one["best_validation"], rel=REL)
    for i, ((loss, norm), (loss1, norm1)) in enumerate(zip(got["loss_and_grad_norm"], one["loss_and_grad_norm"]), 1):
        assert loss == pytest.approx(loss1, rel=REL), f"loss of step {i}"
        assert norm == pytest.approx(norm1, rel=REL), f"gradient norm of step {i}"
    # the clipping was exercised, and agreed: GaLore clipped every matrix by its whole norm, AdamW the global one
    assert got["clipped_matrices"] == one["clipped_matrices"] and got["clipped"] == one["clipped"]
    assert any(got["clipped_matrices"]) if name == "galore" else all(got["clipped"])
    want = trained_tensors(folder / f"{name}-{chunks}.gguf", q8_path)
    have = trained_tensors(sharded_runs / f"{name}-{n}.gguf", q8_path)
    assert sorted(have) == sorted(want) and len(want) == 6  # q, v, down of both blocks
    for key, w in want.items():
        assert rel_diff(have[key], w) <= REL, f"{key}: relative difference {rel_diff(have[key], w):.3g}"


def test_sharded_galore_is_the_per_piece_algorithm_not_the_whole_matrix_one(sharded_runs, one_process, q8_path):
    """The comparison above can tell the algorithms apart: whole-matrix GaLore trains measurably other weights."""
    folder, _ = one_process
    whole = trained_tensors(folder / "galore-1.gguf", q8_path)
    two = trained_tensors(sharded_runs / "galore-2.gguf", q8_path)
    assert max(rel_diff(two[k], w) for k, w in whole.items()) > 100 * REL


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(FULL_RUNS))
def test_each_rank_holds_its_rows_of_the_dense_targets_and_of_the_base(name, n, sharded_runs, one_process, q8_path):
    model = load_model(q8_path)
    densify(model, TARGETS, deferred=True)  # the dense targets leave the tree; the rest stays quantized
    linears = list(frozen_linears(model))
    base = sum(lin.raw.numel() for lin in linears)
    part = sum(math.ceil(lin.raw.shape[0] / n) * lin.raw.shape[1] for lin in linears)  # rows rounded up
    ranks = [json.loads((sharded_runs / f"{name}-{n}-rank{r}.json").read_text()) for r in range(n)]
    for r, q in enumerate(ranks):
        # the dense fp32 masters: exactly this rank's torch.chunk rows of each matrix, in padded storage
        for key, (m, cols) in q["dense_shapes"].items():
            chunks = torch.empty(m, 0).chunk(n)
            assert q["dense_rows"][key] == [chunks[r].shape[0] if r < len(chunks) else 0, cols], key
        whole = sum(4 * m * cols for m, cols in q["dense_shapes"].values())
        padded = sum(4 * math.ceil(m / n) * cols for m, cols in q["dense_shapes"].values())
        assert q["dense_whole"] == whole and whole / n <= q["dense"] <= padded, f"rank {r}: {q['dense']} of {whole}"
        assert q["quantized_base"] == base and base / n <= q["quantized_after_shard"] <= part, f"rank {r}"
        # the whole fp32 matrices were decoded block by block, and each block's freed once FSDP2 sharded it
        assert q["whole_decoded"] == 6 and q["whole_alive_before_block"] == [0, 0] and q["whole_alive_after_shard"] == 0
    if name == "galore":  # the ranks' GaLore state is exactly the pieces' state of one process with row_chunks n
        total = one_process[1]["galore", n]["galore_state"]
        for key in ("moments", "projector", "adamw"):
            assert sum(q["galore_state"][key] for q in ranks) == total[key], key
        # each rank's projectors are of its rows (about 1/n of the whole matrices'); moments of a piece projected
        # on the left are r x columns, as the whole matrix's are (docs/distributed.md)
        whole_matrix = one_process[1]["galore", 1]["galore_state"]
        assert max(q["galore_state"]["projector"] for q in ranks) <= whole_matrix["projector"] / n * 1.1
        assert all(q["galore_state"]["moments"] == whole_matrix["moments"] for q in ranks)


def test_a_sharded_full_run_resumes_from_its_shards_bit_for_bit(sharded_runs):
    whole = json.loads((sharded_runs / "galore-2.json").read_text())
    resumed = json.loads((sharded_runs / "resumed-2.json").read_text())
    assert resumed["steps"] == whole["steps"] and resumed["best_step"] == whole["best_step"]
    assert resumed["loss_and_grad_norm"] == whole["loss_and_grad_norm"][PART_STEPS:]
    assert (sharded_runs / "part-2.gguf").read_bytes() == (sharded_runs / "galore-2.gguf").read_bytes()
    for r in (0, 1):
        assert (sharded_runs / f"part-2.gguf.state.rank{r}-of-2").is_file()
    assert not (sharded_runs / "part-2.gguf.state").exists()


def test_row_pieces_split_as_torch_chunk_does():
    for m in (1, 5, 31, 32, 64, 96):
        for n in (1, 2, 3, 7):
            want = [(j, c.shape[0]) for j, c in enumerate(torch.arange(m).chunk(n))]
            assert [(j, b - a) for j, a, b in row_pieces(m, n)] == want, (m, n)


def test_shard_refusals(q8_path, data):
    r = CliRunner().invoke(
        cli, ["full", "--model-path", str(q8_path), "--data", str(data), "--output", "x.gguf", "--shard"]
    )
    assert r.exit_code == 2 and "--shard splits the model across processes" in r.output
    with pytest.raises(GaLoreConfigError, match="--galore-per-layer with --shard"):
        resolve_update_mode("galore", True, "per-matrix", 1.0, sharded=True)
    assert resolve_update_mode("galore", None, "auto", 1.0, world_size=1, sharded=True)[:2] == (False, "global")
    r = CliRunner().invoke(
        cli, ["full", "--model-path", str(q8_path), "--output", "x.gguf", "--galore-row-chunks", "0"]
    )
    assert r.exit_code == 2 and "--galore-row-chunks" in r.output
    # the Python API: an optimizer built before sharding holds parameters FSDP2 replaces; one process cannot shard
    model = load_model(q8_path)
    train_set, _, _ = load_dataset([data], model.tokenizer, 256, validation_split=0.0, seed=3)
    dense = densify(model, TARGETS, deferred=True)
    cfg = TrainConfig(shard=True, max_steps=1)
    built = build_dense_optimizer("adamw", dense, 1e-4)
    with pytest.raises(DistributedError, match="pass the optimizer as a function that builds it"):
        train(model, dense, train_set, cfg, optimizer=built, progress=False, log=lambda s: None)
    with pytest.raises(DistributedError, match="--shard needs several processes"):
        train(model, dense, train_set, cfg, optimizer=lambda: built, progress=False, log=lambda s: None)


def test_full_shard_on_one_process_writes_the_gguf_of_a_plain_run(q8_path, data, tmp_path):
    """torchrun with one rank: FSDP2 over a world of one is the plain run, bit for bit."""
    args = ["--model-path", q8_path, "--data", data, "--max-steps", 3, "--batch-size", 3, "--galore-rank", 4]
    args += ["--galore-update-gap", 2, "--validation-split", 0.2, "--compute-dtype", "fp32", "--no-progress"]
    args += ["--requant", "f32", "--no-galore-per-layer"]
    out, one = tmp_path / "sharded.gguf", tmp_path / "one.gguf"
    r = run([sys.executable, "-m", "juno_py", "full", "--nproc", "1", "--shard", *map(str, args), "--output", out])
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout == f"{out}\n" and "sharded: the quantized base, the dense targets" in r.stderr
    r1 = CliRunner().invoke(cli, ["full", *map(str, args), "--output", str(one)], catch_exceptions=False)
    assert r1.exit_code == 0, r1.stderr
    assert out.read_bytes() == one.read_bytes()


def test_full_nproc_2_shard_trains_like_one_process_with_two_row_chunks(q8_path, data, tmp_path):
    args = ["--model-path", q8_path, "--data", data, "--max-steps", 2, "--batch-size", 3, "--galore-rank", 4]
    args += ["--validation-split", 0.2, "--compute-dtype", "fp32", "--no-progress", "--requant", "f32"]
    args += ["--targets", "q,v", "--no-galore-per-layer"]
    out, one = tmp_path / "sharded.gguf", tmp_path / "one.gguf"
    r = run([sys.executable, "-m", "juno_py", "full", "--nproc", "2", "--shard", *map(str, args), "--output", out])
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout == f"{out}\n" and r.stderr.count("trained 2 steps") == 1
    for rank in (0, 1):
        assert (tmp_path / f"sharded.gguf.state.rank{rank}-of-2").is_file()
    r1 = CliRunner().invoke(
        cli, ["full", *map(str, args), "--galore-row-chunks", "2", "--output", str(one)], catch_exceptions=False
    )
    assert r1.exit_code == 0, r1.stderr
    want, have = trained_tensors(one, q8_path), trained_tensors(out, q8_path)
    assert sorted(have) == sorted(want) and len(want) == 4
    for key, w in want.items():
        assert rel_diff(have[key], w) <= REL, f"{key}: {rel_diff(have[key], w):.3g}"


def test_a_rerun_does_not_replace_the_shards_of_an_interrupted_run(q8_path, data, tmp_path):
    out = tmp_path / "run.gguf"
    shard = tmp_path / "run.gguf.state.rank0-of-2"
    shard.write_bytes(b"a shard")
    r = CliRunner().invoke(cli, ["full", "--model-path", str(q8_path), "--data", str(data), "--output", str(out)])
    assert r.exit_code == 2 and f"{shard} exists: pass --overwrite to replace it (or --resume" in r.output
    assert shard.read_bytes() == b"a shard"
