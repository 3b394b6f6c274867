"""merge and export check that what they write is finite: an adapter whose delta overflows the output type is a
one-line error and leaves no output file."""

import numpy as np
import pytest

from juno_py.exchange.gguf_lora import export_gguf_lora
from juno_py.gguf import GGMLType
from juno_py.lora import read_adapter, write_adapter
from juno_py.merge.merge import merge_model
from juno_py.merge.targets import MergeError
from tests.merge.helpers import make_adapter


def huge_adapter(base, path):
    """Valid on load (every element within the reader's bound), but B @ A far beyond float16's 65504."""
    _, entries = read_adapter(make_adapter(base, path, targets="qv"))
    for e in entries:
        e.A[...] = 1e4
        e.B[...] = 1e4
    return write_adapter(path, entries)


def test_merge_refuses_non_finite_output(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.F16)
    adapter = huge_adapter(base, tmp_path / "huge.bin")
    out = tmp_path / "m.gguf"
    with pytest.raises(MergeError, match="not finite in F16") as e:
        merge_model(base, out, [adapter])
    assert "\n" not in str(e.value) and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("m.gguf")]


def test_gguf_lora_export_refuses_non_finite_output(tiny_gguf, tmp_path):
    base = tiny_gguf("llama", GGMLType.F16)
    _, entries = read_adapter(make_adapter(base, tmp_path / "a.bin", targets="qv"))
    for i, e in enumerate(entries):
        e.alpha = 1e6 if i % 2 else 1.0  # differing scales are baked into B: 1e6/r is beyond float16
        e.B[...] = np.float32(1.0)
    adapter = write_adapter(tmp_path / "a.bin", entries)
    out = tmp_path / "x.gguf"
    with pytest.raises(MergeError, match="not finite in f16"):
        export_gguf_lora(base, adapter, out, dtype="f16")
    assert not out.exists()
    assert export_gguf_lora(base, adapter, out, dtype="f32").exists()


def test_peft_import_refuses_what_adapter_bin_would_refuse(tiny_gguf, tmp_path):
    from safetensors.numpy import load_file, save_file

    from juno_py.exchange import export_peft, import_peft
    from juno_py.exchange.peft import WEIGHTS_FILE

    base = tiny_gguf("llama", GGMLType.F16)
    folder = export_peft(base, make_adapter(base, tmp_path / "a.bin", targets="qv"), tmp_path / "peft")
    tensors = load_file(folder / WEIGHTS_FILE)
    name = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[name][0, 0] = 3.4e38
    save_file(tensors, folder / WEIGHTS_FILE)
    out = tmp_path / "back.bin"
    with pytest.raises(MergeError, match=r"A holds values beyond \+-10000 or not finite \(largest 3\.4e\+38\)"):
        import_peft(base, folder, out)
    assert not out.exists()
