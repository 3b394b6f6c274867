"""adapter.bin: Juno's `.lora` checkpoint (big-endian), read in versions 1 and 2, written in version 2.

The layout is `docs/formats/juno-lora-v2.md`. Every declared length is checked against the bytes that
remain before it is used; every error names the file, the entry key and the field.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Optional

import numpy as np

from juno_py.atomic import atomic_write_bytes
from juno_py.errors import JunoError, show
from juno_py.models.layout import ALL_TARGETS, EXPERT_TARGETS

MAGIC = 0x4C4F5241  # "LORA"
MAX_KEY_BYTES = 1 << 20
MAX_FLOATS = 100_000_000
MAX_FP_DIMS = 8
# |value| bound of every element of A, B and the magnitude. Trained factors stay near their init scale
# (kaiming-uniform A is below 1/sqrt(in_dim), B starts at 0 and moves by lr-sized steps) and a DoRA magnitude is
# a row norm of the base weight, single digits to a few hundred in real models; 1e4 is orders of magnitude above
# all of that, so only a corrupt or hostile file (say +-3.4e38, which loads and then plays back as garbage)
# crosses it.
MAX_ABS_VALUE = 1e4
# |alpha| bound: the scale is alpha/r or alpha/sqrt(r), and alpha is a small multiple of the rank in practice
MAX_ABS_ALPHA = 1e6


class AdapterFormatError(JunoError, ValueError):
    """An adapter.bin file that is malformed, truncated or hostile."""


class Scaling(IntEnum):
    STANDARD = 0  # alpha / r
    RSLORA = 1  # alpha / sqrt(r)


class Init(IntEnum):
    KAIMING_UNIFORM = 0
    LEGACY_NORMAL = 1


class Mode(IntEnum):
    LORA = 0
    DORA = 1
    QA_LORA = 2


@dataclass(frozen=True)
class Fingerprint:
    """The base tensor an adapter was trained on: type, dims in GGUF order (ne[0] first), SHA-256 of its data."""

    ggml_type: int
    dims: tuple[int, ...]
    sha256: bytes

    @classmethod
    def of_tensor(cls, info) -> "Fingerprint":
        """From a `juno_py.gguf.TensorInfo`: hashes exactly the tensor's data bytes (no padding)."""
        return cls(int(info.ggml_type), tuple(int(d) for d in info.ne), hashlib.sha256(info.data).digest())


# the expert part of a key whose adapter applies to every expert of its 3-D tensor ("3:wup_exps.*")
EVERY_EXPERT = "*"


@dataclass
class AdapterEntry:
    key: str  # "<layer>:<target>", e.g. "0:wq"; experts: "<layer>:<target>.<expert>" or "<layer>:<target>.*"
    A: np.ndarray  # float32 [rank, in_dim]
    B: np.ndarray  # float32 [out_dim, rank]
    alpha: float
    scaling: Scaling = Scaling.STANDARD
    init: Init = Init.KAIMING_UNIFORM
    mode: Mode = Mode.LORA
    magnitude: Optional[np.ndarray] = None  # float32 [out_dim], DoRA only
    fingerprint: Optional[Fingerprint] = None
    extension: bytes = field(default=b"", repr=False)

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def in_dim(self) -> int:
        return int(self.A.shape[1])

    @property
    def out_dim(self) -> int:
        return int(self.B.shape[0])

    @property
    def layer(self) -> int:
        return int(self.key.split(":", 1)[0])

    @property
    def target(self) -> str:
        return self.key.split(":", 1)[1].split(".", 1)[0]

    @property
    def expert(self) -> Optional[int]:
        """The expert of a per-expert entry; None for a 2-D target and for one adapter on every expert."""
        return parse_entry_key(self.key)[2]

    @property
    def on_experts(self) -> bool:
        """Whether the entry adapts experts (one of them, or all of them with one adapter)."""
        return self.target in EXPERT_TARGETS

    @property
    def scale(self) -> float:
        """s = alpha / r (standard) or alpha / sqrt(r) (rsLoRA)."""
        r = self.rank
        return self.alpha / (math.sqrt(r) if self.scaling == Scaling.RSLORA else r)


def parse_entry_key(key: str) -> tuple[int, str, Optional[int]]:
    """(layer, target, expert) of an entry key: `<layer>:<target>` for a 2-D target (expert None), and for an
    expert target `<layer>:<target>.<expert>` (one expert's adapter) or `<layer>:<target>.*` (one adapter played on
    every expert of the block; expert None)."""
    layer, sep, rest = key.partition(":")
    target, dot, expert = rest.partition(".")
    ok = bool(sep) and layer.isascii() and layer.isdigit() and target in ALL_TARGETS
    if ok and target in EXPERT_TARGETS:
        ok = expert == EVERY_EXPERT or (
            expert.isascii() and expert.isdigit() and len(expert) <= 9 and expert == str(int(expert))
        )
    elif ok:
        ok = not dot
    if not ok:
        raise ValueError(
            f"key {show(key)}: expected '<layer>:<target>' with target one of {', '.join(ALL_TARGETS)}, "
            f"expert targets as '<layer>:<target>.<expert>' or '<layer>:<target>.*'"
        )
    if len(layer) > 9:
        raise ValueError(f"key {show(key)}: layer index of {len(layer)} digits, expected at most 9")
    return int(layer), target, int(expert) if expert.isdigit() else None


def parse_key(key: str) -> tuple[int, str]:
    """(layer, target) of an entry key (`parse_entry_key` without the expert)."""
    layer, target, _ = parse_entry_key(key)
    return layer, target


def sort_key(entry_key: str) -> tuple[int, int, int]:
    """Layer-major, then the target order wq wk wv wo wgate wup wdown wrouter wgate_exps wup_exps wdown_exps, then
    the expert (an every-expert entry first)."""
    layer, target, expert = parse_entry_key(entry_key)
    return layer, ALL_TARGETS.index(target), -1 if expert is None else expert


class _Reader:
    def __init__(self, data: bytes, path: str):
        self.data = data
        self.pos = 0
        self.end = len(data)
        self.path = path
        self.entry = "header"

    def fail(self, fld: str, problem: str) -> AdapterFormatError:
        where = f"entry {show(self.entry)}" if self.entry != "header" else "header"
        return AdapterFormatError(f"{self.path}: {where}: field {fld} at offset {self.pos}: {problem}")

    def take(self, n: int, fld: str) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(fld, f"needs {n} bytes but only {self.end - self.pos} remain (truncated file?)")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def i32(self, fld: str) -> int:
        return struct.unpack(">i", self.take(4, fld))[0]

    def f32(self, fld: str) -> float:
        v = struct.unpack(">f", self.take(4, fld))[0]
        if not math.isfinite(v):
            self.pos -= 4
            raise self.fail(fld, f"value {v} is not finite")
        return v

    def alpha(self) -> float:
        v = self.f32("alpha")
        if abs(v) > MAX_ABS_ALPHA:
            self.pos -= 4
            raise self.fail("alpha", f"value {v:g}, expected |alpha| <= {MAX_ABS_ALPHA:g}")
        return v

    def boolean(self, fld: str) -> bool:
        b = self.take(1, fld)[0]
        if b > 1:
            self.pos -= 1
            raise self.fail(fld, f"byte {b}, expected 0 or 1")
        return bool(b)

    def dim(self, fld: str) -> int:
        v = self.i32(fld)
        if v < 1:
            self.pos -= 4
            raise self.fail(fld, f"value {v}, expected >= 1")
        return v

    def enum(self, fld: str, cls):
        v = self.i32(fld)
        try:
            return cls(v)
        except ValueError:
            self.pos -= 4
            raise self.fail(fld, f"code {v}, expected one of {[int(c) for c in cls]}") from None

    def floats(self, n: int, fld: str) -> np.ndarray:
        if n > MAX_FLOATS:
            raise self.fail(fld, f"{n} floats exceed the limit of {MAX_FLOATS}")
        raw = self.take(4 * n, fld)
        arr = np.frombuffer(raw, dtype=">f4").astype(np.float32)
        if not np.isfinite(arr).all():
            bad = int(np.flatnonzero(~np.isfinite(arr))[0])
            self.pos -= 4 * n
            raise self.fail(fld, f"element {bad} is {arr[bad]}, expected finite floats")
        if arr.size and float(np.abs(arr).max()) > MAX_ABS_VALUE:
            bad = int(np.flatnonzero(np.abs(arr) > MAX_ABS_VALUE)[0])
            self.pos -= 4 * n
            raise self.fail(fld, f"element {bad} is {arr[bad]:g}, expected |value| <= {MAX_ABS_VALUE:g}")
        return arr

    def key(self) -> str:
        n = self.i32("key_len")
        if not 1 <= n <= MAX_KEY_BYTES:
            self.pos -= 4
            raise self.fail("key_len", f"value {n}, expected 1..{MAX_KEY_BYTES}")
        raw = self.take(n, "key")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("key", "not valid UTF-8") from None


def _read_dense(r: _Reader) -> AdapterEntry:
    key = r.key()
    r.entry = key
    rank, in_dim, out_dim = r.dim("rank"), r.dim("in_dim"), r.dim("out_dim")
    alpha = r.alpha()
    scaling = r.enum("scaling", Scaling)
    init = r.enum("initialization", Init)
    mode = r.enum("mode", Mode)
    if mode == Mode.QA_LORA:
        raise r.fail("mode", "QA-LoRA entries (mode 2) are not supported by juno-py")
    A = r.floats(rank * in_dim, "A").reshape(rank, in_dim)
    B = r.floats(out_dim * rank, "B").reshape(out_dim, rank)
    magnitude = r.floats(out_dim, "magnitude") if r.boolean("has_magnitude") else None
    if mode == Mode.DORA and magnitude is None:
        raise r.fail("has_magnitude", "a DoRA entry must carry its magnitude")
    fingerprint = None
    if r.boolean("has_fingerprint"):
        ggml_type = r.i32("fingerprint.ggml_type")
        n_dims = r.i32("fingerprint.n_dims")
        if not 1 <= n_dims <= MAX_FP_DIMS:
            r.pos -= 4
            raise r.fail("fingerprint.n_dims", f"value {n_dims}, expected 1..{MAX_FP_DIMS}")
        dims = tuple(r.dim(f"fingerprint.dims[{i}]") for i in range(n_dims))
        fingerprint = Fingerprint(ggml_type, dims, r.take(32, "fingerprint.sha256"))
    ext_len = r.i32("ext_len")
    if ext_len < 0:
        r.pos -= 4
        raise r.fail("ext_len", f"value {ext_len}, expected >= 0")
    # unknown dense extensions are not interpreted, only kept so a rewrite reproduces the file
    extension = r.take(ext_len, "extension")
    return AdapterEntry(key, A, B, alpha, scaling, init, mode, magnitude, fingerprint, extension)


def _read_v1(r: _Reader) -> AdapterEntry:
    key = r.key()
    r.entry = key
    rank, in_dim, out_dim = r.dim("rank"), r.dim("in_dim"), r.dim("out_dim")
    alpha = r.alpha()
    A = r.floats(rank * in_dim, "A").reshape(rank, in_dim)
    B = r.floats(out_dim * rank, "B").reshape(out_dim, rank)
    return AdapterEntry(key, A, B, alpha, Scaling.STANDARD, Init.LEGACY_NORMAL, Mode.LORA)


def read_adapter(path) -> tuple[int, list[AdapterEntry]]:
    """Read an adapter.bin (version 1 or 2): (version, entries in file order)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise AdapterFormatError(f"{path}: cannot read: {e.strerror}") from None
    return parse_adapter(data, str(path))


def parse_adapter(data: bytes, name: str) -> tuple[int, list[AdapterEntry]]:
    """`read_adapter` of bytes in memory; `name` is what the errors call the file."""
    r = _Reader(data, name)
    magic = r.i32("magic") & 0xFFFFFFFF
    if magic != MAGIC:
        r.pos = 0
        raise r.fail("magic", f"found 0x{magic:08X}, expected 0x{MAGIC:08X} ('LORA')")
    version = r.i32("version")
    if version not in (1, 2):
        r.pos -= 4
        raise r.fail("version", f"value {version}, expected 1 or 2")
    count = r.i32("count")
    if count < 0 or count * 4 > r.end - r.pos:
        r.pos -= 4
        raise r.fail("count", f"value {count} does not fit the {r.end - r.pos - 4} bytes that remain")
    entries: list[AdapterEntry] = []
    seen: set[str] = set()
    for i in range(count):
        r.entry = f"#{i}"
        if version == 2:
            n = r.i32("entry_len")
            if n < 0 or n > r.end - r.pos:
                r.pos -= 4
                raise r.fail("entry_len", f"value {n}, expected 0..{r.end - r.pos - 4} (the bytes that remain)")
            sub = _Reader(data[: r.pos + n], r.path)
            sub.pos, sub.entry = r.pos, r.entry
            entry = _read_dense(sub)
            if sub.pos != sub.end:
                raise sub.fail("entry_len", f"{sub.end - sub.pos} bytes of the entry were not consumed")
            r.pos = sub.pos
        else:
            entry = _read_v1(r)
        if entry.key in seen:
            raise r.fail("key", "duplicate key")
        seen.add(entry.key)
        entries.append(entry)
    if r.pos != r.end:
        r.entry = "header"
        raise r.fail("end", f"{r.end - r.pos} trailing bytes after the last entry")
    return version, entries


def _encode_entry(e: AdapterEntry) -> bytes:
    key = e.key.encode("utf-8")
    parts = [
        struct.pack(">i", len(key)),
        key,
        struct.pack(">iiifiii", e.rank, e.in_dim, e.out_dim, e.alpha, int(e.scaling), int(e.init), int(e.mode)),
        np.ascontiguousarray(e.A, dtype=">f4").tobytes(),
        np.ascontiguousarray(e.B, dtype=">f4").tobytes(),
    ]
    if e.magnitude is not None:
        parts += [b"\x01", np.ascontiguousarray(e.magnitude, dtype=">f4").tobytes()]
    else:
        parts.append(b"\x00")
    if e.fingerprint is not None:
        fp = e.fingerprint
        parts += [b"\x01", struct.pack(f">ii{len(fp.dims)}i", fp.ggml_type, len(fp.dims), *fp.dims), fp.sha256]
    else:
        parts.append(b"\x00")
    parts += [struct.pack(">i", len(e.extension)), e.extension]
    return b"".join(parts)


def encode_adapter(entries: list[AdapterEntry]) -> bytes:
    for e in entries:
        if e.A.shape != (e.rank, e.in_dim) or e.B.shape != (e.out_dim, e.rank):
            raise ValueError(f"entry {show(e.key)}: A {e.A.shape} and B {e.B.shape} do not agree")
        if e.mode == Mode.DORA and e.magnitude is None:
            raise ValueError(f"entry {show(e.key)}: a DoRA entry needs its magnitude")
    body = [struct.pack(">iii", MAGIC, 2, len(entries))]
    for e in entries:
        payload = _encode_entry(e)
        body += [struct.pack(">i", len(payload)), payload]
    return b"".join(body)


def write_adapter(path, entries: list[AdapterEntry]) -> Path:
    """Write version 2 atomically: a temporary file beside `path`, then a rename."""
    return atomic_write_bytes(path, encode_adapter(entries))
