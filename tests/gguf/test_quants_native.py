"""The native block decoder (`juno_py/gguf/quants/native_decode.c`) against the torch codecs: the same bits for every
type and output dtype, on random blocks with every kind of scale and on every tensor of the real models; the silent
fallback when it is disabled or cannot be built; its cache under concurrent builds."""

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from juno_py.gguf import GGMLType, quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.gguf.quants import native
from juno_py.gguf.quants.simple import F16_SCALE_OFFSETS

TYPES = [GGMLType(t) for t in sorted(native.TYPES)]
DTYPES = [torch.float32, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
REPO = Path(__file__).resolve().parents[2]

# float16 scale patterns where decoders go wrong: zeros of both signs, subnormals, the largest finite, infinities,
# quiet and signalling NaNs with payloads
SPECIAL_F16 = [
    0x0000,
    0x8000,
    0x0001,
    0x8001,
    0x03FF,
    0x0400,
    0x7BFF,
    0xFBFF,
    0x7C00,
    0xFC00,
    0x7E00,
    0xFE00,
    0x7C01,
    0xFC01,
    0x7FFF,
    0x7D55,
    0x3C00,
]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def lib():
    found = native.library()
    if found is None:
        pytest.skip("the native decoder is not available here (no C compiler, or JUNO_PY_NATIVE=0)")
    return found


def torch_codec(ggml_type: GGMLType, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch codec itself, whatever the native path would do."""
    codec = quants.get_codec(ggml_type)
    if dtype == torch.float32:
        return codec.dequantize_blocks(blocks)
    return codec.dequantize_blocks(blocks, out_dtype=dtype)


def assert_same_bits(expected: torch.Tensor, actual: torch.Tensor, what: str = "") -> None:
    assert expected.dtype == actual.dtype and expected.shape == actual.shape, what
    e, a = expected.view(BITS[expected.dtype]), actual.view(BITS[actual.dtype])
    if not torch.equal(e, a):
        bad = (e != a).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {e.numel()} values differ; first at {i}: "
            f"{expected[i].item()!r} ({int(e[i]) & 0xFFFFFFFF:#x}) vs {actual[i].item()!r} "
            f"({int(a[i]) & 0xFFFFFFFF:#x})"
        )


def random_blocks(data, ggml_type: GGMLType, n_blocks: int) -> np.ndarray:
    """Random bytes for `n_blocks` blocks, each float16 scale finite and random, or one of SPECIAL_F16."""
    type_size = GGML_BLOCK_SIZES[ggml_type][1]
    payload = data.draw(st.binary(min_size=n_blocks * type_size, max_size=n_blocks * type_size), label="bytes")
    blocks = np.frombuffer(payload, dtype=np.uint8).copy().reshape(n_blocks, type_size)
    for offset in F16_SCALE_OFFSETS[ggml_type]:
        scale = blocks[:, offset : offset + 2].copy().view(np.uint16)
        scale &= 0xBFFF  # finite
        special = data.draw(
            st.lists(st.sampled_from(SPECIAL_F16 + [-1]), min_size=n_blocks, max_size=n_blocks),
            label=f"scale at {offset}",
        )
        scale[:, 0] = np.where(np.array(special) >= 0, np.array(special) & 0xFFFF, scale[:, 0])
        blocks[:, offset : offset + 2] = scale.view(np.uint8)
    return blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@SETTINGS
@given(data=st.data())
def test_native_decode_matches_torch_codec_bit_for_bit(lib, ggml_type, dtype, data):
    rows = data.draw(st.sampled_from([1, 2, 3]), label="rows")
    per_row = data.draw(st.integers(1, 5), label="blocks per row")
    blocks = torch.from_numpy(random_blocks(data, ggml_type, rows * per_row))
    block_size = GGML_BLOCK_SIZES[ggml_type][0]
    actual = quants.dequantize(ggml_type, blocks.view(rows, -1), per_row * block_size, dtype=dtype)
    assert actual.shape == (rows, per_row * block_size) and actual.dtype == dtype
    if rows * per_row == 1 and dtype == torch.float32:
        # torch converts a lone float16 scale on its scalar path, which turns every NaN into 0x7FFFFFFF; among
        # several blocks (its vector path, and the native table) a NaN keeps its payload, as in gguf. Compare
        # the lone block decoded beside a copy of itself.
        expected = torch_codec(ggml_type, blocks.repeat(2, 1), dtype)[:1]
    else:
        expected = torch_codec(ggml_type, blocks, dtype)
    assert_same_bits(expected.reshape(actual.shape), actual, f"{ggml_type.name} {dtype}")


def test_lone_block_nan_scale_keeps_gguf_payload(lib):
    """The one place the torch codec's bits differ (a single block with a NaN scale, float32): the native result
    is gguf's NaN, payload and all; torch's is NaN too."""
    block = np.zeros((1, 34), dtype=np.uint8)
    block[0, 0:2] = np.array([0x7D55], dtype=np.uint16).view(np.uint8)
    block[0, 2:] = 3
    with np.errstate(invalid="ignore"):
        expected = gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q8_0).reshape(1, 32)
    actual = quants.dequantize(GGMLType.Q8_0, block, 32)
    np.testing.assert_array_equal(expected.view(np.uint32), actual.numpy().view(np.uint32))
    assert torch.isnan(torch_codec(GGMLType.Q8_0, torch.from_numpy(block), torch.float32)).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_native_decode_of_many_quantized_rows_matches_torch_codec(lib, ggml_type):
    """Rows of real-looking data (quantized normal values at several magnitudes), long enough that the vector
    loops and the torch codec's chunks both run many times; an odd row count, and a shifted (unaligned) buffer."""
    rows, cols = 37, 1024
    g = torch.Generator().manual_seed(int(ggml_type))
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 2, rows).unsqueeze(1)
    if quants.get_codec(ggml_type).quantize_blocks is not None:
        raw = torch.from_numpy(quants.quantize(ggml_type, x))
    else:
        raw = torch.randint(0, 256, (rows, quants.get_codec(ggml_type).row_bytes(cols)), dtype=torch.uint8, generator=g)
        blocks = raw.view(-1, GGML_BLOCK_SIZES[ggml_type][1])
        for offset in F16_SCALE_OFFSETS[ggml_type]:
            blocks[:, offset : offset + 2] = (
                (torch.rand(blocks.shape[0], generator=g) * 1e-3).half().view(torch.uint8).view(-1, 2)
            )
    shifted = torch.zeros(raw.numel() + 1, dtype=torch.uint8)
    shifted[1:] = raw.reshape(-1)
    for dtype in DTYPES:
        expected = torch_codec(ggml_type, raw.view(-1, GGML_BLOCK_SIZES[ggml_type][1]), dtype).view(rows, cols)
        assert_same_bits(expected, quants.dequantize(ggml_type, raw, cols, dtype=dtype), f"{dtype}")
        assert_same_bits(
            expected, quants.dequantize(ggml_type, shifted[1:].view(rows, -1), cols, dtype=dtype), f"{dtype}, unaligned"
        )


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_native_decode_split_over_threads_is_the_same(lib, ggml_type):
    g = torch.Generator().manual_seed(3)
    type_size = GGML_BLOCK_SIZES[ggml_type][1]
    blocks = torch.randint(0, 256, (101, type_size), dtype=torch.uint8, generator=g)
    for dtype in DTYPES:
        one = native.decode_with(lib, ggml_type, blocks, dtype, threads=1)
        for threads in (2, 3, 200):
            assert_same_bits(
                one, native.decode_with(lib, ggml_type, blocks, dtype, threads=threads), f"{dtype}, {threads} threads"
            )


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"], ids=["8 lanes (AVX2)", "4 lanes (SSE)"])
def test_narrower_vector_builds_decode_the_same_bits(lib, march, tmp_path):
    """The source picks its vector width from the target (16 lanes with AVX-512, 8 with AVX2, 4 otherwise): a
    build for a narrower machine gives the same bits."""
    compiler = native.find_compiler()
    path = tmp_path / f"native_decode-{march}.so"
    native.build(compiler, path, tuple(f if f != "-march=native" else f"-march={march}" for f in native.FLAGS))
    narrow = native.open_library(path)
    g = torch.Generator().manual_seed(5)
    for ggml_type in TYPES:
        blocks = torch.randint(0, 256, (67, GGML_BLOCK_SIZES[ggml_type][1]), dtype=torch.uint8, generator=g)
        for dtype in DTYPES:
            assert_same_bits(
                native.decode_with(lib, ggml_type, blocks, dtype),
                native.decode_with(narrow, ggml_type, blocks, dtype),
                f"{ggml_type.name} {dtype}",
            )


# ---- fallback ----------------------------------------------------------------------------------------------------


def gguf_reference(ggml_type: GGMLType, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(ggml_type)))


def finite_q4_k_rows() -> np.ndarray:
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    raw = torch.randint(0, 256, (3, 2 * 144), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    blocks = raw.view(-1, 144)
    blocks[:, 0:4] = (x.abs().reshape(-1)[: blocks.shape[0] * 2] * 1e-2).half().view(torch.uint8).view(-1, 4)
    return raw.numpy()


def test_disabled_native_path_falls_back_to_the_torch_codecs(monkeypatch):
    raw = finite_q4_k_rows()
    monkeypatch.setenv("JUNO_PY_NATIVE", "0")
    assert native.library() is None
    assert native.decode(GGMLType.Q4_K, torch.from_numpy(raw).view(-1, 144), torch.float32) is None
    out = quants.dequantize(GGMLType.Q4_K, raw, 512)
    np.testing.assert_array_equal(gguf_reference(GGMLType.Q4_K, raw).view(np.uint32), out.numpy().view(np.uint32))


@pytest.mark.parametrize("cause", ["no compiler", "compile fails"])
def test_unbuildable_native_decoder_falls_back_silently(cause, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path))
    if cause == "no compiler":
        monkeypatch.setattr(native, "find_compiler", lambda: None)
    else:
        failing = tmp_path / "cc"
        failing.write_text("#!/bin/sh\necho 'cc: error: no such thing' >&2\nexit 1\n")
        failing.chmod(0o755)
        monkeypatch.setattr(native, "find_compiler", lambda: str(failing))
    raw = finite_q4_k_rows()
    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        for dtype in DTYPES:  # twice: the failure is remembered, not retried
            out = quants.dequantize(GGMLType.Q4_K, raw, 512, dtype=dtype)
            expected = torch.from_numpy(gguf_reference(GGMLType.Q4_K, raw)).to(dtype)
            assert torch.equal(out.view(BITS[dtype]), expected.view(BITS[dtype]))
    assert native._state == {"lib": None}
    notes = [r for r in caplog.records if r.name == native.__name__]
    assert len(notes) == 1 and notes[0].levelno == logging.DEBUG and "torch codecs" in notes[0].getMessage()
    assert not list((tmp_path / "native").glob("*"))  # a failed build leaves no temporary behind


# ---- cache -------------------------------------------------------------------------------------------------------

_BUILD_AND_DECODE = """
import sys, torch
from juno_py.gguf.quants import native
lib = native.library()
assert lib is not None, "no native library"
blocks = torch.arange(10 * 34, dtype=torch.int64).remainder(251).to(torch.uint8).view(10, 34)
blocks[:, 0:2] = torch.tensor([0x3C00], dtype=torch.int16).view(torch.uint8)
print(native.decode(8, blocks, torch.float32).sum().item())
"""


def test_processes_building_the_cache_at_once_both_succeed(lib, tmp_path):
    """Two processes start with an empty cache and compile at once (as distributed ranks do): each ends with a working
    library, and the cache holds one complete file and no temporaries."""
    env = dict(
        os.environ,
        JUNO_PY_HOME=str(tmp_path),
        PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )
    env.pop("JUNO_PY_NATIVE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_AND_DECODE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    assert results[0][0] == results[1][0]
    files = sorted((tmp_path / "native").iterdir())
    assert [f.name for f in files] == [native.library_path(native.find_compiler()).name]
    assert native.open_library(files[0]).juno_native_abi() == native.ABI


def test_a_damaged_cached_library_is_built_again(lib, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path))
    path = native.library_path(native.find_compiler())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    rebuilt = native.library()
    assert rebuilt is not None and rebuilt.juno_native_abi() == native.ABI
    assert path.read_bytes()[:4] == b"\x7fELF" or platform.system() != "Linux"


def test_library_is_keyed_by_source_compiler_and_cpu(monkeypatch, tmp_path):
    compiler = native.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("JUNO_PY_HOME", str(tmp_path))
    path = native.library_path(compiler)
    assert path.parent == tmp_path / "native" and path.suffix == ".so"
    assert native.library_path(compiler) == path
    other_source = tmp_path / "other.c"
    other_source.write_bytes(native.SOURCE.read_bytes() + b"\n/* changed */\n")
    for name, value in [
        ("_cpu_flags", lambda: "another machine"),
        ("_compiler_version", lambda c: "cc 0.1"),
        ("SOURCE", other_source),
    ]:
        with monkeypatch.context() as m:
            m.setattr(native, name, value)
            assert native.library_path(compiler) != path, name


# ---- real models -------------------------------------------------------------------------------------------------

ROWS_PER_STEP = 8192


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_every_tensor_of_the_real_models_decodes_natively_as_the_torch_codecs_do(lib, model, request):
    reader = gguf.GGUFReader(request.getfixturevalue(model))
    types_seen = set()
    for tensor in reader.tensors:
        if int(tensor.tensor_type) not in native.TYPES:
            continue
        ggml_type = GGMLType(int(tensor.tensor_type))
        n_cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        raw = tensor.data.view(np.uint8).reshape(-1, quants.get_codec(ggml_type).row_bytes(n_cols))
        for start in range(0, raw.shape[0], ROWS_PER_STEP):
            rows = torch.from_numpy(raw[start : start + ROWS_PER_STEP].copy())
            for dtype in DTYPES:
                expected = torch_codec(ggml_type, rows.reshape(-1, GGML_BLOCK_SIZES[ggml_type][1]), dtype)
                actual = quants.dequantize(ggml_type, rows, n_cols, dtype=dtype)
                assert_same_bits(
                    expected.view(actual.shape), actual, f"{tensor.name} ({ggml_type.name}) rows {start}+, {dtype}"
                )
        types_seen.add(ggml_type.name)
    assert len(types_seen) >= 2, types_seen
