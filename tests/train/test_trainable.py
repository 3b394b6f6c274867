"""The `Trainable` Protocol and the optimizers' `TrainOptimizer` base: what the training loop asks of each, answered by
the adapters (`AdapterSet`) and by dense targets (`DenseTargets`). Training runs with each are in test_loop.py and
test_galore_full.py."""

import torch

from juno_py.gguf import GGMLType
from juno_py.lora import AdapterSet, Mode, attach
from juno_py.models import load_model
from juno_py.train.dense import DenseTargets, build_dense_optimizer, densify
from juno_py.train.galore import GaLoreConfig
from juno_py.train.optim import AdamW, TorchOptimizer, TrainOptimizer, as_train_optimizer, build_optimizer
from juno_py.train.trainable import StepNote, Trainable


def test_adapters_and_dense_targets_are_trainables(tiny_gguf):
    path = tiny_gguf("llama", GGMLType.Q8_0)
    aset = attach(load_model(path), "qv", rank=2, alpha=4, mode=Mode.DORA)
    dense = densify(load_model(path), "qv")
    assert isinstance(aset, AdapterSet) and isinstance(aset, Trainable)
    assert isinstance(dense, DenseTargets) and isinstance(dense, Trainable)
    assert not isinstance(torch.nn.Linear(2, 2), Trainable)  # parameters() alone is not a trainable
    for t in (aset, dense):
        names = [n for n, _ in t.named_parameters()]
        assert [id(p) for p in t.parameters()] == [id(p) for _, p in t.named_parameters()] and len(set(names)) == len(
            names
        )
        grouped = [p for g in t.param_groups(1e-3, 0.01) for p in g["params"]]
        assert sorted(map(id, grouped)) == sorted(map(id, t.parameters()))
    assert aset.state_format != dense.state_format


def test_the_hooks_of_adapters_and_dense_targets(tiny_gguf):
    path = tiny_gguf("llama", GGMLType.Q8_0)
    dora = attach(load_model(path), "qv", rank=2, alpha=4, mode=Mode.DORA)
    lora = attach(load_model(path), "qv", rank=2, alpha=4, dropout=0.1)
    dense = densify(load_model(path), "qv")
    # on a CPU DoRA's norms are computed before the step's forward, and the loop is told how many
    note = dora.before_step()
    assert isinstance(note, StepNote) and note.event == "norm_refresh" and note.values["modules"] == len(dora.modules)
    assert "in_step" not in note.values and note.values["ms"] >= 0.0
    kept = dora.derived_tensors()
    assert len(kept) == len(dora.modules) and all(
        t.shape == (m.out_features,) for t, m in zip(kept, dora.modules.values())
    )
    dora.after_optimizer_step()  # a fused optimizer bumps no version counter: the norms go
    assert dora.derived_tensors() == []
    assert lora.before_step() is None and dense.before_step() is None
    assert dora.graph_blocker() is None
    assert "dropout" in lora.graph_blocker() and "dense" in dense.graph_blocker()
    assert dense.derived_tensors() == [] and dense.save("unused") is None


def test_every_optimizer_the_loop_runs_is_a_train_optimizer(tiny_gguf):
    path = tiny_gguf("llama", GGMLType.Q8_0)
    aset = attach(load_model(path), "qv", rank=2, alpha=4)
    dense = densify(load_model(path), "qv")
    cpu = build_optimizer(aset, 1e-3)
    galore = build_dense_optimizer("galore", dense, 1e-3, galore=GaLoreConfig(rank=2, per_layer=True))
    adamw = build_dense_optimizer("adamw", dense, 1e-3)
    plain = torch.optim.AdamW(list(aset.parameters()), lr=1e-3)
    wrapped = as_train_optimizer(plain)
    assert isinstance(cpu, AdamW) and isinstance(adamw, TorchOptimizer) and isinstance(wrapped, TorchOptimizer)
    assert all(isinstance(o, TrainOptimizer) for o in (cpu, galore, adamw, wrapped))
    assert as_train_optimizer(cpu) is cpu and wrapped.param_groups is plain.param_groups
    assert galore.updates_in_backward and not any(o.updates_in_backward for o in (cpu, adamw, wrapped))
    assert [g["name"] for g in cpu.param_groups] == ["A", "B"] and [g["name"] for g in adamw.param_groups] == [
        "weights"
    ]
