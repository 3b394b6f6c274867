"""GGUFWriter: round trips of the real models, atomic output, late-typed tensors."""

import numpy as np
import pytest

from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter
from juno_py.gguf.writer import copy_gguf


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_round_trip_real_models(model, request, tmp_path):
    src = request.getfixturevalue(model)
    out = copy_gguf(src, tmp_path / "copy.gguf")
    a, b = GGUFFile(src), GGUFFile(out)
    assert a.metadata == b.metadata
    assert {k: (f.vtype, f.item_type) for k, f in a.fields.items()} == {
        k: (f.vtype, f.item_type) for k, f in b.fields.items()
    }
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.ggml_type, t.shape) == (u.ggml_type, u.shape)
        assert np.array_equal(t.data, u.data), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.gguf"]  # no temporary left behind


def test_failure_writes_nothing_and_keeps_old_file(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous")
    with pytest.raises(RuntimeError):
        with GGUFWriter(out) as w:
            w.add_field("general.architecture", "llama")
            w.add_tensor("a", np.zeros((2, 32), np.float32), GGMLType.F32, (2, 32))
            raise RuntimeError("interrupted")
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_wrong_byte_count_is_refused(tmp_path):
    with GGUFWriter(tmp_path / "m.gguf") as w:
        with pytest.raises(ValueError, match="expected 36 for shape"):
            w.add_tensor("a", np.zeros(40, np.uint8), GGMLType.Q4_0, (2, 32))
        w.abort()
    assert not (tmp_path / "m.gguf").exists()


def test_types_chosen_after_encoding_land_in_the_header(tmp_path):
    """The merge decides a tensor's type after encoding it; the header written at the end must say so."""
    rows = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    with GGUFWriter(tmp_path / "m.gguf") as w:
        w.add_field("general.architecture", "llama")
        w.add_tensor("first", rows.astype(np.float16), GGMLType.F16, rows.shape)
        w.add_tensor("second", rows, GGMLType.F32, rows.shape)
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.tensors["first"].ggml_type == GGMLType.F16 and f.tensors["second"].ggml_type == GGMLType.F32
    assert np.array_equal(f.dequantize("first").numpy(), rows.astype(np.float16).astype(np.float32))
