"""Merging onto bases of the IQ4, i-quant, ternary and MXFP4 types: `source` keeps IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and
MXFP4 (only the changed blocks re-encoded, by the llama.cpp-exact encoders); a type juno-py cannot encode (IQ1-IQ3)
climbs the ladder to the smallest type meeting the retention target, and the report says, per tensor, what was
asked, what was written and why."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.gguf import GGMLType, GGUFFile
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.gguf.quants import dequantize, quantize
from juno_py.merge import ladder, merge_model
from juno_py.merge.requant import bits_per_weight
from tests.gguf.newtype_blocks import tiny_llama_parts, write_model_pair
from tests.merge.helpers import expected_target, make_adapter

WIDE = dict(
    config=dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
)


def blocks_of(raw, ggml_type) -> np.ndarray:
    return np.asarray(raw).reshape(-1, GGML_BLOCK_SIZES[ggml_type][1])


@pytest.mark.parametrize(
    "ggml_type",
    [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4],
    ids=lambda t: t.name,
)
def test_source_keeps_the_type_and_reencodes_only_changed_blocks(tiny_gguf, tmp_path, ggml_type):
    base_path = tiny_gguf("llama", ggml_type, **WIDE)
    zero = list(range(0, 32))  # rows the adapter leaves alone keep their bytes
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="qv", layers=[1], zero_rows=zero)
    out_path = tmp_path / "m.gguf"
    report = merge_model(base_path, out_path, [adapter])  # requant source
    assert report.tensors
    with GGUFFile(base_path) as base, GGUFFile(out_path) as out:
        for t in report.tensors:
            info, new = base.tensors[t.name], out.tensors[t.name]
            assert (t.requested_type, t.output_type, t.reason, t.substituted) == (ggml_type.name,) * 2 + (None, False)
            assert new.ggml_type == ggml_type
            old_b, new_b = blocks_of(info.raw, ggml_type), blocks_of(new.raw, ggml_type)
            per_row = old_b.shape[0] // info.n_rows
            changed = (old_b != new_b).any(1).reshape(info.n_rows, per_row)
            assert not changed[zero].any()
            assert t.blocks_rewritten == int(changed.sum()) > 0
            # every rewritten block is the encoder's output for the target values (W* from first principles)
            target = torch.from_numpy(expected_target(base_path, adapter, t.name)).float()
            again = quantize(ggml_type, target).reshape(old_b.shape)
            rows = changed.reshape(-1)
            np.testing.assert_array_equal(new_b[rows], again[rows])
            # the report's retention, computed independently, and the output closer to the target than the base
            decoded = dequantize(ggml_type, new.raw, info.n_cols).double()
            w0 = dequantize(ggml_type, info.raw, info.n_cols).double()
            t64 = torch.from_numpy(expected_target(base_path, adapter, t.name))
            retention = 1 - float((t64 - decoded).norm() / (t64 - w0).norm())
            assert t.retention == pytest.approx(retention, abs=1e-6)
            if ggml_type not in (GGMLType.TQ1_0, GGMLType.TQ2_0):  # a ternary step is larger than a small delta
                assert retention > 0


def _no_encoder_base(folder, ggml_type):
    metadata, tensors = tiny_llama_parts()
    return write_model_pair(folder, metadata, tensors, ggml_type)[0]


@pytest.mark.parametrize(
    "ggml_type", [GGMLType.IQ1_M, GGMLType.IQ2_XXS, GGMLType.IQ2_S, GGMLType.IQ3_S], ids=lambda t: t.name
)
@pytest.mark.parametrize("policy", ["source", "auto"])
def test_type_without_encoder_climbs_the_ladder_and_says_why(tmp_path, ggml_type, policy):
    base_path = _no_encoder_base(tmp_path, ggml_type)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="qv", b_std=0.2)
    target = 0.9
    report = merge_model(base_path, tmp_path / "m.gguf", [adapter], requant=policy, min_retention=target)
    assert len(report.tensors) == 2  # one layer: q and v
    with GGUFFile(tmp_path / "m.gguf") as out:
        for t in report.tensors:
            info = out.tensors[t.name]
            rungs = ladder(ggml_type, info.n_cols)
            assert bits_per_weight(rungs[0]) >= bits_per_weight(ggml_type)
            assert t.requested_type == ggml_type.name and t.substituted
            assert t.output_type == info.type_name != ggml_type.name
            assert f"juno-py cannot encode {ggml_type.name}" in t.reason
            # the smallest rung meeting the target: every rung before it fell short
            names = [r.name for r in rungs]
            assert [row[0] for row in t.tried] == names[: len(t.tried)]
            assert t.tried[-1][0] == t.output_type
            assert all(r < target for _, r, _ in t.tried[:-1])
            assert t.retention >= target or t.output_type == "F32"
            assert t.retention == pytest.approx(t.tried[-1][1])
    table = report.table()
    for t in report.tensors:
        assert f"{t.name}: asked {ggml_type.name}, wrote {t.output_type}: juno-py cannot encode" in table
    assert report.summary()["tensors_substituted"] == 2


def test_cli_report_names_the_substitution(tmp_path):
    base_path = _no_encoder_base(tmp_path, GGMLType.IQ3_XXS)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="v")
    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    result = CliRunner().invoke(
        cli,
        ["merge", "--model-path", str(base_path), "--lora-path", str(adapter), "--output", str(out)]
        + ["--report", str(report)],
    )
    assert result.exit_code == 0, result.output
    (t,) = json.loads(report.read_text())["tensors"]
    assert t["requested_type"] == "IQ3_XXS" and t["output_type"] != "IQ3_XXS" and t["substituted"]
    assert "juno-py cannot encode IQ3_XXS" in t["reason"]
    assert json.loads(report.read_text())["summary"]["tensors_substituted"] == 1
    assert f"asked IQ3_XXS, wrote {t['output_type']}: juno-py cannot encode IQ3_XXS" in result.stderr


def test_forced_type_over_a_type_without_encoder(tmp_path):
    """A forced type is written as asked (no reason), whatever the base's type."""
    base_path = _no_encoder_base(tmp_path, GGMLType.IQ1_S)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="q")
    report = merge_model(base_path, tmp_path / "m.gguf", [adapter], requant="iq4_xs")
    (t,) = report.tensors
    assert (t.source_type, t.requested_type, t.output_type, t.reason) == ("IQ1_S", "IQ4_XS", "IQ4_XS", None)
    assert report.summary()["tensors_substituted"] == 0
