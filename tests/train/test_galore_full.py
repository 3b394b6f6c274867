"""Full-parameter training on the tiny model: dense targets, GaLore through the real loop (per-layer mode, resume,
divergence), and `juno-py full` writing a GGUF through the merge stage."""

import json

import pytest
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.gguf import GGUFFile
from juno_py.models import load_model
from juno_py.train.data import load_dataset
from juno_py.train.dense import STATE_FORMAT, build_dense_optimizer, densify
from juno_py.train.galore import GaLoreConfig
from juno_py.train.loop import TrainConfig, train
from juno_py.train.state import load_state, save_state, state_path
from juno_py.train.steps import TrainingDiverged


def examples(model, data, n=8):
    return load_dataset([data], model.tokenizer, 256)[0][:n]


def galore_run(
    tiny_path, data, steps, per_layer=True, path=None, resume=False, gap=2, max_matrix_norm=0.5, stop_at=None, **cfg_kw
):
    model = load_model(tiny_path)
    dense = densify(model, "all")
    opt = build_dense_optimizer(
        "galore",
        dense,
        1e-2,
        0.01,
        GaLoreConfig(rank=4, update_gap=gap, per_layer=per_layer, max_matrix_norm=max_matrix_norm),
        seed=3,
    )
    cfg = TrainConfig(
        lr=1e-2, batch_size=2, max_steps=steps, epochs=None, max_grad_norm=0.0, seed=1, lora_path=path, **cfg_kw
    )
    count = iter(range(1, 10_000))
    stop = (lambda: next(count) >= stop_at) if stop_at else None
    result = train(
        model,
        dense,
        examples(model, data),
        cfg,
        progress=False,
        log=lambda s: None,
        resume=resume,
        optimizer=opt,
        stop_requested=stop,
    )
    return {k: p.detach().clone() for k, p in dense.named_parameters()}, opt, result


def test_dense_linear_gradients_match_finite_differences():
    from juno_py.train.dense import DenseLinearFn

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: DenseLinearFn.apply(x, w, bias, torch.float64), (x, w))


def test_densified_model_computes_what_the_quantized_one_does(tiny_gguf):
    from juno_py.gguf import GGMLType

    path = tiny_gguf("llama", GGMLType.Q8_0)
    model = load_model(path)
    ids = list(range(5, 30))
    before = model.logits(ids)
    dense = densify(model, "qv")
    assert sorted(dense.linears) == ["0:wq", "0:wv", "1:wq", "1:wv"]
    assert [p.requires_grad for p in model.parameters()].count(True) == 4
    torch.testing.assert_close(model.logits(ids), before, rtol=1e-5, atol=1e-5)
    # the masters are the exact dequantized values, so the untrained deltas are exactly zero
    for key, delta in dense.deltas().items():
        assert float(delta().abs().max()) == 0.0, key


def test_per_layer_updates_in_the_loop_equal_updates_after_backward(tiny_path, mixed_data):
    per_layer, opt, _ = galore_run(tiny_path, mixed_data, 4, per_layer=True)
    after, _, _ = galore_run(tiny_path, mixed_data, 4, per_layer=False)
    moved = 0.0
    for key, w in after.items():
        torch.testing.assert_close(per_layer[key], w, rtol=0, atol=0, msg=key)
        base = densify(load_model(tiny_path), [key.split(":")[1]]).base_weight(key)
        moved = max(moved, float((w - base).abs().max()))
    assert moved > 1e-3
    assert opt.summary()["matrices"]["0:wq"]["refreshes"] >= 2


def test_galore_resume_is_bit_exact(tiny_path, mixed_data, tmp_path):
    straight, _, _ = galore_run(tiny_path, mixed_data, 6, path=tmp_path / "a.gguf")
    part = galore_run(tiny_path, mixed_data, 6, path=tmp_path / "b.gguf", stop_at=3)[2]
    assert part.stop_reason == "interrupted" and part.steps == 3
    tensors, meta = load_state(state_path(tmp_path / "b.gguf"), STATE_FORMAT)
    assert meta["adam_steps"]["matrices"]["0:wq"]["step"] == 3
    assert {"galore/0:wq/exp_avg", "galore/0:wq/exp_avg_sq", "galore/0:wq/projector", "param/0:wq"} <= set(tensors)
    resumed, opt, result = galore_run(tiny_path, mixed_data, 6, path=tmp_path / "b.gguf", resume=True)
    assert result.steps == 6 and opt.steps == 6
    for key, w in straight.items():
        torch.testing.assert_close(resumed[key], w, rtol=0, atol=0, msg=key)
    # another GaLore setting cannot continue this state
    with pytest.raises(Exception, match="GaLore settings differ"):
        galore_run(tiny_path, mixed_data, 6, path=tmp_path / "b.gguf", resume=True, gap=3)


def test_a_non_finite_gradient_in_per_layer_mode_keeps_the_last_checkpoint(tiny_path, mixed_data, tmp_path):
    model = load_model(tiny_path)
    dense = densify(model, "all")
    opt = build_dense_optimizer("galore", dense, 1e-2, 0.0, GaLoreConfig(rank=4, per_layer=True))
    calls = {"n": 0}

    def poison(grad):  # the second step's gradient of one early matrix is infinite
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    dense.linears["0:wq"].weight.register_hook(poison)
    out = tmp_path / "x.gguf"
    cfg = TrainConfig(lr=1e-2, batch_size=2, max_steps=4, epochs=None, max_grad_norm=0.0, save_every=1, lora_path=out)
    with pytest.raises(TrainingDiverged, match="step 2: the gradient norm is inf.*per-layer updates had already"):
        train(model, dense, examples(model, mixed_data), cfg, progress=False, log=lambda s: None, optimizer=opt)
    tensors, meta = load_state(state_path(out), STATE_FORMAT)
    assert meta["run"]["step"] == 1  # the checkpoint of step 1, not a half-updated step 2
    # backward reaches 0:wq last: the matrices after it had already stepped, 0:wq had not
    assert torch.equal(dense.linears["0:wq"].weight.detach(), tensors["param/0:wq"])
    assert not torch.equal(dense.linears["1:wdown"].weight.detach(), tensors["param/1:wdown"])


# ------------------------------------------------------------------------------------------------ the command
def invoke(*args):
    return CliRunner().invoke(cli, ["full", *map(str, args)], catch_exceptions=False)


def test_full_command_writes_a_gguf_holding_the_trained_weights(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "full.gguf"
    r = invoke(
        "--model-path",
        tiny_path,
        "--data",
        mixed_data,
        "--output",
        out,
        "--max-steps",
        4,
        "--galore-rank",
        4,
        "--galore-update-gap",
        2,
        "--lr",
        1e-2,
        "--validation-split",
        0.2,
        "--requant",
        "source",
        "--report",
        tmp_path / "report.json",
        "--metrics-out",
        tmp_path / "metrics.json",
        "--events-out",
        tmp_path / "events.jsonl",
        "--compute-dtype",
        "fp32",
        "--no-progress",
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout == f"{out}\n"
    assert "per-layer updates" in r.stderr and "GaLore state:" in r.stderr and "captured gradient fraction" in r.stderr
    assert "14 tensors patched" in r.stderr
    # the F32 base keeps its type: the merged file holds the trained masters exactly (W_base + (W − W_base))
    tensors, meta = load_state(state_path(out), STATE_FORMAT)
    merged, base = GGUFFile(out), GGUFFile(tiny_path)
    model = load_model(tiny_path)
    changed = 0
    for ref in model.targets():
        key = f"{ref.layer}:{ref.target}"
        got = merged.dequantize(ref.tensor)[ref.rows[0] : ref.rows[1]]
        torch.testing.assert_close(got, tensors[f"param/{key}"], rtol=0, atol=0, msg=key)
        changed += not torch.equal(got, base.dequantize(ref.tensor)[ref.rows[0] : ref.rows[1]])
    assert changed == 14
    assert merged.dequantize("token_embd.weight").equal(base.dequantize("token_embd.weight"))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["tensors_patched"] == 14 and report["summary"]["retention_min"] == 1.0
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["identity"]["algorithm"] == "full-galore"
    assert summary["series"]["galore.captured.0:wq"]["count"] == 4
    assert 0 < summary["series"]["galore.captured_mean"]["mean"] <= 1
    kinds = {json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()}
    assert {"train_step", "galore", "validation", "checkpoint", "merge"} <= kinds


def test_full_command_with_adamw_and_a_forced_type(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "adamw.gguf"
    r = invoke(
        "--model-path",
        tiny_path,
        "--data",
        mixed_data,
        "--output",
        out,
        "--max-steps",
        2,
        "--optimizer",
        "adamw",
        "--targets",
        "qv",
        "--requant",
        "f16",
        "--compute-dtype",
        "fp32",
        "--no-progress",
    )
    assert r.exit_code == 0, r.stderr
    assert "AdamW; lr 0.0001; clipping global" in r.stderr and "4 tensors patched" in r.stderr
    assert "F32->F16" in r.stderr
    merged = GGUFFile(out)
    assert merged.tensors["blk.0.attn_q.weight"].type_name == "F16"
    assert merged.tensors["blk.0.attn_k.weight"].type_name == "F32"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gradient-accumulation", 2], "gradient accumulation (--gradient-accumulation 2) cannot add up"),
        (["--grad-clip", "global"], "global gradient norm is never known"),
        (["--optimizer", "adamw", "--galore-per-layer"], "--galore-per-layer applies to --optimizer galore"),
        (["--optimizer", "adamw", "--grad-clip", "per-matrix"], "--grad-clip per-matrix applies to --optimizer galore"),
    ],
)
def test_full_command_refuses_what_per_layer_mode_cannot_do(tiny_path, tmp_path, args, message):
    r = invoke("--model-path", tiny_path, "--output", tmp_path / "o.gguf", *args)
    assert r.exit_code == 1 and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("juno-py: error: ") and message in last


def test_full_resume_refuses_an_adapter_state(tiny_path, mixed_data, tmp_path):
    out = tmp_path / "o.gguf"
    save_state(state_path(out), {"x": torch.zeros(1)}, {"identity": {}})  # an adapter's (lora) state schema
    r = invoke(
        "--model-path",
        tiny_path,
        "--data",
        mixed_data,
        "--output",
        out,
        "--resume",
        "--max-steps",
        1,
        "--compute-dtype",
        "fp32",
        "--no-progress",
    )
    assert r.exit_code == 1
    assert "expected 'juno-py full state'" in r.stderr.strip().splitlines()[-1]
