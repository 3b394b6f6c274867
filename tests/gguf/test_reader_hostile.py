"""Hostile GGUF headers: short one-line errors, compact metadata, typed accessors, tensor ranges checked at read."""

import array
import struct
import time
import tracemalloc

import numpy as np
import pytest

from juno_py.errors import MAX_MESSAGE, GGUFFormatError, one_line, show
from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType
from juno_py.gguf.reader import MAX_KEY_BYTES


def _refused(path) -> str:
    with pytest.raises(GGUFFormatError) as e:
        GGUFFile(path)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= MAX_MESSAGE and str(path) in msg, msg
    return msg


def _write(path, fields=(), tensors=(), alignment=None):
    with GGUFWriter(path, alignment=alignment) as w:
        w.add_field("general.architecture", "llama")
        for key, value, vtype, *item in fields:
            w.add_field(key, value, vtype, *item)
        for name, shape in tensors:
            w.add_tensor(name, np.arange(int(np.prod(shape)), dtype=np.float32), GGMLType.F32, shape)
    return path


def test_show_and_one_line_bound_every_value():
    assert show("x" * 10_000_000).endswith("(10000000 characters)") and len(show("x" * 10_000_000)) < 100
    assert len(show(array.array("i", range(1_000_000)))) < 100 and show([1, 2]) == "[1, 2]"
    assert len(show(b"\xff" * 1000)) < 300 and show(3) == "3"
    text = one_line("a\nb" + "c" * 10_000)
    assert "\n" not in text and len(text) == MAX_MESSAGE


def test_key_length_edit_of_a_real_header_is_a_short_error(smollm2_path, tmp_path):
    """Each key length of SmolLM2's header set to a size that runs far into the file: a short error, fast."""
    data = smollm2_path.read_bytes()
    f = GGUFFile(smollm2_path)
    for key in ["general.architecture", "tokenizer.ggml.tokens", "tokenizer.chat_template"]:
        at = f.fields[key].offset
        for value in (len(data) // 3, MAX_KEY_BYTES + 1, len(data) - at - 8):
            p = tmp_path / "edit.gguf"
            p.write_bytes(data[:at] + struct.pack("<Q", value) + data[at + 8 :])
            start = time.perf_counter()
            msg = _refused(p)
            seconds = time.perf_counter() - start
            assert "length" in msg and "expected at most" in msg and seconds < 2, (msg, seconds)
            tracemalloc.start()
            _refused(p)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 32 << 20, peak


def test_long_values_appear_truncated(tmp_path):
    name = "t" * 60_000
    p = _write(tmp_path / "long.gguf", tensors=[(name + "1", (4,)), (name + "2", (4,))])
    data = bytearray(p.read_bytes())
    i = data.index(name.encode() + b"2")
    data[i + len(name)] = ord("1")  # a duplicate name of 60,001 characters
    p.write_bytes(bytes(data))
    msg = _refused(p)
    assert "duplicate tensor name" in msg and "(60001 characters)" in msg


def test_numeric_arrays_are_compact(tmp_path):
    n = 12_500_000  # 50 MB of int32
    p = _write(
        tmp_path / "big.gguf",
        fields=[
            ("test.big", np.arange(n, dtype=np.int32), ValueType.ARRAY, ValueType.INT32),
            ("test.f", np.ones(n // 4, np.float64), ValueType.ARRAY, ValueType.FLOAT64),
        ],
    )
    tracemalloc.start()
    f = GGUFFile(p)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    payload = n * 4 + n // 4 * 8
    assert peak <= 1.5 * payload, f"{peak / payload:.2f}x the array bytes"
    big = f.metadata["test.big"]
    assert isinstance(big, array.array) and len(big) == n and big[123] == 123 and isinstance(big[123], int)
    assert f.fields["test.f"].item_type == ValueType.FLOAT64 and f.metadata["test.f"][-1] == 1.0


def test_bool_arrays_hold_only_zero_and_one(tmp_path):
    p = _write(tmp_path / "b.gguf", fields=[("test.flags", [True, False, True], ValueType.ARRAY, ValueType.BOOL)])
    assert list(GGUFFile(p).metadata["test.flags"]) == [1, 0, 1]
    data = bytearray(p.read_bytes())
    i = data.index(b"test.flags") + len(b"test.flags") + 4 + 4 + 8
    data[i + 1] = 7
    p.write_bytes(bytes(data))
    assert "boolean byte 7" in _refused(p)


@pytest.mark.parametrize(
    "value,vtype,item",
    [
        ("2", ValueType.STRING, None),
        (2.0, ValueType.FLOAT32, None),
        ([2, 2], ValueType.ARRAY, ValueType.UINT16),
        (True, ValueType.BOOL, None),
        (100000, ValueType.UINT32, None),
    ],
)
def test_split_count_must_be_a_small_integer(tmp_path, value, vtype, item):
    p = _write(tmp_path / "m-00001-of-00002.gguf", fields=[("split.count", value, vtype, item)])
    msg = _refused(p)
    assert "'split.count'" in msg and ("expected int" in msg or "out of range" in msg)


def test_typed_accessors(tmp_path):
    p = _write(tmp_path / "t.gguf", fields=[("a.int", 5, ValueType.UINT16), ("a.str", "x" * 5000, ValueType.STRING)])
    f = GGUFFile(p)
    assert f.get_int("a.int") == 5 and f.get_int("a.missing", 7) == 7 and f.get_str("a.str") == "x" * 5000
    with pytest.raises(GGUFFormatError, match=r"'a.str'.*\(5000 characters\) \(STRING\), expected int"):
        f.get_int("a.str")
    with pytest.raises(GGUFFormatError, match="'a.int'.*expected str"):
        f.get_str("a.int")
    with pytest.raises(GGUFFormatError, match="out of range"):
        f.get_int("a.int", lo=0, hi=4)
    with pytest.raises(GGUFFormatError, match="'a.missing' is missing, expected int"):
        f.get_int("a.missing")


def test_split_shards_must_agree(tmp_path):
    x = np.zeros((2, 32), np.float32)
    for i, count in [(1, 2), (2, 3)]:
        with GGUFWriter(tmp_path / f"m-{i:05d}-of-00002.gguf") as w:
            w.add_field("general.architecture", "llama")
            w.add_field("split.no", i - 1, ValueType.UINT16)
            w.add_field("split.count", count, ValueType.UINT16)
            w.add_tensor(f"t{i}", x, GGMLType.F32, x.shape)
    with pytest.raises(GGUFFormatError, match=r"m-00002-of-00002.gguf: .*3 and 1, expected 2 and 1"):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")


def _tensor_table(path):
    """(name, offset of its dims, offset of its data-offset field) per tensor, from the writer's layout."""
    f = GGUFFile(path)
    data = path.read_bytes()
    out = {}
    for name, info in f.tensors.items():
        at = data.index(struct.pack("<Q", len(name)) + name.encode(), 24) + 8 + len(name)
        n_dims = struct.unpack_from("<I", data, at)[0]
        out[name] = (at + 4, at + 4 + 8 * n_dims + 4, n_dims)
    return data, out


def test_zero_size_dimension_refused_at_read(tmp_path):
    p = _write(tmp_path / "z.gguf", tensors=[("a", (2, 32)), ("b", (32,))])
    data, table = _tensor_table(p)
    dims_at = table["a"][0]
    p.write_bytes(data[: dims_at + 8] + struct.pack("<Q", 0) + data[dims_at + 16 :])  # ne[1] = 0
    assert "dims [32, 0]" in _refused(p)


def test_overlapping_tensor_data_refused(tmp_path):
    p = _write(tmp_path / "o.gguf", tensors=[("a", (4, 32)), ("b", (4, 32)), ("c", (32,))])
    data, table = _tensor_table(p)
    offsets = {n: struct.unpack_from("<Q", data, at)[0] for n, (_, at, _) in table.items()}
    blob = data[: table["b"][1]] + struct.pack("<Q", offsets["a"] + 256) + data[table["b"][1] + 8 :]
    p.write_bytes(blob)
    assert "overlaps tensor 'a'" in _refused(p)


def test_tensors_swapped_between_sizes_refused(tmp_path):
    """Two tensors of different sizes with their offsets exchanged: the larger one runs into the next one."""
    p = _write(tmp_path / "s.gguf", tensors=[("small", (1, 32)), ("large", (8, 32)), ("last", (32,))])
    data, table = _tensor_table(p)
    a, b = table["small"][1], table["large"][1]
    off_a, off_b = struct.unpack_from("<Q", data, a)[0], struct.unpack_from("<Q", data, b)[0]
    blob = bytearray(data)
    blob[a : a + 8], blob[b : b + 8] = struct.pack("<Q", off_b), struct.pack("<Q", off_a)
    p.write_bytes(bytes(blob))
    assert "overlaps" in _refused(p)


def test_untouched_files_still_read(tmp_path):
    p = _write(tmp_path / "ok.gguf", tensors=[("a", (4, 32)), ("b", (3, 32)), ("c", (32,))], alignment=64)
    f = GGUFFile(p)
    assert [t.shape for t in f.tensors.values()] == [(4, 32), (3, 32), (32,)]
    assert f.dequantize("b").flatten().tolist() == list(range(96))
