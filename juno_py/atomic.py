"""Atomic file output: write to a temporary file beside the target, then rename over it.

A crash or kill -9 mid-write leaves the previous file intact and at most a dot-named temporary behind. The
file gets the permissions `open()` would give it (0666 less the umask), not the 0600 of a temporary file.

Before long work, `check_writable` says in one line whether a target could be written at all, and `reserve` holds
the disk space for it: a temporary file beside the target, allocated at the size the output will have, which
`atomic_output` then fills in place. A disk that fills up while the work runs cannot take that space away. Every
failure to write is an `OutputError` naming the target, never the temporary file.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from juno_py.errors import JunoError


class OutputError(JunoError, OSError):
    """An output that cannot be written (a missing or read-only folder, a full disk, a directory in its place)."""


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


_REASONS = {
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on its file system",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file larger than this process or file system may write",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "the folder takes no new files",
    errno.ENOTDIR: "a file stands where a folder is expected",
}


def reason(e: OSError) -> str:
    """Why writing failed, in a few words (no file names: the caller names the target)."""
    return _REASONS.get(e.errno or 0, e.strerror or type(e).__name__)


def folder_of(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def check_writable(path, what: str = "output") -> Path:
    """Fail in one line, before any work is done, when a file could not be written at `path`: a directory there,
    a missing folder, a file in place of a folder, or a folder that takes no new files (read-only file system,
    /proc, no permission). The test creates and removes a temporary file beside `path`: os.access answers for
    permissions only, and root passes it on a read-only mount."""
    path = Path(path)
    parent = folder_of(path)
    if path.is_dir():
        raise OutputError(f"{what} {path}: is a directory, expected a file path")
    if not parent.exists():
        raise OutputError(f"{what} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: {parent} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise OutputError(f"{what} {path}: cannot create a file in {parent}: {reason(e)}") from None
    os.close(fd)
    os.unlink(tmp)
    return path


# targets with space held for them (absolute path -> the reserved temporary file), filled by atomic_output
_reserved: dict[Path, Path] = {}


def _key(path: Path) -> Path:
    return Path(os.path.abspath(path))


def _allocate(fd: int, size: int) -> None:
    """Give the open file `size` allocated bytes: posix_fallocate, or zeros where the file system has no
    allocation call."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    chunk = b"\0" * (1 << 20)
    left = size
    while left:
        left -= os.write(fd, chunk[: min(left, len(chunk))])
    os.fsync(fd)


def reserve(path, size: int, what: str = "output") -> Path:
    """Hold `size` bytes of disk space for the next atomic write of `path` (OutputError, naming `path`, when the
    folder is unwritable or the space is not there). A reservation already held for `path` is replaced."""
    path = Path(path)
    check_writable(path, what)
    release(path)
    parent = folder_of(path)
    check_space(path, size, what)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        os.fchmod(fd, default_mode())
        _allocate(fd, size)
    except OSError as e:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"{what} {path}: cannot reserve {_size(size)} for it: {reason(e)}") from None
    os.close(fd)
    _reserved[_key(path)] = Path(tmp)
    return Path(tmp)


def check_space(path, size: int, what: str = "output") -> None:
    """Fail in one line, before long work, when `path`'s file system has less than `size` bytes free (an estimate:
    the work itself still fails cleanly, with `OutputError`, if the disk fills up while it runs)."""
    path = Path(path)
    free = shutil.disk_usage(folder_of(path)).free
    if size > free:
        raise OutputError(
            f"{what} {path}: needs about {_size(size)} and its file system has {_size(free)} free; free some "
            f"space or choose another path"
        )


def release(path) -> None:
    """Give back the space held for `path`, if any."""
    tmp = _reserved.pop(_key(Path(path)), None)
    if tmp is not None:
        tmp.unlink(missing_ok=True)


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _own_error(e: OSError, path: Path) -> bool:
    """Whether `e` is about the output itself: an unnamed write, or a file in its folder (its temporary) or the
    folder itself."""
    if e.filename is None:
        return True
    named = os.path.abspath(os.fsdecode(e.filename))
    folder = os.path.abspath(folder_of(path))
    return named == folder or os.path.dirname(named) == folder


@contextmanager
def atomic_output(path, mode: str = "wb") -> Iterator[IO]:
    """Yield a file object; on a clean exit it is synced and renamed to `path`, on an exception deleted. Space
    reserved for `path` (`reserve`) is written in place. A failure to write is an OutputError naming `path`."""
    path = Path(path)
    directory = folder_of(path)
    held: Optional[Path] = _reserved.pop(_key(path), None)
    tmp = ""
    try:
        if held is not None and held.is_file():
            tmp = str(held)
            f = open(tmp, mode.replace("w", "r+"), **({} if "b" in mode else {"encoding": "utf-8"}))
        else:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
            f = os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
        with f:
            os.fchmod(f.fileno(), default_mode())
            yield f
            f.truncate()  # a reservation larger than what was written
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OutputError) or not _own_error(e, path):
            raise
        why = f"folder {directory} does not exist" if not directory.is_dir() else reason(e)
        raise OutputError(f"{path}: cannot write: {why}") from e
    except BaseException:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path, data: bytes) -> Path:
    with atomic_output(path) as f:
        f.write(data)
    return Path(path)
