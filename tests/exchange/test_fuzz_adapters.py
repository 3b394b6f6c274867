"""Mutation fuzzing of everything that reads an adapter: adapter.bin, PEFT folders (adapter_config.json and
adapter_model.safetensors) and llama.cpp GGUF-LoRA files.

Mutations are byte flips, hostile length fields and truncations, and structured ones: config values of the
wrong type, missing keys, huge numbers and deep nesting; safetensors headers with swapped shapes, dtypes and
offsets; parts records with broken fields; float elements set to NaN, Inf or 3.4e38. Every mutant either loads,
and then plays back on the tiny model with finite logits (or is refused there with a one-line error), or is
refused with a one-line `JunoError` of at most MAX_MESSAGE characters; nothing else may escape, and no case may
allocate more than a fixed bound. An import that succeeds must have written an adapter.bin that our reader
loads. JUNO_FUZZ_CASES sets the number of mutants (300 by default; 10,000 or more for a long run).
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Callable

import gguf as gguf_ref
import numpy as np
import pytest
import torch

from juno_py.errors import MAX_MESSAGE, JunoError
from juno_py.exchange import export_gguf_lora, export_peft, import_gguf_lora, import_peft
from juno_py.exchange.peft import CONFIG_FILE, WEIGHTS_FILE
from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter, ValueType
from juno_py.lora import Mode, load_adapters, read_adapter
from juno_py.models import load_model
from juno_py.testing.tiny_models import sample_ids
from tests.merge.helpers import make_adapter

CASES = int(os.environ.get("JUNO_FUZZ_CASES", "300"))
PEAK_BOUND = 64 << 20  # bytes any single case may allocate (the seed files are a few hundred KiB)
HOSTILE_FLOATS = [float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e5, 1e30, 65504.0, 1e-45, 0.0]
HOSTILE_I32 = [0, 1, -1, 2, 3, 7, 8, 0x7FFFFFFF, -(1 << 31), 1 << 20, (1 << 20) + 1, 65, 4096, 100_000_001]
U64_VALUES = [0, 1, (1 << 63), (1 << 64) - 1, 1 << 40, 1 << 32, 0x7FFFFFFF, 65537, 7, 8]
U32_VALUES = [0, 1, 7, 8, 9, 12, 13, 31, 99, 0xFFFFFFFF, 1 << 31]
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT_TEXT = "1" + "0" * 5000  # past Python's 4,300-digit int conversion limit


def _json_values(rng: random.Random):
    """A hostile JSON value (as Python) or, for what json.dumps cannot express, a marker replaced in the text."""
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            1 << 70,
            1e308,
            -1e308,
            float("nan"),
            float("inf"),
            3.4e38,
            "",
            "x" * rng.choice([3, 10_000]),
            [],
            {},
            [1, 2],
            [[[[[[1]]]]]],
            {"a": {"b": [None]}},
            "@@DEEP@@",
            "@@HUGE@@",
            "LORA",
            "none",
            "(a+)+$",
            "[",
            "a*a*a*a*a*a*a*a*a*b",
            "model.layers.0.self_attn.q_proj",
        ]
    )


def _dumps(value) -> str:
    text = json.dumps(value)
    return text.replace('"@@DEEP@@"', DEEP).replace('"@@HUGE@@"', HUGE_INT_TEXT)


CONFIG_KEYS = [
    "peft_type",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "alpha_pattern",
    "rank_pattern",
    "bias",
    "fan_in_fan_out",
    "lora_bias",
    "r",
    "target_modules",
]


def _mutate_config(rng: random.Random, text: str) -> str:
    cfg = json.loads(text)
    kind = rng.randrange(7)
    if kind == 0:
        cfg.pop(rng.choice(list(cfg)), None)
    elif kind in (1, 2):
        cfg[rng.choice(CONFIG_KEYS)] = _json_values(rng)
    elif kind == 3:
        pattern = rng.choice(["model.layers.0.self_attn.q_proj", "model.layers.*", "(a+)+$", "[", "x" * 600, ".*"])
        cfg["alpha_pattern"] = {pattern: _json_values(rng)}
    elif kind == 4:
        return _dumps(_json_values(rng))  # not an object at all
    elif kind == 5:
        blob = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        return blob.decode("latin-1")
    else:
        return text[: rng.randrange(len(text))]
    return _dumps(cfg)


RECORD_FIELDS = ["key", "rows", "cols", "alpha", "scaling", "init", "mode", "bake"]


def _mutate_record(rng: random.Random, text: str) -> str:
    rec = json.loads(text)
    kind = rng.randrange(6)
    groups = rec["groups"]
    name = rng.choice(list(groups))
    if kind == 0 or not groups[name]:
        rec[rng.choice(["groups", "format", "version"])] = _json_values(rng)
    elif kind == 1:
        groups[name] = _json_values(rng)
    else:
        part = rng.choice(groups[name])
        fld = rng.choice(RECORD_FIELDS)
        choice = rng.randrange(4)
        if choice == 0:
            part.pop(fld)
        elif choice == 1:
            part[fld] = _json_values(rng)
        elif choice == 2 and fld in ("rows", "cols"):
            part[fld] = [rng.choice([-1, 0, 1, 3, 7, 64, 1 << 40]), rng.choice([0, 1, 8, 16, 63, 64, 200])]
        else:
            part[fld] = rng.choice(["lora", "dora", "qa_lora", "rslora", "legacy_normal", "0:wq", "9:wv", "0:wk"])
    return _dumps(rec)


# ------------------------------------------------------------------------------------------- safetensors
def _split_safetensors(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", blob)[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join_safetensors(header: dict, data: bytes, raw_header: str | None = None) -> bytes:
    text = (raw_header if raw_header is not None else json.dumps(header)).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(text)) + text + data


DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "I8", "XX"]


def _mutate_safetensors(rng: random.Random, blob: bytes) -> bytes:
    header, data = _split_safetensors(blob)
    names = [k for k in header if k != "__metadata__"]
    kind = rng.randrange(11)
    if kind == 0:  # the header length
        v = rng.choice(U64_VALUES + [len(blob), len(blob) - 8])
        return struct.pack("<Q", v) + blob[8:]
    if kind == 1:  # bytes of the header or the data
        out = bytearray(blob)
        n = struct.unpack_from("<Q", blob)[0]
        lo, hi = (8, 8 + n) if rng.random() < 0.7 else (8 + n, len(blob))
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(lo, hi)] = rng.randrange(256)
        return bytes(out)
    if kind == 2:
        return blob[: rng.randrange(len(blob))]
    name = rng.choice(names)
    info = header[name]
    if kind == 3:
        info["dtype"] = rng.choice(DTYPES)
    elif kind == 4:
        shape = info["shape"]
        info["shape"] = rng.choice(
            [
                shape[::-1],
                [0] + shape[1:],
                shape + [1],
                shape[:1],
                [],
                [1 << 40, 1],
                [shape[0] * 2, shape[-1] // 2 or 1],
            ]
        )
    elif kind == 5:
        other = header[rng.choice(names)]
        info["shape"], other["shape"] = other["shape"], info["shape"]  # two tensors' shapes swapped
    elif kind == 6:
        lo, hi = info["data_offsets"]
        info["data_offsets"] = rng.choice([[hi, lo], [lo, hi + 4], [0, hi - lo], [lo, lo], [lo, 1 << 62], [-1, hi]])
    elif kind == 7:
        other = rng.choice(names)
        header[name], header[other] = header[other], header[name]  # names swapped
    elif kind == 8:
        meta = header.get("__metadata__", {})
        if "juno_py" in meta and rng.random() < 0.8:
            meta["juno_py"] = _mutate_record(rng, meta["juno_py"])
        else:
            meta[rng.choice(["juno_py", "format"])] = rng.choice(["", "{}", "[]", "null", DEEP, '{"format": 1}'])
        header["__metadata__"] = meta
    elif kind == 9:  # one float element of the data set to a hostile value
        if info["dtype"] == "F32" and info["data_offsets"][1] > info["data_offsets"][0]:
            lo, hi = info["data_offsets"]
            at = lo + 4 * rng.randrange((hi - lo) // 4)
            data = data[:at] + struct.pack("<f", rng.choice(HOSTILE_FLOATS)) + data[at + 4 :]
    else:
        renamed = rng.choice(
            [name.replace("lora_A", "lora_B"), name + ".x", "x" * 5000, name.replace("layers.0", "layers.99")]
        )
        header[renamed] = header.pop(name)
    return _join_safetensors(header, data)


# ------------------------------------------------------------------------------------------- adapter.bin
def _adapter_bounds(blob: bytes) -> tuple[list[int], list[int]]:
    """(offsets of the i32 fields, offsets of the f32 elements) of a version-2 file, walked independently of the
    reader from the format's table."""
    ints, floats = [0, 4, 8], []
    pos = 12
    (count,) = struct.unpack_from(">i", blob, 8)
    for _ in range(count):
        ints.append(pos)  # entry_len
        pos += 4
        ints.append(pos)  # key_len
        (klen,) = struct.unpack_from(">i", blob, pos)
        pos += 4 + klen
        rank, n_in, n_out = struct.unpack_from(">iii", blob, pos)
        ints += [pos, pos + 4, pos + 8, pos + 16, pos + 20, pos + 24]
        floats.append(pos + 12)  # alpha
        pos += 28
        n = rank * n_in + n_out * rank
        floats += [pos + 4 * i for i in range(n)]
        pos += 4 * n
        if blob[pos]:
            floats += [pos + 1 + 4 * i for i in range(n_out)]
            pos += 1 + 4 * n_out
        else:
            pos += 1
        if blob[pos]:
            ints += [pos + 1, pos + 5]
            (nd,) = struct.unpack_from(">i", blob, pos + 5)
            ints += [pos + 9 + 4 * i for i in range(nd)]
            pos += 9 + 4 * nd + 32
        else:
            pos += 1
        ints.append(pos)  # ext_len
        (ext,) = struct.unpack_from(">i", blob, pos)
        pos += 4 + ext
    assert pos == len(blob)
    return ints, floats


def _mutate_adapter(rng: random.Random, blob: bytes, ints: list[int], floats: list[int]) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        out = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == 1:
        at = rng.choice(ints)
        return blob[:at] + struct.pack(">i", rng.choice(HOSTILE_I32)) + blob[at + 4 :]
    if kind in (2, 3):
        out = bytearray(blob)
        for _ in range(rng.choice([1, 1, 3])):
            at = rng.choice(floats)
            out[at : at + 4] = struct.pack(">f", rng.choice(HOSTILE_FLOATS))
        return bytes(out)
    if kind == 4:
        at = rng.choice(ints)
        v = (struct.unpack_from(">i", blob, at)[0] + rng.choice([-1, 1, 4, -4])) & 0xFFFFFFFF
        return blob[:at] + struct.pack(">I", v) + blob[at + 4 :]
    return blob[: rng.randrange(len(blob))]


# --------------------------------------------------------------------------------------------- GGUF-LoRA
def _gguf_bounds(path) -> tuple[list[int], int]:
    r = gguf_ref.GGUFReader(str(path))
    bounds = {0, 4, 8, 16, 24}
    for f in list(r.fields.values()) + [t.field for t in r.tensors]:
        off = f.offset
        for part in f.parts:
            bounds.add(off)
            off += part.nbytes
    return sorted(bounds), r.data_offset


def _rewrite_gguf_lora(rng: random.Random, src: Path, dst: Path) -> None:
    """A structured mutant written with our writer: a field changed (type or value), a tensor's data, shape or
    name changed."""
    with GGUFFile(src) as f, GGUFWriter(dst) as w:
        w.copy_fields(f)
        names = list(f.tensors)
        kind = rng.randrange(6)
        if kind == 0:
            w.add_field(
                "adapter.lora.alpha",
                *rng.choice(
                    [
                        (float("nan"), ValueType.FLOAT32),
                        (float("inf"), ValueType.FLOAT32),
                        (3.4e38, ValueType.FLOAT32),
                        (-1e30, ValueType.FLOAT32),
                        (8, ValueType.UINT32),
                        ("8", ValueType.STRING),
                        (8.0, ValueType.FLOAT64),
                    ]
                ),
            )
        elif kind == 1:
            key = rng.choice(["general.type", "adapter.type", "general.architecture"])
            w.add_field(key, rng.choice(["adapter", "lora", "llama", "x" * 100_000, "", "qwen2"]), ValueType.STRING)
        elif kind == 2:
            text = f.metadata.get("juno_py.adapter_parts")
            if text:
                w.add_field("juno_py.adapter_parts", _mutate_record(rng, text), ValueType.STRING)
            else:
                w.add_field("juno_py.adapter_parts", rng.choice([DEEP, "{", "[]"]), ValueType.STRING)
        swap = rng.sample(names, 2) if kind == 3 else []
        for name in names:
            info = f.tensor(name)
            values = f.dequantize(name).numpy().astype(np.float32)
            shape = tuple(int(d) for d in info.shape)
            target = name
            if kind == 4 and name == names[0]:
                flat = values.reshape(-1).copy()
                for _ in range(rng.choice([1, 3])):
                    flat[rng.randrange(flat.size)] = rng.choice(HOSTILE_FLOATS)
                values = flat.reshape(values.shape)
            if kind == 5 and name == names[0]:
                shape = shape[::-1]  # same elements, transposed shape
            if swap and name in swap:
                target = swap[1] if name == swap[0] else swap[0]
            w.add_tensor(target, values, GGMLType.F32, shape)


def _mutate_gguf_bytes(rng: random.Random, data: bytes, bounds: list[int], header_end: int) -> bytes:
    kind = rng.randrange(4)
    at = rng.choice(bounds[:-1])
    if kind == 0:
        blob = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob) if rng.random() < 0.3 else header_end)] = rng.randrange(256)
        return bytes(blob)
    if kind == 1:
        return data[:at] + struct.pack("<Q", rng.choice(U64_VALUES + [len(data)])) + data[at + 8 :]
    if kind == 2:
        return data[:at] + struct.pack("<I", rng.choice(U32_VALUES + [rng.randrange(1 << 32)])) + data[at + 4 :]
    return data[: rng.randrange(len(data))]


# ----------------------------------------------------------------------------------------------- the run
@pytest.fixture(scope="module")
def seeds(tiny_gguf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz_adapters")
    llama = tiny_gguf("llama", GGMLType.Q8_0)
    phi3 = tiny_gguf("phi3", GGMLType.Q8_0)
    bins = {
        "lora": make_adapter(llama, folder / "lora.bin", targets="qv", rank=2),
        "dora": make_adapter(llama, folder / "dora.bin", targets="attn", rank=2, mode=Mode.DORA),
        "phi3-lora": make_adapter(phi3, folder / "phi3.bin", targets="all", rank=2),
        "phi3-dora": make_adapter(phi3, folder / "phi3-dora.bin", targets="qv", rank=2, mode=Mode.DORA),
    }
    base_of = {"lora": llama, "dora": llama, "phi3-lora": phi3, "phi3-dora": phi3}
    peft = {}
    for name, path in bins.items():
        out = export_peft(base_of[name], path, folder / f"peft-{name}")
        peft[name] = ((out / CONFIG_FILE).read_text(), (out / WEIGHTS_FILE).read_bytes())
    # a foreign folder: no juno-py record in the safetensors metadata
    header, data = _split_safetensors(peft["phi3-lora"][1])
    header["__metadata__"] = {"format": "pt"}
    peft["phi3-foreign"] = (peft["phi3-lora"][0], _join_safetensors(header, data))
    base_of["phi3-foreign"] = phi3
    loras = {}
    for name in ("lora", "phi3-lora"):
        for dtype in ("f32", "f16"):
            path = export_gguf_lora(base_of[name], bins[name], folder / f"{name}-{dtype}.gguf", dtype=dtype)
            loras[f"{name}-{dtype}"] = (path, name)
    foreign = folder / "foreign.gguf"
    with GGUFFile(loras["phi3-lora-f32"][0]) as f, GGUFWriter(foreign) as w:
        w.copy_fields(f, skip=["juno_py.adapter_parts"])
        for t in f.tensors:
            w.copy_tensor(f, t)
    loras["foreign"] = (foreign, "phi3-lora")
    models = {llama: load_model(llama), phi3: load_model(phi3)}
    return {
        "folder": folder,
        "bins": {k: (p.read_bytes(), *_adapter_bounds(p.read_bytes()), base_of[k]) for k, p in bins.items()},
        "peft": {k: (*v, base_of[k]) for k, v in peft.items()},
        "loras": {k: (p.read_bytes(), *_gguf_bounds(p), base_of[b], p) for k, (p, b) in loras.items()},
        "models": models,
    }


def _play(model, adapter: Path, ids) -> None:
    """Playback-level use: load on the model and run it; logits must be finite."""
    load_adapters(model, [str(adapter)])
    with torch.no_grad():
        logits = model.logits(ids)
    if not torch.isfinite(logits).all():
        raise AssertionError(f"{adapter.name} loaded but plays back non-finite logits")


def _case(rng: random.Random, seeds, case: int) -> tuple[str, Callable[[], None]]:
    """(a label, the work of one case): writes a mutant and returns what reads and uses it."""
    folder: Path = seeds["folder"]
    ids = sample_ids(6)
    out = folder / "imported.bin"
    out.unlink(missing_ok=True)
    family = case % 3
    if family == 0:
        name = rng.choice(sorted(seeds["bins"]))
        blob, ints, floats, base = seeds["bins"][name]
        path = folder / "mutant.bin"
        path.write_bytes(_mutate_adapter(rng, blob, ints, floats))

        def run():
            read_adapter(path)
            _play(seeds["models"][base], path, ids)

        return f"adapter.bin {name}", run
    if family == 1:
        name = rng.choice(sorted(seeds["peft"]))
        cfg, weights, base = seeds["peft"][name]
        path = folder / "peft-mutant"
        path.mkdir(exist_ok=True)
        if rng.random() < 0.4:
            cfg = _mutate_config(rng, cfg)
        else:
            weights = _mutate_safetensors(rng, weights)
        (path / CONFIG_FILE).write_text(cfg, encoding="utf-8", errors="surrogateescape")
        (path / WEIGHTS_FILE).write_bytes(weights)

        def run():
            try:
                import_peft(base, path, out)
            except JunoError:
                assert not out.exists(), "a refused import left its output"
                raise
            read_adapter(out)  # what an import writes, our reader loads
            _play(seeds["models"][base], out, ids)

        return f"PEFT {name}", run
    name = rng.choice(sorted(seeds["loras"]))
    data, bounds, header_end, base, src = seeds["loras"][name]
    path = folder / "mutant.gguf"
    if rng.random() < 0.5:
        _rewrite_gguf_lora(rng, src, path)
    else:
        path.write_bytes(_mutate_gguf_bytes(rng, data, bounds, header_end))

    def run():
        try:
            import_gguf_lora(base, path, out)
        except JunoError:
            assert not out.exists(), "a refused import left its output"
            raise
        read_adapter(out)
        _play(seeds["models"][base], out, ids)

    return f"GGUF-LoRA {name}", run


def _alarm(*_):
    raise TimeoutError("a case did not finish within 30 s")


def test_fuzz_adapters(seeds):
    rng = random.Random(int(os.environ.get("JUNO_FUZZ_SEED", "0")))
    stats = {"cases": 0, "loaded": 0, "refused": 0, "failures": [], "max_message": 0, "max_peak": 0}
    start = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(CASES):
            label, run = _case(rng, seeds, case)
            tracemalloc.start()
            signal.alarm(30)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    run()
                for w in caught:  # a warning is a message a user reads too
                    text = str(w.message)
                    stats["max_message"] = max(stats["max_message"], len(text))
                    if "\n" in text or len(text) > MAX_MESSAGE:
                        stats["failures"].append(f"case {case} ({label}): warning of {len(text)} characters")
                stats["loaded"] += 1
            except JunoError as e:
                stats["refused"] += 1
                msg = str(e)
                stats["max_message"] = max(stats["max_message"], len(msg))
                if "\n" in msg or len(msg) > MAX_MESSAGE:
                    stats["failures"].append(f"case {case} ({label}): message of {len(msg)} characters: {msg[:200]}")
            except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
                stats["failures"].append(f"case {case} ({label}): {type(e).__name__}: {str(e)[:300]}")
            finally:
                signal.alarm(0)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            stats["max_peak"] = max(stats["max_peak"], peak)
            if peak > PEAK_BOUND:
                stats["failures"].append(f"case {case} ({label}): allocated {peak} bytes")
            stats["cases"] += 1
    finally:
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, old)
    seconds = time.perf_counter() - start
    print(
        f"\nfuzz adapters: {stats['cases']} cases, {stats['loaded']} loaded, {stats['refused']} refused, "
        f"{len(stats['failures'])} failures, longest message {stats['max_message']} characters, "
        f"traced peak {stats['max_peak'] / 2**20:.1f} MiB, {seconds:.1f} s"
    )
    assert not stats["failures"], "\n".join(stats["failures"][:30])
    assert stats["refused"] > stats["cases"] // 4  # the mutations do reach the checks
    assert stats["loaded"] > stats["cases"] // 20  # and some mutants are harmless enough to load and play
