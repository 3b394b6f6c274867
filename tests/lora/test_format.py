"""adapter.bin: golden bytes built by hand from the shared format description, and hostile files."""

import hashlib
import struct

import numpy as np
import pytest

from juno_py.lora.format import (
    AdapterEntry,
    AdapterFormatError,
    Fingerprint,
    Init,
    Mode,
    Scaling,
    encode_adapter,
    read_adapter,
    write_adapter,
)


def be_floats(values):
    return b"".join(struct.pack(">f", v) for v in values)


def be_i32(*values):
    return b"".join(struct.pack(">i", v) for v in values)


def string(s):
    b = s.encode()
    return be_i32(len(b)) + b


# Entry 1: DoRA on "3:wv", rank 2, in 3, out 2, alpha 16, rsLoRA, kaiming, magnitude and fingerprint, no extension.
A1 = [0.5, -1.0, 2.0, 0.25, 0.0, -0.125]
B1 = [1.0, 2.0, 3.0, 4.0]
M1 = [1.5, 2.5]
SHA = hashlib.sha256(b"base tensor bytes").digest()
ENTRY1 = (
    string("3:wv")
    + be_i32(2, 3, 2)
    + struct.pack(">f", 16.0)
    + be_i32(1, 0, 1)
    + be_floats(A1)
    + be_floats(B1)
    + b"\x01"
    + be_floats(M1)
    + b"\x01"
    + be_i32(14, 2, 3, 2)
    + SHA
    + be_i32(0)
)
# Entry 2: LoRA on "0:wq", rank 1, in 2, out 3, alpha 8, standard, legacy-normal, no magnitude, no fingerprint,
# and a 5-byte extension block to skip.
ENTRY2 = (
    string("0:wq")
    + be_i32(1, 2, 3)
    + struct.pack(">f", 8.0)
    + be_i32(0, 1, 0)
    + be_floats([1.0, -2.0])
    + be_floats([0.5, 0.25, -0.75])
    + b"\x00"
    + b"\x00"
    + be_i32(5)
    + b"extra"
)
V2 = be_i32(0x4C4F5241, 2, 2) + be_i32(len(ENTRY1)) + ENTRY1 + be_i32(len(ENTRY2)) + ENTRY2
V1 = (
    be_i32(0x4C4F5241, 1, 1)
    + string("5:wdown")
    + be_i32(2, 2, 1)
    + struct.pack(">f", 4.0)
    + be_floats([1, 2, 3, 4])
    + be_floats([0.5, -0.5])
)


def test_v2_golden_bytes_load(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(V2)
    version, (e1, e2) = read_adapter(p)
    assert version == 2
    assert (e1.key, e1.layer, e1.target, e1.rank, e1.in_dim, e1.out_dim) == ("3:wv", 3, "wv", 2, 3, 2)
    assert e1.mode == Mode.DORA and e1.scaling == Scaling.RSLORA and e1.init == Init.KAIMING_UNIFORM
    assert np.array_equal(e1.A, np.array(A1, np.float32).reshape(2, 3))
    assert np.array_equal(e1.B, np.array(B1, np.float32).reshape(2, 2))
    assert np.array_equal(e1.magnitude, np.array(M1, np.float32))
    assert e1.fingerprint == Fingerprint(14, (3, 2), SHA)
    assert e1.scale == pytest.approx(16.0 / np.sqrt(2))
    assert e2.mode == Mode.LORA and e2.magnitude is None and e2.fingerprint is None and e2.init == Init.LEGACY_NORMAL
    assert e2.scale == 8.0 and e2.B.shape == (3, 1)


def test_writer_reproduces_v2_bytes(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(V2)
    _, entries = read_adapter(p)
    out = write_adapter(tmp_path / "b.bin", entries)
    assert out.read_bytes() == V2


def test_writer_from_scratch_matches_hand_bytes():
    e = AdapterEntry(
        "3:wv",
        np.array(A1, np.float32).reshape(2, 3),
        np.array(B1, np.float32).reshape(2, 2),
        16.0,
        Scaling.RSLORA,
        Init.KAIMING_UNIFORM,
        Mode.DORA,
        np.array(M1, np.float32),
        Fingerprint(14, (3, 2), SHA),
    )
    assert encode_adapter([e]) == be_i32(0x4C4F5241, 2, 1) + be_i32(len(ENTRY1)) + ENTRY1


def test_v1_loads_as_standard_legacy_lora(tmp_path):
    p = tmp_path / "v1.bin"
    p.write_bytes(V1)
    version, (e,) = read_adapter(p)
    assert version == 1 and e.key == "5:wdown" and e.mode == Mode.LORA
    assert e.scaling == Scaling.STANDARD and e.init == Init.LEGACY_NORMAL
    assert np.array_equal(e.A, np.array([[1, 2], [3, 4]], np.float32)) and e.scale == 2.0


@pytest.mark.parametrize("blob", [V1, V2], ids=["v1", "v2"])
def test_truncation_at_every_byte_is_refused(tmp_path, blob):
    p = tmp_path / "t.bin"
    for cut in range(len(blob)):
        p.write_bytes(blob[:cut])
        with pytest.raises(AdapterFormatError) as e:
            read_adapter(p)
        assert "\n" not in str(e.value) and str(p) in str(e.value)


def _patch(blob, at, new):
    return blob[:at] + new + blob[at + len(new) :]


ENTRY1_AT = 16  # magic, version, count, entry_len
ENUMS_AT = ENTRY1_AT + 8 + 12 + 4  # after key, dims and alpha


@pytest.mark.parametrize(
    "blob,expect",
    [
        (V2 + b"\x00", "trailing"),
        (_patch(V2, ENUMS_AT, be_i32(7)), "scaling"),
        (_patch(V2, ENUMS_AT + 4, be_i32(-1)), "initialization"),
        (_patch(V2, ENUMS_AT + 8, be_i32(3)), "mode"),
        (_patch(V2, ENUMS_AT + 12, struct.pack(">f", float("nan"))), "A"),
        (_patch(V2, ENTRY1_AT + 8 + 12, struct.pack(">f", float("inf"))), "alpha"),
        (_patch(V2, ENTRY1_AT, be_i32(0x7FFFFFFF)), "key_len"),
        (_patch(V2, 12, be_i32(0x7FFFFFF0)), "entry_len"),
        (_patch(V2, 8, be_i32(0x7FFFFFFF)), "count"),
        (_patch(V2, 8, be_i32(-1)), "count"),
        (_patch(V2, ENTRY1_AT + 8, be_i32(0)), "rank"),
        (_patch(V2, 4, be_i32(3)), "version"),
        (_patch(V2, 0, b"LORB"), "magic"),
        (_patch(V2, 16 + len(ENTRY1) + 4 + 4, b"3:wv"), "duplicate"),
    ],
)
def test_corrupted_files_refused_with_one_line(tmp_path, blob, expect):
    p = tmp_path / "c.bin"
    p.write_bytes(blob)
    with pytest.raises(AdapterFormatError) as e:
        read_adapter(p)
    msg = str(e.value)
    assert "\n" not in msg and expect in msg and str(p) in msg


A1_AT = ENUMS_AT + 12
B1_AT = A1_AT + 4 * len(A1)
M1_AT = B1_AT + 4 * len(B1) + 1  # after has_magnitude


@pytest.mark.parametrize(
    "blob,expect",
    [
        (_patch(V2, A1_AT + 8, struct.pack(">f", 3.4e38)), ("A", "element 2 is 3.4e+38")),
        (_patch(V2, B1_AT, struct.pack(">f", -3.4e38)), ("B", "element 0 is -3.4e+38")),
        (_patch(V2, M1_AT + 4, struct.pack(">f", 2e4)), ("magnitude", "element 1 is 20000")),
        (_patch(V2, ENTRY1_AT + 8 + 12, struct.pack(">f", 3.4e38)), ("alpha", "3.4e+38")),
        (_patch(V1, 12 + 11 + 12 + 4, struct.pack(">f", 1e5)), ("A", "element 0 is 100000")),
    ],
)
def test_finite_but_absurd_values_refused(tmp_path, blob, expect):
    p = tmp_path / "c.bin"
    p.write_bytes(blob)
    with pytest.raises(AdapterFormatError) as e:
        read_adapter(p)
    msg, (field, value) = str(e.value), expect
    assert "\n" not in msg and f"field {field} at offset" in msg and value in msg and str(p) in msg


def test_values_at_the_bound_load(tmp_path):
    p = tmp_path / "ok.bin"
    p.write_bytes(_patch(_patch(V2, A1_AT, struct.pack(">f", -1e4)), B1_AT, struct.pack(">f", 1e4)))
    _, entries = read_adapter(p)
    assert entries[0].A[0, 0] == -1e4 and entries[0].B[0, 0] == 1e4


def test_dora_without_magnitude_refused(tmp_path):
    no_mag = ENTRY1.replace(b"\x01" + be_floats(M1), b"\x00")
    p = tmp_path / "d.bin"
    p.write_bytes(be_i32(0x4C4F5241, 2, 1) + be_i32(len(no_mag)) + no_mag)
    with pytest.raises(AdapterFormatError, match="magnitude"):
        read_adapter(p)


def test_atomic_write_keeps_previous_file(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(V2)
    bad = AdapterEntry("0:wq", np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), 1.0)
    with pytest.raises(ValueError):
        write_adapter(p, [bad])
    assert p.read_bytes() == V2 and [x.name for x in tmp_path.iterdir()] == ["a.bin"]
