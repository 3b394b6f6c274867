"""Reading GGUF files: a validating header parser over a memory map, and row-range tensor access.

Nothing declared in the header is trusted: every count and length is checked against the bytes that
remain before anything is allocated or looped over, so a hostile file ends in `GGUFFormatError`.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from juno_py.errors import GGUFFormatError
from juno_py.gguf.constants import (
    GGML_BLOCK_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_SUPPORTED_VERSIONS,
    SCALAR_DTYPES,
    GGMLType,
    ValueType,
    type_name,
)

MAX_DIMS = 4  # GGML_MAX_DIMS in llama.cpp
MAX_STRING_BYTES = 1 << 30
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class Field:
    """One metadata key as stored: its value type (and item type for arrays) and its plain Python value."""

    key: str
    vtype: ValueType
    value: Any
    item_type: Optional[ValueType] = None
    offset: int = 0


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
        return self._buf[self.data_offset:self.data_offset + self.nbytes]

    @property
    def raw(self) -> np.ndarray:
        """The tensor's bytes as uint8 `[rows, bytes_per_row]` (a view: no copy)."""
        return self.data.reshape(self.n_rows, self.row_bytes)


class _Cursor:
    """Bounds-checked little-endian reads over a byte buffer."""

    def __init__(self, buf, path: str, start: int = 0):
        self.buf = buf
        self.size = len(buf)
        self.pos = start
        self.path = path

    def fail(self, what: str, problem: str, offset: Optional[int] = None) -> GGUFFormatError:
        at = self.pos if offset is None else offset
        return GGUFFormatError(f"{self.path}: {what} at offset {at}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what, f"needs {n} bytes but only {self.size - self.pos} remain (truncated file?)")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} (length)")
        if n > MAX_STRING_BYTES:
            raise self.fail(what, f"string length {n} exceeds the limit of {MAX_STRING_BYTES} bytes", self.pos - 8)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # surrogateescape keeps invalid UTF-8 (seen in some vocabularies) round-trippable byte for byte
        return raw.decode("utf-8", errors="surrogateescape")

    def count(self, what: str, min_item_bytes: int) -> int:
        n = self.u64(what)
        remaining = self.size - self.pos
        if n * min_item_bytes > remaining:
            raise self.fail(what, f"declares {n} items but only {remaining} bytes remain "
                                  f"(at least {min_item_bytes} bytes each expected)", self.pos - 8)
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
            return [cur.string(f"{what}[{i}]") for i in range(n)], item_type
        dtype = np.dtype(SCALAR_DTYPES[item_type])
        n = cur.count(f"{what} (array length)", dtype.itemsize)
        arr = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos)
        cur.pos += n * dtype.itemsize
        values = arr.astype(bool).tolist() if item_type == ValueType.BOOL else arr.tolist()
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
            raise GGUFFormatError(f"{path}: cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise GGUFFormatError(f"{path}: header at offset 0: empty file, expected the GGUF magic")
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
        # a tensor info needs at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset) bytes
        n_tensors = cur.count("tensor count", 24)
        # a key-value pair needs at least 8 (key length) + 4 (type) + 1 (value) bytes
        n_kv = cur.count("metadata count", 13)

        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            start = cur.pos
            key = cur.string(f"metadata key #{i}")
            if key in self.fields:
                raise cur.fail(f"metadata key {key!r}", "duplicate key", start)
            vtype = _value_type(cur, f"metadata {key!r} (value type)")
            value, item_type = _read_value(cur, vtype, f"metadata {key!r}")
            self.fields[key] = Field(key, vtype, value, item_type, start)

        alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            f = self.fields["general.alignment"]
            alignment = f.value
            if f.vtype != ValueType.UINT32 or not isinstance(alignment, int) or alignment <= 0 \
                    or alignment & (alignment - 1):
                raise cur.fail("metadata 'general.alignment'",
                               f"value {alignment!r} ({f.vtype.name}), expected a UINT32 power of two", f.offset)
        self.alignment = alignment

        infos = []
        names = set()
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"tensor #{i} name")
            what = f"tensor {name!r}"
            if name in names:
                raise cur.fail(what, "duplicate tensor name", start)
            names.add(name)
            n_dims = cur.u32(f"{what} (n_dims)")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(what, f"n_dims {n_dims}, expected 1..{MAX_DIMS}", cur.pos - 4)
            cur.need(8 * n_dims, f"{what} (dims)")
            ne = [int(x) for x in np.frombuffer(self.buf, dtype="<u8", count=n_dims, offset=cur.pos)]
            cur.pos += 8 * n_dims
            if any(d >= 1 << 62 for d in ne):
                raise cur.fail(what, f"dims {ne} out of range", cur.pos - 8 * n_dims)
            type_at = cur.pos
            ggml_type = cur.u32(f"{what} (type)")
            if ggml_type not in GGML_BLOCK_SIZES:
                raise cur.fail(what, f"unknown GGML type id {ggml_type}", type_at)
            offset = cur.u64(f"{what} (data offset)")
            block, bsize = GGML_BLOCK_SIZES[ggml_type]
            if ne[0] % block:
                raise cur.fail(what, f"row length {ne[0]} is not a multiple of the {type_name(ggml_type)} "
                                     f"block size {block}", start)
            n_el = 1
            for d in ne:
                n_el *= d
            if n_el > self.size * 1024:  # even 1-bit types cannot pack more than 8 values a byte
                raise cur.fail(what, f"dims {ne} declare {n_el} elements, far more than the file holds", start)
            nbytes = n_el // block * bsize
            if offset % alignment:
                raise cur.fail(what, f"data offset {offset} is not a multiple of the alignment {alignment}",
                               type_at + 4)
            infos.append((name, ggml_type, tuple(reversed(ne)), offset, nbytes, type_at + 4))

        data_start = -(-cur.pos // alignment) * alignment
        self.data_start = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset, nbytes, at in infos:
            begin = data_start + offset
            if begin + nbytes > self.size:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name!r} at offset {at}: data [{begin}, {begin + nbytes}) lies past the "
                    f"end of the file (size {self.size}), expected {nbytes} bytes of {type_name(ggml_type)} inside it")
            self.tensors[name] = TensorInfo(name, ggml_type, shape, begin, nbytes, self.buf)

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
        self.metadata: dict[str, Any] = {k: f.value for k, f in self.fields.items()}
        self.alignment = first.alignment
        self.version = first.version
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise GGUFFormatError(f"{shard.path}: tensor {name!r}: appears in more than one split")
                self.tensors[name] = info

    def _load_splits(self, first: _Shard) -> None:
        count = first.fields.get("split.count")
        if count is None or count.value in (0, 1):
            return
        n = count.value
        m = SPLIT_NAME.match(self.path.name)
        if not m or int(m.group("index")) != 1:
            raise GGUFFormatError(f"{self.path}: metadata 'split.count' is {n}: open the first split "
                                  f"(…-00001-of-{n:05d}.gguf) to read the whole model")
        for i in range(2, n + 1):
            p = self.path.with_name(f"{m.group('prefix')}-{i:05d}-of-{n:05d}.gguf")
            if not p.exists():
                raise GGUFFormatError(f"{self.path}: split {i} of {n} is missing, expected {p}")
            self.shards.append(_Shard(p))

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFormatError(f"{self.path}: metadata 'general.architecture' is missing, expected a string")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} is missing") from None

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
        return info.data[start * per_first:stop * per_first].reshape(stop - start, per_first)

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
