"""The merge/export/import commands: stdout carries the path only, the report goes to stderr and JSON, bad input
ends in one line and leaves no output file behind."""

import json
import os

import pytest
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.gguf import GGMLType
from juno_py.lora import Mode
from tests.merge.helpers import make_adapter


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def leftovers(folder, before):
    return sorted(set(os.listdir(folder)) - set(before))


def test_merge_command_prints_the_path_and_writes_report_and_event(tiny_gguf, tmp_path):
    base = tiny_gguf("qwen2", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    out, report, events = tmp_path / "m.gguf", tmp_path / "r.json", tmp_path / "ev.jsonl"
    code, stdout, stderr = run(
        "merge",
        "--model-path",
        base,
        "--adapter",
        adapter,
        "--output",
        out,
        "--requant",
        "auto",
        "--report",
        report,
        "--events-out",
        events,
    )
    assert code == 0, stderr
    assert stdout == f"{out}\n"
    assert "retention" in stderr and "blk.0.attn_q.weight" in stderr
    rep = json.loads(report.read_text())
    assert rep["requant"] == "auto" and len(rep["tensors"]) == 4
    assert {"rmse", "max_abs_error", "retention", "blocks_rewritten", "extreme_fraction", "delta_norm"} <= set(
        rep["tensors"][0]
    )
    (event,) = [json.loads(line) for line in events.read_text().splitlines()]
    assert event["kind"] == "merge" and event["tensors_patched"] == 4


def test_merge_eval_data_reports_perplexity_and_kl(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the weather is nice and the water is warm"}\n{"text": "on the other hand"}\n')
    code, stdout, stderr = run(
        "merge",
        "--model-path",
        base,
        "--adapter",
        adapter,
        "--output",
        tmp_path / "m.gguf",
        "--eval-data",
        data,
        "--report",
        tmp_path / "r.json",
    )
    assert code == 0, stderr
    ev = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert ev["eval_tokens"] > 10 and ev["eval_ppl_merged"] > 1 and 0 <= ev["eval_kl_mean"] < 0.1
    assert "mean KL" in stderr


@pytest.mark.parametrize(
    "case",
    [
        "other_model",
        "missing_tensor",
        "unknown_type",
        "unencodable_type",
        "output_folder_missing",
        "output_is_folder",
        "dora_fingerprint",
    ],
)
def test_bad_input_is_one_line_and_leaves_no_file(tiny_gguf, tmp_path, case):
    base = tiny_gguf("llama", GGMLType.Q8_0)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    args = ["--model-path", base, "--adapter", adapter, "--output", out]
    expect = {
        "other_model": "an adapter for another model",
        "missing_tensor": "is missing",
        "unknown_type": "--requant 'q9_9'",
        "unencodable_type": "cannot encode",
        "output_folder_missing": "does not exist",
        "output_is_folder": "is a directory",
        "dora_fingerprint": "refused",
    }[case]
    if case == "other_model":
        other = tiny_gguf("qwen3", GGMLType.Q8_0)  # other shapes
        args[3] = make_adapter(other, tmp_path / "other.bin", targets="qv")
    elif case == "missing_tensor":
        args[1] = tiny_gguf("llama", GGMLType.Q8_0, drop=["blk.1.attn_v.weight"])
    elif case == "unknown_type":
        args += ["--requant", "q9_9"]
    elif case == "unencodable_type":
        args += ["--requant", "iq2_xxs"]
    elif case == "output_folder_missing":
        args[5] = tmp_path / "nowhere" / "m.gguf"
    elif case == "output_is_folder":
        args[5] = out.parent
    elif case == "dora_fingerprint":
        args[1] = tiny_gguf("llama", GGMLType.Q4_0)  # same shapes, other quantization
        args[3] = make_adapter(base, tmp_path / "d.bin", targets="qv", mode=Mode.DORA)
    before = os.listdir(out.parent)
    code, stdout, stderr = run("merge", *args)
    assert code == 1
    assert stdout == ""
    assert stderr.startswith("juno-py: error: ") and stderr.count("\n") == 1, stderr
    assert expect in stderr
    assert leftovers(out.parent, before) == []


def test_failure_during_writing_leaves_no_partial_file(tiny_gguf, tmp_path, monkeypatch):
    import juno_py.merge.merge as merge_mod

    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise merge_mod.MergeError("simulated failure in the middle of the file")
        return real(*a, **k)

    real = merge_mod.choose_encoding
    monkeypatch.setattr(merge_mod, "choose_encoding", failing)
    before = os.listdir(tmp_path)
    code, _, stderr = run("merge", "--model-path", base, "--adapter", adapter, "--output", tmp_path / "m.gguf")
    assert code == 1 and "simulated failure" in stderr
    assert leftovers(tmp_path, before) == []


def test_export_and_import_commands(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    for fmt, out in (("peft", tmp_path / "peft"), ("gguf-lora", tmp_path / "a.lora.gguf")):
        code, stdout, stderr = run(
            "export", "--format", fmt, "--model-path", base, "--adapter", adapter, "--output", out
        )
        assert code == 0, stderr
        assert stdout == f"{out}\n"
        back = tmp_path / f"{fmt}.bin"
        code, stdout, stderr = run("import", out, "--model-path", base, "--output", back)
        assert code == 0, stderr
        assert stdout == f"{back}\n"
        assert back.read_bytes() == adapter.read_bytes()
    dora = make_adapter(base, tmp_path / "d.bin", targets="qv", mode=Mode.DORA)
    code, stdout, stderr = run(
        "export", "--format", "gguf-lora", "--model-path", base, "--adapter", dora, "--output", tmp_path / "d.gguf"
    )
    assert code == 1 and "merge it into the model instead" in stderr and stderr.count("\n") == 1
    assert not (tmp_path / "d.gguf").exists()


@pytest.mark.parametrize("requant", ["source", "f32"])
def test_merge_estimates_its_output_and_refuses_a_disk_without_room(tiny_gguf, tmp_path, monkeypatch, requant):
    """The estimate of the merged file's tensor data is what the written file holds (plus its header); with less
    than twice that free (the file and the writer's spill of tensor data) the merge refuses in one line before it
    starts, naming the output, and writes nothing."""
    import shutil
    from collections import namedtuple

    from juno_py import atomic
    from juno_py.atomic import OutputError
    from juno_py.gguf import GGMLType, GGUFFile
    from juno_py.merge import merge_model
    from juno_py.merge.merge import output_bytes
    from juno_py.merge.requant import parse_requant
    from juno_py.merge.targets import ModelTargets, plan_patches, read_sources
    from tests.merge.helpers import make_adapter

    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    out = tmp_path / "merged.gguf"
    merge_model(base, out, [adapter], requant=requant)
    with GGUFFile(base) as g:
        plan = plan_patches(ModelTargets(g), read_sources([adapter]))
        estimate = output_bytes(g, plan, parse_requant(requant))
    with GGUFFile(out) as merged:
        data = sum(t.nbytes for t in merged.tensors.values())
        assert estimate == data
    assert estimate < out.stat().st_size < estimate + 64 * 1024
    if requant == "f32":
        with GGUFFile(base) as g:
            assert estimate > sum(t.nbytes for t in g.tensors.values())  # the patched tensors widened
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: usage(*real(p)[:2], 2 * estimate - 1))
    again = tmp_path / "again.gguf"
    with pytest.raises(OutputError) as e:
        merge_model(base, again, [adapter], requant=requant)
    msg = str(e.value)
    assert "\n" not in msg and str(again) in msg and "free" in msg, msg
    assert not again.exists() and not list(tmp_path.glob(".again.gguf*"))
