"""Writing GGUF files: metadata copied or given, tensors streamed one at a time, the result renamed into place.

A GGUF header lists every tensor's type and offset before the data, but the merge learns a tensor's final
type only after encoding it. So tensors are spilled, as they arrive, to a temporary data file beside the
output (each padded to the alignment); `finish()` then writes the header and appends the spilled data into
a second temporary file, which is renamed over the output. Memory holds one tensor at a time; the disk
briefly holds the data twice.
"""

from __future__ import annotations

import array
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from juno_py.atomic import atomic_output
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, SCALAR_DTYPES, ValueType
from juno_py.gguf.reader import Field, GGUFFile

_COPY_CHUNK = 16 << 20


def _infer_type(value: Any) -> ValueType:
    if isinstance(value, bool):
        return ValueType.BOOL
    if isinstance(value, int):
        return ValueType.INT32 if -(1 << 31) <= value < (1 << 31) else ValueType.INT64
    if isinstance(value, float):
        return ValueType.FLOAT32
    if isinstance(value, str):
        return ValueType.STRING
    if isinstance(value, (list, tuple, array.array, np.ndarray)):
        return ValueType.ARRAY
    raise TypeError(f"cannot store {type(value).__name__} as GGUF metadata")


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8", errors="surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _encode_value(vtype: ValueType, value: Any, item_type: Optional[ValueType]) -> bytes:
    if vtype == ValueType.STRING:
        return _encode_string(value)
    if vtype == ValueType.ARRAY:
        if item_type is None:
            item_type = _infer_type(value[0]) if len(value) else ValueType.INT32
        head = struct.pack("<IQ", int(item_type), len(value))
        if item_type == ValueType.STRING:
            return head + b"".join(_encode_string(v) for v in value)
        if item_type == ValueType.ARRAY:
            raise TypeError("nested arrays are not supported")
        return head + np.asarray(value, dtype=SCALAR_DTYPES[item_type]).tobytes()
    return np.asarray(value, dtype=SCALAR_DTYPES[vtype]).tobytes()


@dataclass
class _PendingTensor:
    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class GGUFWriter:
    """Stream a GGUF file to `path`. Use as a context manager; leaving it on an exception writes nothing."""

    def __init__(self, path, alignment: Optional[int] = None, version: int = 3):
        self.path = Path(path)
        self.version = version
        self.fields: dict[str, Field] = {}
        self._alignment = alignment
        self._tensors: list[_PendingTensor] = []
        self._names: set[str] = set()
        directory = self.path.parent if str(self.path.parent) else Path(".")
        fd, spill = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".data.tmp", dir=directory)
        self._spill_path = Path(spill)
        self._spill = os.fdopen(fd, "w+b")
        self._data_size = 0
        self._done = False

    @property
    def alignment(self) -> int:
        if self._alignment is not None:
            return self._alignment
        f = self.fields.get("general.alignment")
        return int(f.value) if f is not None else GGUF_DEFAULT_ALIGNMENT

    # metadata
    def add_field(
        self, key: str, value: Any, vtype: Optional[ValueType] = None, item_type: Optional[ValueType] = None
    ) -> None:
        if not self._tensors or key != "general.alignment":
            self.fields[key] = Field(
                key, ValueType(vtype) if vtype is not None else _infer_type(value), value, item_type
            )
        else:
            raise ValueError("general.alignment must be set before the first tensor is added")

    def copy_fields(self, src: GGUFFile, skip: Iterable[str] = ()) -> None:
        skip = set(skip)
        for key, f in src.fields.items():
            if key not in skip:
                self.fields[key] = f

    # tensors
    def add_tensor(self, name: str, data, ggml_type: int, shape: tuple[int, ...]) -> None:
        """Append one tensor: `data` holds its encoded bytes (any array; its bytes are taken as they are)."""
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        block, bsize = GGML_BLOCK_SIZES[ggml_type]
        shape = tuple(int(d) for d in shape)
        n_el = int(np.prod(shape, dtype=np.int64))
        if shape[-1] % block:
            raise ValueError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of the block size {block}")
        expected = n_el // block * bsize
        buf = memoryview(np.ascontiguousarray(data)).cast("B")
        if buf.nbytes != expected:
            raise ValueError(f"tensor {name!r}: {buf.nbytes} bytes given, expected {expected} for shape {shape}")
        pad = -self._data_size % self.alignment
        if pad:
            self._spill.write(b"\0" * pad)
            self._data_size += pad
        offset = self._data_size
        self._spill.write(buf)
        self._data_size += expected
        self._names.add(name)
        self._tensors.append(_PendingTensor(name, tuple(reversed(shape)), int(ggml_type), offset, expected))

    def copy_tensor(self, src: GGUFFile, name: str, new_name: Optional[str] = None) -> None:
        info = src.tensor(name)
        self.add_tensor(new_name or name, info.data, info.ggml_type, info.shape)

    # output
    def _header(self) -> bytes:
        fields = dict(self.fields)
        if self.alignment != GGUF_DEFAULT_ALIGNMENT and "general.alignment" not in fields:
            # readers assume 32 unless told: a custom alignment must be stated in the metadata
            fields["general.alignment"] = Field("general.alignment", ValueType.UINT32, self.alignment)
        parts = [GGUF_MAGIC, struct.pack("<IQQ", self.version, len(self._tensors), len(fields))]
        for key, f in fields.items():
            parts.append(_encode_string(key))
            parts.append(struct.pack("<I", int(f.vtype)))
            parts.append(_encode_value(f.vtype, f.value, f.item_type))
        for t in self._tensors:
            parts.append(_encode_string(t.name))
            parts.append(struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.ggml_type, t.offset))
        header = b"".join(parts)
        return header + b"\0" * (-len(header) % self.alignment)

    def finish(self) -> Path:
        """Write header and data to a temporary file and rename it over `path`."""
        if self._done:
            raise RuntimeError("GGUFWriter.finish called twice")
        try:
            with atomic_output(self.path) as out:
                out.write(self._header())
                self._spill.flush()
                self._spill.seek(0)
                shutil.copyfileobj(self._spill, out, _COPY_CHUNK)
        except BaseException:
            self.abort()
            raise
        self._close_spill()
        self._done = True
        return self.path

    def _close_spill(self) -> None:
        try:
            self._spill.close()
        finally:
            self._spill_path.unlink(missing_ok=True)

    def abort(self) -> None:
        """Drop everything written so far; the output path is left untouched."""
        if not self._done:
            self._close_spill()
            self._done = True

    def __enter__(self) -> "GGUFWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finish()


def copy_gguf(src_path, dst_path) -> Path:
    """Read a GGUF and write it back unchanged (metadata and tensors): the round trip the tests check."""
    with GGUFFile(src_path) as src, GGUFWriter(dst_path, alignment=src.alignment, version=src.version) as w:
        w.copy_fields(src)
        for name in src.tensors:
            w.copy_tensor(src, name)
    return Path(dst_path)
