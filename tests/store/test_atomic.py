"""Atomic output: files get 0666 less the umask, as open() would give them."""

import os
import stat

import numpy as np
import pytest

from juno_py.atomic import atomic_output, atomic_write_bytes, default_mode
from juno_py.gguf import GGMLType, GGUFWriter


@pytest.fixture(params=[0o022, 0o027, 0o002, 0o077])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_follow_the_umask(tmp_path, umask):
    assert default_mode() == 0o666 & ~umask
    p = atomic_write_bytes(tmp_path / "a.bin", b"x")
    assert _mode(p) == 0o666 & ~umask
    with atomic_output(tmp_path / "b.txt", "w") as f:
        f.write("text")
    assert _mode(tmp_path / "b.txt") == 0o666 & ~umask


def test_replacing_a_file_and_writing_gguf(tmp_path, umask):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"old")
    os.chmod(p, 0o600)
    with GGUFWriter(p) as w:
        w.add_field("general.architecture", "llama")
        w.add_tensor("t", np.zeros(32, np.float32), GGMLType.F32, (32,))
    assert _mode(p) == 0o666 & ~umask
    assert [q.name for q in tmp_path.iterdir()] == ["m.gguf"]  # no temporaries left


def test_failed_write_leaves_the_old_file(tmp_path):
    p = atomic_write_bytes(tmp_path / "keep.bin", b"old")
    with pytest.raises(RuntimeError):
        with atomic_output(p) as f:
            f.write(b"new")
            raise RuntimeError("stop")
    assert p.read_bytes() == b"old" and [q.name for q in tmp_path.iterdir()] == ["keep.bin"]
