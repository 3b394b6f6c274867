"""Reading GGUF files: a validating header parser over a memory map, and row-range tensor access.

Nothing declared in the header is trusted: every count and length is checked against the bytes that
remain before anything is allocated or looped over, so a hostile file ends in `GGUFFormatError`.
"""

from __future__ import annotations

import array
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from juno_py.errors import GGUFFormatError, one_line, show
from juno_py.gguf.constants import (
    GGML_BLOCK_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_SUPPORTED_VERSIONS,
    SCALAR_DTYPES,
    ValueType,
    type_name,
)

MAX_DIMS = 4  # GGML_MAX_DIMS in llama.cpp
MAX_KEY_BYTES = 1 << 16  # metadata keys and tensor names
MAX_STRING_BYTES = 1 << 26  # one metadata string (a chat template, an embedded tokenizer.json)
MAX_SPLITS = 99999  # the 5-digit split file names
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
INTEGER_TYPES = frozenset(
    {
        ValueType.UINT8,
        ValueType.INT8,
        ValueType.UINT16,
        ValueType.INT16,
        ValueType.UINT32,
        ValueType.INT32,
        ValueType.UINT64,
        ValueType.INT64,
    }
)
# array.array type code per numeric item type (BOOL arrays hold 0/1 as unsigned bytes)
_ARRAY_CODES: dict[int, str] = {
    ValueType.UINT8: "B",
    ValueType.INT8: "b",
    ValueType.UINT16: "H",
    ValueType.INT16: "h",
    ValueType.UINT32: "I",
    ValueType.INT32: "i",
    ValueType.FLOAT32: "f",
    ValueType.BOOL: "B",
    ValueType.UINT64: "Q",
    ValueType.INT64: "q",
    ValueType.FLOAT64: "d",
}
assert all(array.array(c).itemsize == np.dtype(SCALAR_DTYPES[t]).itemsize for t, c in _ARRAY_CODES.items())
_MISSING = object()


def _where(path) -> str:
    text = str(path)
    return text if len(text) <= 200 else "…" + text[-199:]


def format_error(path, what: str, problem: str, offset: Optional[int] = None) -> GGUFFormatError:
    """The one error shape of the reader: file, field (and offset), what was found and what was expected.
    Values from the file reach `what` and `problem` only through `show`; `one_line` is the last guard."""
    at = f" at offset {offset}" if offset is not None else ""
    return GGUFFormatError(one_line(f"{_where(path)}: {what}{at}: {problem}"))


@dataclass(frozen=True)
class Field:
    """One metadata key as stored: its value type (and item type for arrays) and its value. Numeric arrays are
    `array.array`s (compact: the file's bytes, not a Python object per item), string arrays lists of str."""

    key: str
    vtype: ValueType
    value: Any
    item_type: Optional[ValueType] = None
    offset: int = 0


def typed_value(
    fields: Mapping[str, Field],
    metadata: Mapping[str, Any],
    key: str,
    kind: type,
    path,
    default: Any = _MISSING,
    lo: Optional[int] = None,
    hi: Optional[int] = None,
):
    """metadata[key] checked to be of `kind` (int or str): by its stored value type where the key comes from a
    file, by its Python type otherwise; ints also within [lo, hi]. A wrong type or range is a GGUFFormatError."""
    if key not in metadata:
        if default is _MISSING:
            raise GGUFFormatError(one_line(f"{_where(path)}: metadata {key!r} is missing, expected {kind.__name__}"))
        return default
    value = metadata[key]
    field = fields.get(key)
    if kind is int:
        ok = (
            field.vtype in INTEGER_TYPES
            if field is not None
            else isinstance(value, int) and not isinstance(value, bool)
        )
    else:
        ok = field.vtype == ValueType.STRING if field is not None else isinstance(value, str)
    stored = field.vtype.name if field is not None else type(value).__name__
    if not ok:
        raise format_error(
            path,
            f"metadata {key!r}",
            f"{show(value)} ({stored}), expected {kind.__name__}",
            field.offset if field is not None else None,
        )
    if kind is int and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        raise format_error(
            path,
            f"metadata {key!r}",
            f"{value} is out of range, expected {lo}..{hi}",
            field.offset if field is not None else None,
        )
    return value


@dataclass
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # row-major, e.g. (n_out, n_in)
    data_offset: int  # absolute offset in its file
    nbytes: int
    _buf: Any = None  # numpy uint8 view over the whole file it lives in

    @property
    def ne(self) -> tuple[int, ...]:
        """Dimensions in GGUF order (ne[0] first): the reverse of `shape`."""
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def n_cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def n_rows(self) -> int:
        return self.n_elements // max(self.n_cols, 1)

    @property
    def row_bytes(self) -> int:
        block, size = GGML_BLOCK_SIZES[self.ggml_type]
        return self.n_cols // block * size

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, flat uint8 (a view of the memory map: no copy)."""
        return self._buf[self.data_offset : self.data_offset + self.nbytes]

    @property
    def raw(self) -> np.ndarray:
        """The tensor's bytes as uint8 `[rows, bytes_per_row]` (a view: no copy)."""
        return self.data.reshape(self.n_rows, self.row_bytes)


class _Cursor:
    """Bounds-checked little-endian reads over a byte buffer."""

    def __init__(self, buf, path: str, start: int = 0):
        self.buf = buf
        self.view = memoryview(buf)
        self.size = len(buf)
        self.pos = start
        self.path = path

    def fail(self, what: str, problem: str, offset: Optional[int] = None) -> GGUFFormatError:
        return format_error(self.path, what, problem, self.pos if offset is None else offset)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what, f"needs {n} bytes but only {self.size - self.pos} remain (truncated file?)")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from("<" + fmt, self.view, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        n = self.u64(f"{what} (length)")
        if n > limit:
            raise self.fail(f"{what} (length)", f"{n} bytes, expected at most {limit}", self.pos - 8)
        self.need(n, what)
        # surrogateescape keeps invalid UTF-8 (seen in some vocabularies) round-trippable byte for byte
        text = str(self.view[self.pos : self.pos + n], "utf-8", "surrogateescape")
        self.pos += n
        return text

    def strings(self, n: int, what: str) -> list[str]:
        """n length-prefixed strings: one Python str each and nothing more (the vocabulary's hot loop)."""
        view, size, pos, unpack = self.view, self.size, self.pos, struct.unpack_from
        out = []
        append = out.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(
                    f"{what}[{i}] (length)", f"needs 8 bytes but only {size - pos} remain (truncated file?)"
                )
            length = unpack("<Q", view, pos)[0]
            pos += 8
            if length > size - pos or length > MAX_STRING_BYTES:
                raise self.fail(
                    f"{what}[{i}] (length)",
                    f"{length} bytes, expected at most {min(size - pos, MAX_STRING_BYTES)}",
                    pos - 8,
                )
            append(str(view[pos : pos + length], "utf-8", "surrogateescape"))
            pos += length
        self.pos = pos
        return out

    def count(self, what: str, min_item_bytes: int) -> int:
        n = self.u64(what)
        remaining = self.size - self.pos
        if n * min_item_bytes > remaining:
            raise self.fail(
                what,
                f"declares {n} items but only {remaining} bytes remain (at least {min_item_bytes} bytes each expected)",
                self.pos - 8,
            )
        return n


def _value_type(cur: _Cursor, what: str) -> ValueType:
    at = cur.pos
    raw = cur.u32(what)
    try:
        return ValueType(raw)
    except ValueError:
        raise cur.fail(what, f"unknown value type {raw}, expected 0..12", at) from None


def _read_value(cur: _Cursor, vtype: ValueType, what: str) -> tuple[Any, Optional[ValueType]]:
    if vtype == ValueType.STRING:
        return cur.string(what), None
    if vtype == ValueType.ARRAY:
        item_type = _value_type(cur, f"{what} (array item type)")
        if item_type == ValueType.ARRAY:
            raise cur.fail(what, "nested arrays are not supported", cur.pos - 4)
        if item_type == ValueType.STRING:
            n = cur.count(f"{what} (array length)", 8)
            return cur.strings(n, what), item_type
        itemsize = np.dtype(SCALAR_DTYPES[item_type]).itemsize
        n = cur.count(f"{what} (array length)", itemsize)
        values = array.array(_ARRAY_CODES[item_type])
        values.frombytes(cur.view[cur.pos : cur.pos + n * itemsize])
        if sys.byteorder == "big" and itemsize > 1:
            values.byteswap()
        if item_type == ValueType.BOOL and n and np.frombuffer(values, np.uint8).max() > 1:
            bad = int(np.argmax(np.frombuffer(values, np.uint8) > 1))
            raise cur.fail(f"{what}[{bad}]", f"boolean byte {values[bad]}, expected 0 or 1", cur.pos + bad)
        cur.pos += n * itemsize
        return values, item_type
    dtype = np.dtype(SCALAR_DTYPES[vtype])
    cur.need(dtype.itemsize, what)
    v = np.frombuffer(cur.buf, dtype=dtype, count=1, offset=cur.pos)[0]
    cur.pos += dtype.itemsize
    if vtype == ValueType.BOOL:
        if v > 1:
            raise cur.fail(what, f"boolean byte {int(v)}, expected 0 or 1", cur.pos - 1)
        return bool(v), None
    return v.item(), None


class _Shard:
    """One physical .gguf file: its memory map, fields and tensor table."""

    def __init__(self, path: Path):
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise format_error(path, "file", f"cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise format_error(path, "header", "empty file, expected the GGUF magic", 0)
            self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mmap, dtype=np.uint8)
        self.size = size
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(self.buf, str(self.path))
        cur.need(4, "magic")
        magic = bytes(self.buf[:4])
        if magic != GGUF_MAGIC:
            raise cur.fail("magic", f"found {magic!r}, expected {GGUF_MAGIC!r} (not a GGUF file)")
        cur.pos = 4
        version = cur.u32("version")
        if version not in GGUF_SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version.to_bytes(4, "little")[::-1][0] == 0 and version > 0xFFFF else ""
            raise cur.fail("version", f"version {version}{hint}, expected 2 or 3", 4)
        self.version = version
        # a tensor info needs at least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset) bytes
        n_tensors = cur.count("tensor count", 32)
        # a key-value pair needs at least 8 (key length) + 4 (type) + 1 (value) bytes
        n_kv = cur.count("metadata count", 13)

        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            start = cur.pos
            key = cur.string(f"metadata key #{i}", MAX_KEY_BYTES)
            what = f"metadata {show(key)}"
            if key in self.fields:
                raise cur.fail(what, "duplicate key", start)
            vtype = _value_type(cur, f"{what} (value type)")
            value, item_type = _read_value(cur, vtype, what)
            self.fields[key] = Field(key, vtype, value, item_type, start)
        self.metadata: dict[str, Any] = {k: f.value for k, f in self.fields.items()}

        alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            f = self.fields["general.alignment"]
            alignment = f.value
            if f.vtype != ValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
                raise cur.fail(
                    "metadata 'general.alignment'",
                    f"value {show(alignment)} ({f.vtype.name}), expected a UINT32 power of two",
                    f.offset,
                )
        self.alignment = alignment

        infos = []
        names = set()
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"tensor #{i} name", MAX_KEY_BYTES)
            what = f"tensor {show(name)}"
            if name in names:
                raise cur.fail(what, "duplicate tensor name", start)
            names.add(name)
            n_dims = cur.u32(f"{what} (n_dims)")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(what, f"n_dims {n_dims}, expected 1..{MAX_DIMS}", cur.pos - 4)
            cur.need(8 * n_dims, f"{what} (dims)")
            ne = list(struct.unpack_from(f"<{n_dims}Q", cur.view, cur.pos))
            cur.pos += 8 * n_dims
            if any(d == 0 or d >= 1 << 62 for d in ne):
                raise cur.fail(what, f"dims {ne}, expected each in 1..2^62", cur.pos - 8 * n_dims)
            type_at = cur.pos
            ggml_type = cur.u32(f"{what} (type)")
            if ggml_type not in GGML_BLOCK_SIZES:
                raise cur.fail(what, f"unknown GGML type id {ggml_type}", type_at)
            offset = cur.u64(f"{what} (data offset)")
            block, bsize = GGML_BLOCK_SIZES[ggml_type]
            if ne[0] % block:
                raise cur.fail(
                    what,
                    f"row length {ne[0]} is not a multiple of the {type_name(ggml_type)} block size {block}",
                    start,
                )
            n_el = 1
            for d in ne:
                n_el *= d
            if n_el > self.size * 1024:  # even 1-bit types cannot pack more than 8 values a byte
                raise cur.fail(what, f"dims {ne} declare {n_el} elements, far more than the file holds", start)
            nbytes = n_el // block * bsize
            if offset % alignment:
                raise cur.fail(
                    what, f"data offset {offset} is not a multiple of the alignment {alignment}", type_at + 4
                )
            infos.append((name, ggml_type, tuple(reversed(ne)), offset, nbytes, type_at + 4))

        data_start = -(-cur.pos // alignment) * alignment
        self.data_start = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset, nbytes, at in infos:
            self.tensors[name] = TensorInfo(name, ggml_type, shape, data_start + offset, nbytes, self.buf)
        # every tensor's bytes inside the file and apart from every other's: sorted by offset, each must end
        # before the next begins (a table whose offsets and sizes disagree fails here, not at decode time)
        previous = None
        for name, ggml_type, shape, offset, nbytes, at in sorted(infos, key=lambda t: t[3]):
            begin = data_start + offset
            what = f"tensor {show(name)}"
            if begin + nbytes > self.size:
                raise cur.fail(
                    what,
                    f"data [{begin}, {begin + nbytes}) lies past the end of the file (size "
                    f"{self.size}), expected {nbytes} bytes of {type_name(ggml_type)} inside it",
                    at,
                )
            if previous is not None and begin < previous[1]:
                raise cur.fail(
                    what,
                    f"data [{begin}, {begin + nbytes}) overlaps tensor {show(previous[0])} at "
                    f"[{previous[2]}, {previous[1]}), expected separate ranges",
                    at,
                )
            previous = (name, begin + nbytes, begin)

    def close(self) -> None:
        self.buf = None
        for t in self.tensors.values():
            t._buf = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still alive elsewhere; the map closes when they go


class GGUFFile:
    """A GGUF model: metadata as plain Python values and a tensor table with row-range dequantization.

    Split models (`name-00001-of-00003.gguf`) are read as one: the metadata of the first shard, the tensors
    of all of them.
    """

    def __init__(self, path):
        self.path = Path(path)
        first = _Shard(self.path)
        self.shards = [first]
        self._load_splits(first)
        self.fields: dict[str, Field] = first.fields
        self.metadata: dict[str, Any] = first.metadata
        self.alignment = first.alignment
        self.version = first.version
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise format_error(shard.path, f"tensor {show(name)}", "appears in more than one split")
                self.tensors[name] = info

    def _load_splits(self, first: _Shard) -> None:
        n = typed_value(first.fields, first.metadata, "split.count", int, self.path, 0, 0, MAX_SPLITS)
        if n in (0, 1):
            return
        m = SPLIT_NAME.match(self.path.name)
        if not m or int(m.group("index")) != 1:
            raise format_error(
                self.path,
                "metadata 'split.count'",
                f"{n}: open the first split (…-00001-of-{n:05d}.gguf) to read the whole model",
            )
        for i in range(2, n + 1):
            p = self.path.with_name(f"{m.group('prefix')}-{i:05d}-of-{n:05d}.gguf")
            if not p.exists():
                raise GGUFFormatError(
                    one_line(f"{_where(self.path)}: split {i} of {n} is missing, expected {_where(p)}")
                )
            shard = _Shard(p)
            self.shards.append(shard)
            count = typed_value(shard.fields, shard.metadata, "split.count", int, p, n)
            no = typed_value(shard.fields, shard.metadata, "split.no", int, p, i - 1)
            if (count, no) != (n, i - 1):
                raise format_error(
                    p,
                    "metadata 'split.count' and 'split.no'",
                    f"{count} and {no}, expected {n} and {i - 1} (a shard of another model?)",
                )

    def get_int(self, key: str, default: Any = _MISSING, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
        """metadata[key], which must be stored as an integer (within [lo, hi] when given)."""
        return typed_value(self.fields, self.metadata, key, int, self.path, default, lo, hi)

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        """metadata[key], which must be stored as a string."""
        return typed_value(self.fields, self.metadata, key, str, self.path, default)

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFFormatError(one_line(f"{_where(self.path)}: tensor {show(name)} is missing")) from None

    def raw_rows(self, name: str, rows: Optional[slice] = None) -> np.ndarray:
        """The bytes of a range of rows (first dimension), uint8 `[n, bytes_per_row_of_that_dim]`: a view."""
        info = self.tensor(name)
        first = info.shape[0] if info.shape else 1
        if rows is None:
            rows = slice(0, first)
        start, stop, step = rows.indices(first)
        if step != 1:
            raise ValueError(f"tensor {name!r}: row slices must be contiguous (step 1), got step {step}")
        per_first = info.nbytes // max(first, 1)
        if len(info.shape) == 1:
            block, bsize = GGML_BLOCK_SIZES[info.ggml_type]
            if start % block or (stop % block and stop != first):
                raise ValueError(f"tensor {name!r}: a 1-D slice must start and end on {block}-element blocks")
            lo, hi = start // block * bsize, -(-stop // block) * bsize
            return info.data[lo:hi].reshape(1, -1)
        return info.data[start * per_first : stop * per_first].reshape(stop - start, per_first)

    def dequantize(self, name: str, rows: Optional[slice] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode a tensor, or a contiguous range of its first dimension, touching only those bytes."""
        from juno_py.gguf import quants

        info = self.tensor(name)
        raw = self.raw_rows(name, rows)
        if len(info.shape) == 1:
            block, bsize = GGML_BLOCK_SIZES[info.ggml_type]
            out = quants.dequantize(info.ggml_type, raw, raw.shape[-1] // bsize * block, what=name).reshape(-1)
            if rows is not None:
                start, stop, _ = rows.indices(info.shape[0])
                out = out[: stop - start]
        else:
            out = quants.dequantize(info.ggml_type, raw.reshape(-1, info.row_bytes), info.n_cols, what=name)
            out = out.reshape((raw.shape[0],) + tuple(info.shape[1:]))
        return out if dtype == torch.float32 else out.to(dtype)

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensors)} tensors, {len(self.fields)} keys)"
