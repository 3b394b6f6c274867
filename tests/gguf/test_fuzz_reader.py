"""Mutation fuzzing of the GGUF reader: byte flips, length and type fields set to hostile values, truncations.

Every mutant either reads (and then decodes) or is refused with a one-line `JunoError` of at most 500
characters; nothing else may escape, and no case may allocate more than a fixed bound. JUNO_FUZZ_CASES sets
the number of mutants (300 by default; 10,000 or more for a long run).
"""

import os
import random
import resource
import signal
import struct
import time
import tracemalloc

import gguf as gguf_ref
import pytest
import torch

from juno_py.errors import MAX_MESSAGE, JunoError
from juno_py.gguf import GGMLType, GGUFFile, ValueType
from juno_py.testing.tiny_models import MERGES, tiny_vocab, write_gguf

CASES = int(os.environ.get("JUNO_FUZZ_CASES", "300"))
PEAK_BOUND = 64 << 20  # bytes any single case may allocate (the real header itself is ~2.5 MB)
U64_VALUES = [0, 1, (1 << 63), (1 << 64) - 1, (1 << 64) - 8, 1 << 40, 1 << 32, 0x7FFFFFFF, 65537]
U32_VALUES = [0, 1, 7, 8, 9, 12, 13, 31, 99, 0xFFFFFFFF, 1 << 31]


def _tiny_model(path):
    vocab = tiny_vocab()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "token_embd.weight": torch.randn(len(vocab), 64, generator=g),
        "blk.0.attn_q.weight": torch.randn(64, 64, generator=g),
        "blk.0.attn_norm.weight": torch.ones(64),
        "output_norm.weight": torch.ones(64),
    }
    metadata = [
        ("general.architecture", "llama", ValueType.STRING),
        ("general.name", "fuzz ü", ValueType.STRING),
        ("llama.block_count", 1, ValueType.UINT32),
        ("llama.rope.freq_base", 1e4, ValueType.FLOAT32),
        ("llama.attention.head_count", [4], ValueType.ARRAY),
        ("split.count", 0, ValueType.UINT16),
        ("tokenizer.ggml.model", "gpt2", ValueType.STRING),
        ("tokenizer.ggml.tokens", vocab, ValueType.ARRAY),
        ("tokenizer.ggml.token_type", [1] * len(vocab), ValueType.ARRAY),
        ("tokenizer.ggml.merges", MERGES, ValueType.ARRAY),
        ("tokenizer.ggml.add_bos_token", False, ValueType.BOOL),
    ]
    return write_gguf(path, metadata, tensors, GGMLType.Q8_0)


def _boundaries(path) -> tuple[list[int], int]:
    """Offsets where each header part starts, from the gguf package's reader (an independent parser)."""
    r = gguf_ref.GGUFReader(str(path))
    bounds = {0, 4, 8, 16, 24}
    for f in list(r.fields.values()) + [t.field for t in r.tensors]:
        off = f.offset
        for part in f.parts:
            bounds.add(off)
            off += part.nbytes
    return sorted(bounds), r.data_offset


def _mutate(rng: random.Random, data: bytes, bounds: list[int], header_end: int) -> tuple[str, bytes]:
    kind = rng.choice(["flip", "u64", "u64", "u32", "u32", "truncate", "off-by-one"])
    at = rng.choice(bounds[:-1])
    if kind == "flip":
        blob = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(header_end)] = rng.randrange(256)
        return kind, bytes(blob)
    if kind == "u64":
        return kind, data[:at] + struct.pack("<Q", rng.choice(U64_VALUES + [len(data), len(data) - at])) + data[
            at + 8 :
        ]
    if kind == "u32":
        v = rng.choice(U32_VALUES + [rng.randrange(1 << 32)])
        return kind, data[:at] + struct.pack("<I", v) + data[at + 4 :]
    if kind == "off-by-one":
        if at + 8 > len(data):
            return kind, data
        v = (struct.unpack_from("<Q", data, at)[0] + rng.choice([-1, 1])) % (1 << 64)
        return kind, data[:at] + struct.pack("<Q", v) + data[at + 8 :]
    cut = rng.choice([at, rng.randrange(len(data))])
    return kind, data[:cut]


def _exercise(path) -> None:
    """Read, and use what was read: metadata, typed accessors and every tensor decoded."""
    with GGUFFile(path) as f:
        _ = f.architecture
        f.get_int("llama.block_count", 0)
        for name in list(f.tensors)[:8]:
            f.dequantize(name)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory, smollm2_path):
    folder = tmp_path_factory.mktemp("fuzz")
    tiny = _tiny_model(folder / "tiny.gguf")
    out = []
    bounds, data_start = _boundaries(tiny)
    out.append(("tiny", tiny.read_bytes(), bounds, data_start))
    # the real SmolLM2 header and the first 4 KiB of its data (its tensors then lie past the end: refused)
    bounds, data_start = _boundaries(smollm2_path)
    with open(smollm2_path, "rb") as fh:
        head = fh.read(data_start + 4096)
    out.append(("smollm2", head, [b for b in bounds if b < data_start], data_start))
    return out, folder


def _alarm(*_):
    raise TimeoutError("the reader did not finish a case within 30 s")


def test_fuzz_reader(seeds):
    seeds, folder = seeds
    rng = random.Random(int(os.environ.get("JUNO_FUZZ_SEED", "0")))
    path = folder / "mutant.gguf"
    stats = {"cases": 0, "read": 0, "refused": 0, "failures": [], "max_message": 0, "max_peak": 0}
    start = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        for case in range(CASES):
            name, data, bounds, header_end = seeds[0] if case % 5 else seeds[1]
            kind, blob = _mutate(rng, data, bounds, header_end)
            path.write_bytes(blob)
            # tracing makes the real header's 100,000 strings 20x slower to read: one real case in ten is traced
            traced = name == "tiny" or case % 50 == 0
            if traced:
                tracemalloc.start()
            signal.alarm(30)
            try:
                _exercise(path)
                stats["read"] += 1
            except JunoError as e:
                stats["refused"] += 1
                msg = str(e)
                stats["max_message"] = max(stats["max_message"], len(msg))
                if "\n" in msg or len(msg) > MAX_MESSAGE:
                    stats["failures"].append(f"case {case} ({name}, {kind}): message of {len(msg)} characters")
            except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
                stats["failures"].append(f"case {case} ({name}, {kind}): {type(e).__name__}: {str(e)[:200]}")
            finally:
                signal.alarm(0)
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                stats["max_peak"] = max(stats["max_peak"], peak)
                if peak > PEAK_BOUND:
                    stats["failures"].append(f"case {case} ({name}, {kind}): allocated {peak} bytes")
            stats["cases"] += 1
    finally:
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, old)
    seconds = time.perf_counter() - start
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before  # KiB on Linux
    print(
        f"\nfuzz: {stats['cases']} cases, {stats['read']} read, {stats['refused']} refused, "
        f"{len(stats['failures'])} failures, longest message {stats['max_message']} characters, "
        f"traced peak {stats['max_peak'] / 2**20:.1f} MiB, max RSS growth {rss_growth / 1024:.1f} MiB, "
        f"{seconds:.1f} s"
    )
    assert rss_growth < 256 << 10, f"the process grew by {rss_growth} KiB"
    assert not stats["failures"], "\n".join(stats["failures"][:20])
    assert stats["refused"] > stats["cases"] // 4  # the mutations do reach the checks
