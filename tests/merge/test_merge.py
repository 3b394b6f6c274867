"""Merging into a GGUF: row-exact patching with untouched bytes kept, parity with playback, the report checked
against an independent computation, the requant policies and their ladder."""

import collections
import json

import numpy as np
import pytest
import torch

from juno_py.gguf import GGMLType, GGUFFile
from juno_py.gguf.quants import dequantize, quantize
from juno_py.lora import Mode, Scaling, read_adapter
from juno_py.merge import PROVENANCE_KEY, ladder, merge_model
from juno_py.merge.requant import encode
from juno_py.testing.tiny_models import sample_ids
from tests.merge.helpers import expected_target, gguf_reference_dequantize, make_adapter, model_logits, playback_logits

# a llama whose rows are 256 wide, so k-quant types fit
WIDE = dict(
    config=dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
)


def block_bytes(raw: np.ndarray, ggml_type) -> np.ndarray:
    from juno_py.gguf.constants import GGML_BLOCK_SIZES

    return np.asarray(raw).reshape(-1, GGML_BLOCK_SIZES[ggml_type][1])


def differing_blocks(base, out, name) -> np.ndarray:
    a, b = base.tensors[name], out.tensors[name]
    assert a.ggml_type == b.ggml_type
    return (block_bytes(a.data, a.ggml_type) != block_bytes(b.data, b.ggml_type)).any(axis=1)


def test_fused_qkv_row_subset_keeps_k_and_v_bytes(tiny_gguf, tmp_path):
    base_path = tiny_gguf("phi3", GGMLType.Q4_0, fuse_qkv=True)
    adapter = make_adapter(base_path, tmp_path / "q.bin", targets="wq")
    out_path = tmp_path / "merged.gguf"
    report = merge_model(base_path, out_path, [adapter])
    with GGUFFile(base_path) as base, GGUFFile(out_path) as out:
        q_rows = base.tensors["blk.0.attn_qkv.weight"].n_cols  # phi3 tiny: q_dim == n_embd
        for t in report.tensors:
            info = base.tensors[t.name]
            assert t.name.endswith("attn_qkv.weight") and t.output_type == "Q4_0"
            diff = differing_blocks(base, out, t.name).reshape(info.n_rows, -1)
            assert not diff[q_rows:].any(), "k and v rows must keep their bytes"
            assert diff[:q_rows].any()
            assert t.blocks_rewritten == int(diff.sum())
            assert t.blocks_reencoded >= t.blocks_rewritten


def test_zero_rows_of_b_keep_their_kquant_bytes(tiny_gguf, tmp_path):
    base_path = tiny_gguf("llama", GGMLType.Q6_K, **WIDE)
    zero = list(range(0, 64))
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="qv", zero_rows=zero, layers=[1])
    out_path = tmp_path / "merged.gguf"
    report = merge_model(base_path, out_path, [adapter])
    with GGUFFile(base_path) as base, GGUFFile(out_path) as out:
        requantized_differs = 0
        for t in report.tensors:
            info = base.tensors[t.name]
            diff = differing_blocks(base, out, t.name).reshape(info.n_rows, -1)
            assert not diff[zero].any()
            assert t.blocks_rewritten == int(diff.sum())
            assert t.blocks_reencoded == (info.n_rows - len(zero)) * diff.shape[1]
            # why bytes are kept: encoding the decoded values again changes some Q6_K blocks
            again = quantize(GGMLType.Q6_K, dequantize(GGMLType.Q6_K, info.raw[zero], info.n_cols))
            requantized_differs += int((again != np.asarray(info.raw[zero])).any(axis=1).sum())
        assert requantized_differs > 0


def test_untouched_tensors_and_metadata_are_copied(tiny_gguf, tmp_path):
    base_path = tiny_gguf("qwen2", GGMLType.Q8_0)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="qv", layers=[1])
    out_path = tmp_path / "merged.gguf"
    report = merge_model(base_path, out_path, [adapter], requant="auto")
    patched = {t.name for t in report.tensors}
    assert patched == {"blk.1.attn_q.weight", "blk.1.attn_v.weight"}
    with GGUFFile(base_path) as base, GGUFFile(out_path) as out:
        assert list(out.tensors) == list(base.tensors)
        for name, info in base.tensors.items():
            if name not in patched:
                assert out.tensors[name].ggml_type == info.ggml_type
                assert bytes(out.tensors[name].data) == bytes(info.data)
        assert {k: f for k, f in out.fields.items() if k != PROVENANCE_KEY} == {
            k: f.__class__(k, f.vtype, f.value, f.item_type, out.fields[k].offset) for k, f in base.fields.items()
        }
        prov = json.loads(out.metadata[PROVENANCE_KEY])
        assert prov["requant"] == "auto" and prov["adapters"][0]["file"] == "a.bin"
        assert out.alignment == base.alignment
    assert report.tensors_copied == len(base.tensors) - 2


@pytest.mark.parametrize(
    "arch,ggml_type,mode,targets,knobs",
    [
        ("llama", GGMLType.Q8_0, Mode.LORA, "all", {}),
        ("qwen2", GGMLType.Q4_1, Mode.DORA, "all", {}),  # biases: DoRA leaves them unscaled
        ("phi3", GGMLType.Q5_0, Mode.LORA, "qv", {"fuse_qkv": True}),
        ("phi3", GGMLType.Q8_0, Mode.DORA, "all", {"fuse_qkv": True, "fuse_gate_up": True}),
    ],
)
def test_f32_merge_matches_playback(tiny_gguf, tmp_path, arch, ggml_type, mode, targets, knobs):
    base_path = tiny_gguf(arch, ggml_type, **knobs)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets=targets, mode=mode)
    out_path = tmp_path / "merged.gguf"
    merge_model(base_path, out_path, [adapter], requant="f32")
    ids = sample_ids(24)
    expected = playback_logits(base_path, adapter, ids)
    got = model_logits(out_path, ids)
    effect = (expected - model_logits(base_path, ids)).abs().max()
    assert effect > 0.05
    assert (got - expected).abs().max() <= 1e-3


@pytest.mark.parametrize(
    "ggml_type,mode", [(GGMLType.Q4_K, Mode.LORA), (GGMLType.Q8_0, Mode.DORA), (GGMLType.Q5_1, Mode.LORA)]
)
def test_report_matches_an_independent_computation(tiny_gguf, tmp_path, ggml_type, mode):
    base_path = tiny_gguf("llama", ggml_type, **WIDE)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="all", mode=mode, b_std=0.02)
    out_path = tmp_path / "merged.gguf"
    report = merge_model(base_path, out_path, [adapter])
    assert len(report.tensors) == 7 * 2
    for t in report.tensors:
        w0 = gguf_reference_dequantize(base_path, t.name)
        target = expected_target(base_path, adapter, t.name)
        got = gguf_reference_dequantize(out_path, t.name)
        rmse = np.sqrt(np.mean((target - got) ** 2))
        retention = 1 - np.linalg.norm((target - w0) - (got - w0)) / np.linalg.norm(target - w0)
        assert t.rmse == pytest.approx(rmse, rel=1e-4)
        assert t.retention == pytest.approx(retention, rel=1e-4, abs=1e-6)
        assert t.max_abs_error == pytest.approx(np.abs(target - got).max(), rel=1e-4)
        assert t.delta_norm == pytest.approx(np.linalg.norm(target - w0), rel=1e-5)
        if ggml_type == GGMLType.Q8_0:  # extreme codes from the raw int8 codes
            with GGUFFile(out_path) as out:
                codes = block_bytes(out.tensors[t.name].data, ggml_type)[:, 2:].view(np.int8)
            assert t.extreme_fraction == pytest.approx(np.mean(np.abs(codes.astype(int)) >= 127))
    s = report.summary()
    assert s["retention_min"] == min(t.retention for t in report.tensors)
    assert s["blocks_rewritten"] == sum(t.blocks_rewritten for t in report.tensors)


def test_auto_meets_min_retention_and_reports_size_cost(tiny_gguf, tmp_path):
    base_path = tiny_gguf("llama", GGMLType.Q4_0, **WIDE)
    # a small delta: Q4_0 keeps little of it, so auto has to climb
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="all", b_std=0.002)
    src = merge_model(base_path, tmp_path / "src.gguf", [adapter], requant="source")
    auto = merge_model(base_path, tmp_path / "auto.gguf", [adapter], requant="auto", min_retention=0.9)
    assert min(t.retention for t in src.tensors) < 0.9
    for t in auto.tensors:
        assert t.retention >= 0.9
        assert t.tried[-1][0] == t.output_type and t.tried[0][0] == t.source_type
        assert all(r < 0.9 for _, r, _ in t.tried[:-1])
        assert t.retention_source == pytest.approx(t.tried[0][1])
    s = auto.summary()
    assert s["size_cost_vs_source_bytes"] == sum(t.bytes_output - t.bytes_source for t in auto.tensors) > 0
    assert s["file_bytes_output"] > src.summary()["file_bytes_output"]
    assert "against --requant source" in auto.table()
    # one summary line says per type what auto chose and why: the counts add up, and a climbed group names the
    # type below its choice that missed the target, with the best retention reached there
    line = next(x for x in auto.table().splitlines() if x.startswith("auto: "))
    assert "\n" not in line and src.auto_line() not in src.table()
    groups = collections.Counter((t.source_type, t.output_type) for t in auto.tensors)
    for (a, b), n in groups.items():
        missed = [t.tried[-2] for t in auto.tensors if (t.source_type, t.output_type) == (a, b)]
        assert f"{n} {'tensor' if n == 1 else 'tensors'} {a} -> {b} (retention below 0.9 at " in line
        assert f"best {max(r for name, r, _ in missed if name == missed[0][0]):.3f})" in line
    assert any(a != b for a, b in groups)


def test_forced_type_reencodes_whole_tensor(tiny_gguf, tmp_path):
    base_path = tiny_gguf("qwen2", GGMLType.Q4_0)
    adapter = make_adapter(base_path, tmp_path / "a.bin", targets="wq", layers=[0])
    report = merge_model(base_path, tmp_path / "m.gguf", [adapter], requant="Q8_0")
    (t,) = report.tensors
    assert (t.source_type, t.output_type) == ("Q4_0", "Q8_0")
    assert t.blocks_rewritten == t.blocks_reencoded == t.blocks_total
    # a k-quant cannot hold 64-wide rows: the nearest type that fits, by size, is taken
    report = merge_model(base_path, tmp_path / "k.gguf", [adapter], requant="q4_k")
    (t,) = report.tensors
    assert (t.requested_type, t.output_type, t.substituted) == ("Q4_K", "Q4_0", True)
    assert "Q4_K blocks of 256 values do not divide rows of 64" in t.reason
    assert "asked Q4_K, wrote Q4_0: Q4_K blocks of 256" in report.table()


def test_ladder_respects_block_constraints():
    T = GGMLType
    assert ladder(T.Q5_0, 640) == [T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.F32]  # Gemma-3's 640-wide tensors
    assert ladder(T.Q4_K, 1024) == [T.Q4_K, T.Q4_1, T.Q5_0, T.Q5_K, T.Q5_1, T.Q6_K, T.Q8_0, T.F16, T.F32]
    assert ladder(T.Q4_1, 576) == [T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.F32]
    assert ladder(T.IQ4_NL, 640) == [T.IQ4_NL, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.F32]
    assert ladder(T.IQ4_XS, 256)[:4] == [T.IQ4_XS, T.Q4_0, T.IQ4_NL, T.Q4_K]  # legacy, IQ4, k-quant at 4.5
    assert ladder(T.Q3_K, 256)[:3] == [T.Q3_K, T.IQ4_XS, T.Q4_0]
    # types without an encoder start at the nearest type we encode that is at least as large
    assert ladder(T.IQ2_XXS, 256)[0] == T.Q2_K
    assert ladder(T.IQ1_S, 256)[0] == T.Q2_K
    assert ladder(T.IQ3_S, 256)[0] == T.Q3_K  # the same 3.4375 bits per weight
    assert ladder(T.IQ3_XXS, 64)[0] == T.Q4_0  # k-quants and IQ4_XS need rows of 256
    # ternary and MXFP4 are kept as a tensor's own type, never climbed to
    assert ladder(T.TQ1_0, 256)[:2] == [T.TQ1_0, T.Q2_K]
    assert ladder(T.MXFP4, 256)[:3] == [T.MXFP4, T.IQ4_XS, T.Q4_0]
    assert not {T.TQ1_0, T.TQ2_0, T.MXFP4, T.BF16} & set(ladder(T.Q2_K, 256) + ladder(T.IQ1_S, 256))
    assert ladder(T.BF16, 64) == [T.BF16, T.F32]
    assert ladder(T.F32, 64) == [T.F32]


def test_dense_deltas_by_tensor_and_by_target(tiny_gguf, tmp_path):
    base_path = tiny_gguf("llama", GGMLType.F32)
    g = torch.Generator().manual_seed(0)
    with GGUFFile(base_path) as base:
        d_out = torch.randn(base.tensors["blk.0.attn_output.weight"].shape, generator=g) * 0.01
        d_q = torch.randn(base.tensors["blk.1.attn_q.weight"].shape, generator=g) * 0.01
        w_out = base.dequantize("blk.0.attn_output.weight")
        w_q = base.dequantize("blk.1.attn_q.weight")
    report = merge_model(
        base_path, tmp_path / "m.gguf", deltas={"blk.0.attn_output.weight": d_out, "1:wq": lambda: d_q.numpy()}
    )
    assert sorted(t.name for t in report.tensors) == ["blk.0.attn_output.weight", "blk.1.attn_q.weight"]
    with GGUFFile(tmp_path / "m.gguf") as out:
        assert torch.equal(out.dequantize("blk.0.attn_output.weight"), (w_out.double() + d_out.double()).float())
        assert torch.equal(out.dequantize("blk.1.attn_q.weight"), (w_q.double() + d_q.double()).float())


def test_encode_counts_only_changed_blocks(tiny_gguf):
    from juno_py.merge.targets import RowPatch

    with GGUFFile(tiny_gguf("llama", GGMLType.Q8_0)) as base:
        info = base.tensors["blk.0.attn_v.weight"]
        dense = np.zeros((info.n_rows, info.n_cols), np.float32)
        dense[3, 5] = 0.5  # one value: one block
        enc = encode(info, [RowPatch("x", (0, info.n_rows), dense=dense)], info.ggml_type)
        assert enc.blocks_reencoded == enc.blocks_rewritten == 1
        assert enc.delta_norm == pytest.approx(0.5, rel=1e-6)


def test_multiple_lora_files_add_up(tiny_gguf, tmp_path):
    base_path = tiny_gguf("qwen2", GGMLType.F32)
    a = make_adapter(base_path, tmp_path / "a.bin", targets="qv", seed=1)
    b = make_adapter(base_path, tmp_path / "b.bin", targets="all", seed=2, scaling=Scaling.RSLORA, rank=2)
    merge_model(base_path, tmp_path / "m.gguf", [f"{a}:0.5", str(b)], requant="f32")
    ids = sample_ids(16)
    from juno_py.lora import load_adapters
    from juno_py.models import load_model

    pb = load_model(base_path)
    load_adapters(pb, [f"{a}:0.5", str(b)])
    with torch.no_grad():
        assert (model_logits(tmp_path / "m.gguf", ids) - pb.logits(ids)).abs().max() <= 1e-3
    assert len(read_adapter(b)[1]) == 14
