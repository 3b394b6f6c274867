"""Merges and exports of the real models (slow): a briefly trained SmolLM2 adapter and a DoRA adapter on Gemma-3.

Each merge's perplexity and KL divergence against playback is measured on a small text (`EVAL_TEXT`); F16 must
stay within 0.5 % perplexity and 1e-4 mean KL, F32 within 1e-3 of playback's logits; `auto` must reach its
retention target on every tensor. PEFT on transformers' model of the same GGUF must reproduce our playback.
"""

import json

import pytest
import torch

from juno_py.exchange import export_peft, import_peft
from juno_py.gguf import GGMLType
from juno_py.lora import Mode
from juno_py.merge import merge_model
from tests.exchange.test_export import peft_logits, same_entries
from tests.merge.helpers import make_adapter, model_logits, playback_logits

pytestmark = pytest.mark.slow

EVAL_TEXT = [
    "The river flows through the old town, past the market and the stone bridge, and on toward the sea.",
    "Water boils at one hundred degrees Celsius at sea level; at higher altitudes it boils at a lower temperature.",
    "She opened the letter, read the first line twice, and then sat down by the window to read the rest.",
]


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in EVAL_TEXT))
    return path


@pytest.fixture(scope="module")
def smollm2_trained(smollm2_path, tmp_path_factory):
    """A LoRA (q, v, r 8) trained for a few steps on the built-in facts with a high learning rate."""
    from juno_py.lora import attach
    from juno_py.models import load_model
    from juno_py.train.data import BUILTIN_FACTS, load_dataset
    from juno_py.train.loop import TrainConfig, train

    torch.manual_seed(0)
    model = load_model(smollm2_path)
    train_set, _, _ = load_dataset([BUILTIN_FACTS], model.tokenizer, 128)
    adapters = attach(model, "qv", rank=8, alpha=16)
    cfg = TrainConfig(lr=1e-2, batch_size=2, max_steps=3, epochs=None, schedule="constant", max_seq_len=128)
    train(model, adapters, train_set[:6], cfg, log=lambda msg: None)
    return adapters.save(tmp_path_factory.mktemp("smollm2") / "trained.bin")


def test_smollm2_merges_source_f16_f32_and_auto(smollm2_path, smollm2_trained, eval_file, tmp_path):
    reports = {}
    for requant in ("source", "f16", "f32", "auto"):
        reports[requant] = merge_model(
            smollm2_path,
            tmp_path / f"{requant}.gguf",
            [smollm2_trained],
            requant=requant,
            min_retention=0.9,
            eval_data=[eval_file] if requant in ("source", "f16") else (),
        )
    src, f16 = reports["source"].evaluation, reports["f16"].evaluation
    assert src["tokens"] > 50 and src["ppl_merged"] > 1 and src["kl_mean"] >= 0  # reported; Q4_1 loses some delta
    assert abs(f16["ppl_merged"] / f16["ppl_playback"] - 1) <= 0.005
    assert f16["kl_mean"] <= 1e-4
    ids = list(range(100, 164))
    expected = playback_logits(smollm2_path, smollm2_trained, ids)
    assert (model_logits(tmp_path / "f32.gguf", ids) - expected).abs().max() <= 1e-3
    auto = reports["auto"]
    assert len(auto.tensors) == 60
    assert all(t.retention >= 0.9 for t in auto.tensors)
    assert auto.summary()["size_cost_vs_source_bytes"] == sum(t.bytes_output - t.bytes_source for t in auto.tensors)
    assert all(t.source_type == "Q4_1" for t in auto.tensors)


def test_gemma3_dora_merge_reports_ppl_and_kl(gemma3_path, eval_file, tmp_path):
    adapter = make_adapter(
        gemma3_path,
        tmp_path / "g.bin",
        targets="attn",
        mode=Mode.DORA,
        rank=8,
        alpha=16,
        b_std=0.01,
        m_spread=0.01,
        layers=range(0, 18, 3),
    )
    report = merge_model(gemma3_path, tmp_path / "m.gguf", [adapter], requant="source", eval_data=[eval_file])
    ev = report.evaluation
    assert ev["tokens"] > 50 and ev["kl_mean"] >= 0 and ev["ppl_merged"] > 1
    types = {t.source_type for t in report.tensors}
    assert types <= {"Q5_0", "Q8_0", "Q4_K"} and all(t.output_type == t.source_type for t in report.tensors)
    assert all(t.retention <= 1 and t.rmse > 0 for t in report.tensors)  # a small delta may be lost (< 0)


@pytest.mark.parametrize(
    "model,mode,targets,layers",
    [
        ("smollm2", Mode.DORA, "attn", [0, 7, 29]),  # llama: Q and K rows (and DoRA magnitudes) un-permuted
        ("gemma3", Mode.LORA, "all", [0, 5, 17]),
    ],
)
def test_peft_export_reproduces_playback(request, tmp_path, model, mode, targets, layers):
    base = request.getfixturevalue(f"{model}_path")
    adapter = make_adapter(
        base, tmp_path / "a.bin", targets=targets, mode=mode, rank=4, alpha=8, b_std=0.01, m_spread=0.02, layers=layers
    )
    folder = export_peft(base, adapter, tmp_path / "peft")
    ids = list(range(200, 232))
    expected = playback_logits(base, adapter, ids)
    assert (expected - model_logits(base, ids)).abs().max() > 0.05
    assert (peft_logits(base, folder, ids) - expected).abs().max() <= 1e-3
    same_entries(adapter, import_peft(base, folder, tmp_path / "back.bin"))


def test_type_mix_of_the_gemma3_file_is_kept(gemma3_path, tmp_path):
    """`source` keeps Q5_0, Q4_K and Q6_K as they are; `q4_k` on 640-wide rows falls to a type that fits."""
    adapter = make_adapter(gemma3_path, tmp_path / "a.bin", targets="wdown", rank=4, alpha=8, b_std=0.01, layers=[0, 1])
    report = merge_model(gemma3_path, tmp_path / "m.gguf", [adapter], requant="q5_k")
    assert {t.output_type for t in report.tensors} == {"Q5_K"}  # ffn_down rows are 2048 wide: k-quants fit
    adapter = make_adapter(gemma3_path, tmp_path / "b.bin", targets="wq", rank=4, alpha=8, b_std=0.01, layers=[0])
    report = merge_model(gemma3_path, tmp_path / "n.gguf", [adapter], requant="q4_k")
    assert report.tensors[0].output_type == "Q4_0" and report.tensors[0].source_type == GGMLType.Q5_0.name
