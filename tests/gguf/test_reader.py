"""GGUFFile: exact reading, and hostile headers that must end in GGUFFormatError without over-allocating or hanging."""

import array
import signal
import struct
import tracemalloc
from contextlib import contextmanager

import gguf as gguf_ref
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from juno_py.cli.main import cli
from juno_py.errors import GGUFFormatError
from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType, quants


def write_small_gguf(path, alignment=None):
    """A small file with every value type, string and numeric arrays, and a few tensors of several types."""
    rng = np.random.default_rng(0)
    with GGUFWriter(path, alignment=alignment) as w:
        w.add_field("general.architecture", "llama")
        w.add_field("general.name", "tiny ünïcode")
        for vt, v in [
            (ValueType.UINT8, 7),
            (ValueType.INT8, -7),
            (ValueType.UINT16, 700),
            (ValueType.INT16, -700),
            (ValueType.UINT32, 70000),
            (ValueType.INT32, -70000),
            (ValueType.FLOAT32, 0.5),
            (ValueType.BOOL, True),
            (ValueType.UINT64, 1 << 40),
            (ValueType.INT64, -(1 << 40)),
            (ValueType.FLOAT64, 0.25),
        ]:
            w.add_field(f"test.{vt.name.lower()}", v, vt)
        w.add_field("tokenizer.ggml.tokens", ["a", "b", "<s>", "é"], ValueType.ARRAY, ValueType.STRING)
        w.add_field("tokenizer.ggml.scores", [0.0, -1.0, -2.0, -3.0], ValueType.ARRAY, ValueType.FLOAT32)
        w.add_field("test.empty", [], ValueType.ARRAY, ValueType.INT32)
        x = rng.standard_normal((8, 64)).astype(np.float32)
        w.add_tensor("a.weight", x, GGMLType.F32, x.shape)
        w.add_tensor("b.weight", quants.quantize(GGMLType.Q8_0, torch.from_numpy(x)), GGMLType.Q8_0, x.shape)
        w.add_tensor("c.weight", quants.quantize(GGMLType.Q4_0, torch.from_numpy(x[:3])), GGMLType.Q4_0, (3, 64))
        w.add_tensor("norm.weight", x[0], GGMLType.F32, (64,))
    return path


@contextmanager
def hang_guard(seconds=30):
    """Only catches hangs: a generous alarm, never a timing assertion."""

    def on_alarm(*_):
        raise TimeoutError(f"reader did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def field_boundaries(path):
    """Offsets where each header part starts, from the gguf package's reader (an independent parser)."""
    r = gguf_ref.GGUFReader(str(path))
    bounds = {0, 4, 8, 16, 24}
    items = list(r.fields.values()) + [t.field for t in r.tensors]
    for f in items:
        off = f.offset
        for part in f.parts:
            bounds.add(off)
            off += part.nbytes
        bounds.add(off)
    return sorted(bounds), r.data_offset


def assert_refused(path):
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with hang_guard():
            with pytest.raises(GGUFFormatError) as e:
                GGUFFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "offset" in msg
    # Bounded by the file, never by a declared count. The constant is Python's object overhead: a vocabulary
    # entry costs 8 + len bytes in the file and about 57 + len as a str in a list (measured: ~5x on SmolLM2).
    assert peak <= 8 * size + (1 << 20), f"reader allocated {peak} bytes for a {size}-byte file"
    return msg


def test_reads_every_value_type_and_tensor(tmp_path):
    p = write_small_gguf(tmp_path / "small.gguf")
    f = GGUFFile(p)
    ref = gguf_ref.GGUFReader(str(p))
    assert f.architecture == "llama"
    assert f.metadata["general.name"] == "tiny ünïcode"
    assert f.metadata["test.uint64"] == 1 << 40 and f.metadata["test.int8"] == -7
    assert f.metadata["test.bool"] is True and f.metadata["test.empty"] == array.array("i")
    assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b", "<s>", "é"]
    # numeric arrays are compact: array.array of the stored item type, Python scalars when indexed
    scores = f.metadata["tokenizer.ggml.scores"]
    assert scores == array.array("f", [0.0, -1.0, -2.0, -3.0]) and isinstance(scores[1], float)
    assert f.fields["test.uint16"].vtype == ValueType.UINT16
    for t in ref.tensors:
        mine = f.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.ne == tuple(int(d) for d in t.shape)
        assert np.array_equal(mine.data, np.asarray(t.data).view(np.uint8).reshape(-1))
    full = f.dequantize("b.weight")
    assert torch.equal(f.dequantize("b.weight", rows=slice(2, 5)), full[2:5])
    assert f.dequantize("norm.weight").shape == (64,)
    assert f.dequantize("a.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_row_range_touches_only_its_bytes(tmp_path):
    f = GGUFFile(write_small_gguf(tmp_path / "small.gguf"))
    info = f.tensors["b.weight"]
    view = f.raw_rows("b.weight", slice(3, 4))
    assert view.base is not None and view.nbytes == info.row_bytes  # a view of the map, one row long
    assert np.shares_memory(view, info.data)


@pytest.mark.parametrize("alignment", [32, 64, 1])
def test_alignment_is_respected(tmp_path, alignment):
    p = write_small_gguf(tmp_path / "a.gguf", alignment=alignment)
    f = GGUFFile(p)
    assert all((t.data_offset - f.shards[0].data_start) % alignment == 0 for t in f.tensors.values())
    assert gguf_ref.GGUFReader(str(p)).tensors[0].name == "a.weight"


def test_truncation_at_every_byte_of_a_small_file(tmp_path):
    src = write_small_gguf(tmp_path / "small.gguf")
    data = src.read_bytes()
    bounds, data_start = field_boundaries(src)
    p = tmp_path / "cut.gguf"
    # every byte inside the header, and a few cuts inside the tensor data
    for cut in list(range(0, data_start)) + [data_start + 1, len(data) - 1]:
        p.write_bytes(data[:cut])
        assert_refused(p)


def _mutate_u64(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + struct.pack("<Q", value) + data[at + 8 :]


def test_huge_counts_and_lengths(tmp_path):
    src = write_small_gguf(tmp_path / "small.gguf")
    data = src.read_bytes()
    r = gguf_ref.GGUFReader(str(src))
    p = tmp_path / "bad.gguf"
    length_fields = [8, 16]  # tensor count, kv count
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        length_fields.append(f.offset)  # key length
        if f.types and f.types[0] == gguf_ref.GGUFValueType.ARRAY:
            length_fields.append(f.offset + 8 + len(f.name.encode()) + 4 + 4)  # array length
    for t in r.tensors:
        length_fields.append(t.field.offset)  # tensor name length
    for at in length_fields:
        for value in (1 << 63, (1 << 64) - 1, 1 << 40, len(data)):
            p.write_bytes(_mutate_u64(data, at, value))
            assert_refused(p)


def test_bad_offsets_types_and_alignment(tmp_path):
    src = write_small_gguf(tmp_path / "small.gguf")
    data = src.read_bytes()
    r = gguf_ref.GGUFReader(str(src))
    p = tmp_path / "bad.gguf"
    t = r.tensors[1].field
    sizes = [part.nbytes for part in t.parts]
    type_at = t.offset + sum(sizes[:4])
    offset_at = type_at + 4
    cases = {
        "misaligned offset": _mutate_u64(data, offset_at, 33),
        "offset past the end": _mutate_u64(data, offset_at, 1 << 40),
        "unknown ggml type": data[:type_at] + struct.pack("<I", 99) + data[type_at + 4 :],
        "unknown value type": None,
        "n_dims zero": data[: t.offset + sizes[0] + sizes[1]]
        + struct.pack("<I", 0)
        + data[t.offset + sizes[0] + sizes[1] + 4 :],
        "bad magic": b"GGUX" + data[4:],
        "version 1": data[:4] + struct.pack("<I", 1) + data[8:],
        "big-endian version": data[:4] + struct.pack(">I", 3) + data[8:],
    }
    name_field = r.fields["general.name"]
    vt_at = name_field.offset + 8 + len(b"general.name")
    cases["unknown value type"] = data[:vt_at] + struct.pack("<I", 77) + data[vt_at + 4 :]
    for what, blob in cases.items():
        p.write_bytes(blob)
        msg = assert_refused(p)
        assert msg, what


@pytest.mark.parametrize("value,vtype", [(0, ValueType.UINT32), (3, ValueType.UINT32), (32, ValueType.INT32)])
def test_bad_alignment_field(tmp_path, value, vtype):
    p = tmp_path / "al.gguf"
    with GGUFWriter(p, alignment=32) as w:
        w.add_field("general.alignment", value, vtype)
        w.add_tensor("x", np.zeros((2, 32), np.float32), GGMLType.F32, (2, 32))
    msg = assert_refused(p)
    assert "general.alignment" in msg


def test_duplicate_names_refused(tmp_path):
    p = write_small_gguf(tmp_path / "s.gguf")
    data = bytearray(p.read_bytes())
    # rename tensor "c.weight" to "b.weight" in place (same length)
    i = data.index(b"c.weight")
    data[i : i + 8] = b"b.weight"
    p.write_bytes(bytes(data))
    assert "duplicate" in assert_refused(p)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_hostile_mutations_of_a_real_header(smollm2_path, tmp_path_factory, data):
    """Truncate the real SmolLM2 header at a field boundary, or overwrite a field with a hostile value."""
    cache = test_hostile_mutations_of_a_real_header.__dict__.setdefault("cache", {})
    if "bounds" not in cache:
        bounds, data_start = field_boundaries(smollm2_path)
        with open(smollm2_path, "rb") as f:
            cache["head"] = f.read(data_start + 4096)
        cache["bounds"] = bounds
    head, bounds = cache["head"], cache["bounds"]
    at = data.draw(st.sampled_from(bounds[:-1]), label="boundary")
    kind = data.draw(st.sampled_from(["truncate", "u64", "u32", "byte"]), label="kind")
    if kind == "truncate":
        blob = head[:at]
    elif kind == "u64":
        v = data.draw(st.sampled_from([0, 1 << 63, (1 << 64) - 1, 1 << 32, len(head) * 2]))
        blob = head[:at] + struct.pack("<Q", v) + head[at + 8 :]
    elif kind == "u32":
        v = data.draw(st.sampled_from([13, 99, 0xFFFFFFFF, 1 << 31]))
        blob = head[:at] + struct.pack("<I", v) + head[at + 4 :]
    else:
        blob = head[:at] + bytes([data.draw(st.integers(0, 255))]) + head[at + 1 :]
    p = tmp_path_factory.mktemp("hostile") / "m.gguf"
    p.write_bytes(blob)
    # the file holds only 4 KiB of tensor data, so even an untouched header cannot pass
    assert_refused(p)


def test_inspect_on_a_hostile_file_prints_one_line(tmp_path):
    p = write_small_gguf(tmp_path / "small.gguf")
    p.write_bytes(p.read_bytes()[:100])
    res = CliRunner().invoke(cli, ["inspect", str(p)])
    assert res.exit_code != 0
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output and str(p) in lines[0]


def test_split_files_read_as_one_model(tmp_path):
    x = np.arange(64 * 4, dtype=np.float32).reshape(4, 64)
    for i, name in [(1, "t1"), (2, "t2")]:
        with GGUFWriter(tmp_path / f"m-{i:05d}-of-00002.gguf") as w:
            w.add_field("general.architecture", "llama")
            w.add_field("split.no", i - 1, ValueType.UINT16)
            w.add_field("split.count", 2, ValueType.UINT16)
            w.add_tensor(name, x * i, GGMLType.F32, x.shape)
    f = GGUFFile(tmp_path / "m-00001-of-00002.gguf")
    assert set(f.tensors) == {"t1", "t2"}
    assert torch.equal(f.dequantize("t2"), torch.from_numpy(x * 2))
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(GGUFFormatError, match="split 2 of 2 is missing"):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")
