"""Atomic file output: write to a temporary file beside the target, then rename over it.

A crash or kill -9 mid-write leaves the previous file intact and at most a dot-named temporary behind. The
file gets the permissions `open()` would give it (0666 less the umask), not the 0600 of a temporary file.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (os.umask can only be read by setting)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """The mode a newly created regular file gets: 0666 & ~umask."""
    return 0o666 & ~_umask()


@contextmanager
def atomic_output(path, mode: str = "wb") -> Iterator[IO]:
    """Yield a file object; on a clean exit it is synced and renamed to `path`, on an exception deleted."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            os.fchmod(f.fileno(), default_mode())
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
