"""Atomic file output: write to a temporary file beside the target, then rename over it.

A crash or kill -9 mid-write leaves the previous file intact and at most a dot-named temporary behind.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_output(path, mode: str = "wb") -> Iterator[IO]:
    """Yield a file object; on a clean exit it is synced and renamed to `path`, on an exception deleted."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path, data: bytes) -> Path:
    with atomic_output(path) as f:
        f.write(data)
    return Path(path)
