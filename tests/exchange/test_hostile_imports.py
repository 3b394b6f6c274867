"""Hostile adapters and imports: each class of bad PEFT folder, GGUF-LoRA file or adapter.bin is one line naming
the file and the field, with the file's values cut short, and leaves no output; what an import writes loads."""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from juno_py.errors import MAX_MESSAGE, JunoError
from juno_py.exchange import export_gguf_lora, export_peft, import_gguf_lora, import_peft
from juno_py.exchange.peft import CONFIG_FILE, WEIGHTS_FILE
from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType
from juno_py.lora import Mode, load_adapters, read_adapter, write_adapter
from juno_py.merge.merge import merge_model
from juno_py.models import load_model
from juno_py.models.generate import NonFiniteLogits, generate
from juno_py.testing.tiny_models import sample_ids
from tests.merge.helpers import make_adapter, playback_logits


def refused(call, output, *patterns):
    """`call()` raises a one-line JunoError of at most MAX_MESSAGE characters matching every pattern; `output`
    was not written."""
    with pytest.raises(JunoError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= MAX_MESSAGE, msg
    for p in patterns:
        assert p in msg, msg
    assert output is None or not output.exists()
    return msg


@pytest.fixture()
def peft_folder(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    return base, adapter, export_peft(base, adapter, tmp_path / "peft")


def edit_config(folder, **changes):
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    for k, v in changes.items():
        if v is KeyError:
            cfg.pop(k)
        else:
            cfg[k] = v
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------------------------------- PEFT
@pytest.mark.parametrize(
    "changes,expect",
    [
        ({"lora_alpha": "16"}, "field lora_alpha is '16' (str), expected a number"),
        ({"lora_alpha": None}, "field lora_alpha is None"),
        ({"lora_alpha": 1e300}, "field lora_alpha is 1e+300, expected a finite number within +-1e+06"),
        ({"lora_alpha": float("nan")}, "field lora_alpha is nan"),
        ({"lora_alpha": 10**400}, "field lora_alpha is <an integer of 1329 bits>"),
        ({"use_rslora": "yes"}, "field use_rslora is 'yes', expected true or false"),
        ({"use_dora": [1]}, "field use_dora is [1], expected true or false"),
        ({"peft_type": ["x" * 1000]}, "field peft_type is ['xxxxxxxxx"),
        ({"alpha_pattern": [1, 2]}, "field alpha_pattern is [1, 2], expected an object"),
        ({"alpha_pattern": {"q_proj": {"a": 1}}}, "field alpha_pattern['q_proj'] is <dict> (dict)"),
    ],
)
def test_peft_config_values_of_the_wrong_type_or_size(peft_folder, tmp_path, changes, expect):
    base, _, folder = peft_folder
    edit_config(folder, **changes)
    out = tmp_path / "x.bin"
    refused(lambda: import_peft(base, folder, out), out, str(folder / CONFIG_FILE), expect)


def _strip_record(folder):
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS_FILE), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "text,expect",
    [
        ("[1, 2]", "a JSON list, expected an object"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ('{"lora_alpha": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"r": 8', "not valid JSON"),
        (b"\xff\xfe\x00{".decode("latin-1"), "not valid JSON"),
    ],
)
def test_peft_config_that_is_not_a_json_object(peft_folder, tmp_path, text, expect):
    base, _, folder = peft_folder
    (folder / CONFIG_FILE).write_text(text, encoding="latin-1")
    out = tmp_path / "x.bin"
    refused(lambda: import_peft(base, folder, out), out, str(folder / CONFIG_FILE), expect)


@pytest.mark.parametrize("pattern", ["(a+)+$", "(.*)*q", "a*a*a*a*a*a*a*a*a*a*a*a*a*a*b", "["])
def test_peft_alpha_patterns_that_would_not_finish_or_compile(peft_folder, tmp_path, pattern):
    base, _, folder = peft_folder
    _strip_record(folder)
    edit_config(folder, alpha_pattern={pattern: 4})
    out = tmp_path / "x.bin"
    t0 = time.perf_counter()
    refused(lambda: import_peft(base, folder, out), out, "pattern", str(folder / CONFIG_FILE))
    assert time.perf_counter() - t0 < 30


def test_peft_plain_alpha_pattern_still_applies(peft_folder, tmp_path):
    base, adapter, folder = peft_folder
    _strip_record(folder)
    edit_config(folder, lora_alpha=8, alpha_pattern={"model.layers.1.self_attn.v_proj": 2})
    entries = read_adapter(import_peft(base, folder, tmp_path / "x.bin"))[1]
    assert {e.key: e.alpha for e in entries} == {"0:wq": 8, "0:wv": 8, "1:wq": 8, "1:wv": 2}


def _header(path):
    blob = path.read_bytes()
    n = struct.unpack_from("<Q", blob)[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _write_header(path, header, data):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_peft_safetensors_that_does_not_parse(peft_folder, tmp_path):
    base, _, folder = peft_folder
    w = folder / WEIGHTS_FILE
    good = w.read_bytes()
    out = tmp_path / "x.bin"
    for blob in (struct.pack("<Q", 1 << 62) + good[8:], good[:100], good[:8] + b"\xff" + good[9:]):
        w.write_bytes(blob)
        refused(lambda: import_peft(base, folder, out), out, str(w), "not a valid safetensors file")


def test_peft_tensor_dtypes_and_shapes(peft_folder, tmp_path):
    base, adapter, folder = peft_folder
    w = folder / WEIGHTS_FILE
    header, data = _header(w)
    name = next(k for k in header if k.endswith("q_proj.lora_A.weight"))
    out = tmp_path / "x.bin"

    h = json.loads(json.dumps(header))
    h[name]["dtype"] = "I32"
    _write_header(w, h, data)
    refused(lambda: import_peft(base, folder, out), out, str(w), "has dtype 'I32', expected one of")

    h = json.loads(json.dumps(header))
    h[name]["shape"] = h[name]["shape"][::-1]  # same bytes, transposed shape
    _write_header(w, h, data)
    refused(lambda: import_peft(base, folder, out), out, str(w), "do not fit the module's")

    b_name = name.replace("lora_A", "lora_B")
    h = json.loads(json.dumps(header))
    h[name], h[b_name] = h[b_name], h[name]  # A and B swapped
    _write_header(w, h, data)
    refused(lambda: import_peft(base, folder, out), out, str(w))

    # BF16 and F16 are float types PEFT writes: they load, equal to the rounded float32 values
    _write_header(w, header, data)
    import safetensors.torch

    ts = safetensors.torch.load_file(str(w))
    meta = {"format": "pt"}
    safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in ts.items()}, str(w), metadata=meta)
    back = read_adapter(import_peft(base, folder, out))[1]
    for e in back:
        ref = next(x for x in read_adapter(adapter)[1] if x.key == e.key)
        np.testing.assert_array_equal(e.A, torch.from_numpy(ref.A).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize(
    "edit,expect",
    [
        (lambda p: p.update(rows=["a", "b"]), "rows is ['a', 'b'], expected a list of two integers"),
        (lambda p: p.update(rows=[0, 1]), "rows 0..1, columns"),
        (lambda p: p.update(cols=[0, 10**6]), "columns within"),
        (lambda p: p.pop("alpha"), "field alpha is missing"),
        (lambda p: p.update(alpha=1e300), "alpha is 1e+300, expected a finite number"),
        (lambda p: p.update(alpha="lora"), "alpha is 'lora' (str), expected a number"),
        (lambda p: p.update(bake=0), "bake is 0"),
        (lambda p: p.update(bake=[1]), "bake is [1] (list)"),
        (lambda p: p.update(mode="dora"), "mode dora but the pair has no DoRA magnitude"),
        (lambda p: p.update(mode="qa_lora"), "mode qa_lora"),
        (lambda p: p.update(scaling=7), "scaling is 7, expected one of standard, rslora"),
        (lambda p: p.update(key=12), "key is 12, expected '<layer>:<target>'"),
        (lambda p: p.update(key="x" * 10_000), "(10000 characters)"),
        (lambda p: p.update(key="1:wk"), "does not live in this pair"),
    ],
)
def test_peft_parts_record_fields(peft_folder, tmp_path, edit, expect):
    base, _, folder = peft_folder
    w = folder / WEIGHTS_FILE
    header, data = _header(w)
    record = json.loads(header["__metadata__"]["juno_py"])
    edit(record["groups"]["model.layers.0.self_attn.q_proj"][0])
    header["__metadata__"]["juno_py"] = json.dumps(record)
    _write_header(w, header, data)
    out = tmp_path / "x.bin"
    msg = refused(lambda: import_peft(base, folder, out), out, str(w), "juno-py record part 0", expect)
    assert "q_proj" in msg


def test_peft_record_of_the_wrong_form(peft_folder, tmp_path):
    base, _, folder = peft_folder
    w = folder / WEIGHTS_FILE
    header, data = _header(w)
    out = tmp_path / "x.bin"
    for text, expect in [
        ('{"format": "juno-py adapter parts", "groups": 3.5}', "field groups is 3.5"),
        ('{"format": "juno-py adapter parts", "groups": {"a": [1]}}', "expected an object of lists"),
        ("[" * 50_000, "not valid JSON"),
    ]:
        header["__metadata__"]["juno_py"] = text
        _write_header(w, header, data)
        refused(lambda: import_peft(base, folder, out), out, str(w), "the juno-py parts record", expect)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3.4e38, 2e4])
def test_peft_values_adapter_bin_refuses_are_refused_at_import(peft_folder, tmp_path, value):
    base, _, folder = peft_folder
    tensors = load_file(folder / WEIGHTS_FILE)
    name = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[name][1, 0] = value
    save_file(tensors, folder / WEIGHTS_FILE)  # no record: a foreign file
    out = tmp_path / "x.bin"
    refused(lambda: import_peft(base, folder, out), out, "B holds values beyond +-10000 or not finite")


# ------------------------------------------------------------------------------------------------ GGUF-LoRA
@pytest.fixture()
def gguf_lora(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.Q8_0)
    adapter = make_adapter(base, tmp_path / "a.bin", targets="qv")
    return base, export_gguf_lora(base, adapter, tmp_path / "a.lora.gguf")


def rewrite(src, dst, fields=(), tensor_edit=None):
    with GGUFFile(src) as f, GGUFWriter(dst) as w:
        w.copy_fields(f)
        for key, value, vtype in fields:
            w.add_field(key, value, vtype)
        for name in f.tensors:
            x = f.dequantize(name).numpy().astype(np.float32)
            if tensor_edit is not None:
                x = tensor_edit(name, x)
            w.add_tensor(name, x, GGMLType.F32, tuple(int(d) for d in f.tensor(name).shape))
    return dst


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 3.4e38, -2e6])
def test_gguf_lora_alpha_that_is_not_finite_or_absurd(gguf_lora, tmp_path, alpha):
    base, good = gguf_lora
    bad = rewrite(good, tmp_path / "bad.gguf", [("adapter.lora.alpha", alpha, ValueType.FLOAT32)])
    out = tmp_path / "x.bin"
    refused(lambda: import_gguf_lora(base, bad, out), out, str(bad), "metadata adapter.lora.alpha is")


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), 3.4e38, 1e5])
def test_gguf_lora_tensor_values_that_are_not_finite_or_absurd(gguf_lora, tmp_path, value):
    base, good = gguf_lora

    def edit(name, x):
        if name.endswith("lora_a"):
            x = x.copy()
            x.reshape(-1)[3] = value
        return x

    bad = rewrite(good, tmp_path / "bad.gguf", tensor_edit=edit)
    out = tmp_path / "x.bin"
    refused(lambda: import_gguf_lora(base, bad, out), out, str(bad), "A holds values beyond +-10000")


def test_gguf_lora_values_from_the_file_are_cut_short(gguf_lora, tmp_path):
    base, good = gguf_lora
    out = tmp_path / "x.bin"
    for key in ("general.type", "general.architecture"):
        bad = rewrite(good, tmp_path / "bad.gguf", [(key, "x" * 200_000, ValueType.STRING)])
        refused(lambda: import_gguf_lora(base, bad, out), out, str(bad), "… (200000 characters)")
    record = '{"format": "juno-py adapter parts", "groups": {"blk.0.attn_q.weight": [{"key": "' + "k" * 50_000 + '"}]}}'
    bad = rewrite(good, tmp_path / "bad.gguf", [("juno_py.adapter_parts", record, ValueType.STRING)])
    refused(lambda: import_gguf_lora(base, bad, out), out, str(bad), "juno-py record part 0", "is missing")


def test_gguf_lora_record_rows_that_do_not_describe_the_pair(gguf_lora, tmp_path):
    base, good = gguf_lora
    with GGUFFile(good) as f:
        record = json.loads(f.metadata["juno_py.adapter_parts"])
    record["groups"]["blk.0.attn_q.weight"][0]["key"] = "1:wq"  # another layer's entry in layer 0's pair
    bad = rewrite(good, tmp_path / "bad.gguf", [("juno_py.adapter_parts", json.dumps(record), ValueType.STRING)])
    out = tmp_path / "x.bin"
    refused(lambda: import_gguf_lora(base, bad, out), out, str(bad), "does not live in this pair")


# ------------------------------------------------------------------------------------------------ adapter.bin
def test_long_adapter_keys_are_cut_short_in_playback_and_merge(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.Q8_0)
    _, entries = read_adapter(make_adapter(base, tmp_path / "a.bin", targets="qv"))
    entries[0].key = "0:" + "w" * 500_000
    bad = write_adapter(tmp_path / "bad.bin", entries)
    model = load_model(base)
    refused(lambda: load_adapters(model, [str(bad)]), None, str(bad), "characters)")
    out = tmp_path / "m.gguf"
    refused(lambda: merge_model(base, out, [bad]), out, str(bad), "characters)")


def test_playback_refuses_non_finite_logits(tiny_gguf, tmp_path):
    """A model (or model plus adapters) whose logits overflow: generation stops with one line instead of
    sampling from NaN or printing token 0 forever."""
    from juno_py.testing.tiny_models import write_tiny_gguf

    with GGUFFile(tiny_gguf("llama")) as f:
        n_embd = int(f.tensor("output_norm.weight").shape[0])
    path = write_tiny_gguf(
        tmp_path / "inf.gguf", "llama", extra={"output_norm.weight": torch.full((n_embd,), float("inf"))}
    )
    model = load_model(path)
    ids = sample_ids(4)
    assert not torch.isfinite(model.logits(ids)).all()
    for temperature in (0.0, 0.7):
        with pytest.raises(NonFiniteLogits) as e:
            generate(model, ids, 3, temperature=temperature, seed=0)
        assert "not finite" in str(e.value) and "\n" not in str(e.value)


def test_imported_adapters_play_back_like_the_original(peft_folder, tmp_path):
    """The checks refuse nothing a sound export holds: the round trip still reproduces playback."""
    base, adapter, folder = peft_folder
    ids = sample_ids(8)
    back = import_peft(base, folder, tmp_path / "back.bin")
    assert torch.allclose(playback_logits(base, back, ids), playback_logits(base, adapter, ids), atol=1e-5)


def test_import_command_prints_one_line_for_a_hostile_folder(peft_folder, tmp_path):
    from click.testing import CliRunner

    from juno_py.cli.main import cli

    base, _, folder = peft_folder
    w = folder / WEIGHTS_FILE
    header, data = _header(w)
    header["__metadata__"]["juno_py"] = json.dumps(
        {"format": "juno-py adapter parts", "version": 1, "groups": {"model.layers.0.self_attn.q_proj": [{}]}}
    )
    _write_header(w, header, data)
    out = tmp_path / "x.bin"
    res = CliRunner().invoke(cli, ["import", str(folder), "--model-path", str(base), "--output", str(out)])
    assert res.exit_code == 1 and res.stdout == "", res.output
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"juno-py: error: {w}: module ") and "field key is missing" in line and len(line) < 520
    assert not out.exists()


def test_peft_use_dora_and_the_magnitudes_must_agree(peft_folder, tmp_path, tiny_gguf):
    """A LoRA folder whose config claims DoRA, and a DoRA folder whose config denies it, are refused: imported
    as they are, they would play back as the other kind of adapter than the tool that wrote them meant."""
    base, _, lora_folder = peft_folder
    edit_config(lora_folder, use_dora=True)
    refused(
        lambda: import_peft(base, lora_folder, tmp_path / "x.bin"),
        tmp_path / "x.bin",
        "use_dora is true",
        "no lora_magnitude_vector",
    )
    dora = make_adapter(base, tmp_path / "d.bin", targets="qv", mode=Mode.DORA)
    dora_folder = export_peft(base, dora, tmp_path / "peft-dora")
    assert json.loads((dora_folder / CONFIG_FILE).read_text())["use_dora"] is True
    import_peft(base, dora_folder, tmp_path / "ok.bin")  # as written: imports
    edit_config(dora_folder, use_dora=False)
    refused(
        lambda: import_peft(base, dora_folder, tmp_path / "y.bin"),
        tmp_path / "y.bin",
        "use_dora is false",
        "has a lora_magnitude_vector",
    )
