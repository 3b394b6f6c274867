"""K-quant encoders against llama.cpp's reference quantizer: golden bytes made by tests/golden/make_golden.py
from `ggml_quantize_chunk` (no importance matrix), on edge-case, random and real-model blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants import dequantize, quantize
from juno_py.gguf.quants.kquant_quantize import nearest_int
from juno_py.testing.ggml_reference import KQUANT_TYPES
from tests.golden.make_golden import array_digest, kquant_random_blocks, kquant_random_set

DATA = Path(__file__).resolve().parents[1] / "golden" / "data"
SETS = ("edge", "random", "real")
# fraction of blocks that must be byte-identical to llama.cpp (DESIGN.md §6)
REQUIRED = {"edge": 1.0, "random": 0.999, "real": 0.999}
# RMSE of quantize -> dequantize on the 256 "normal_1" blocks (sigma 1), measured once and rounded up by ~2 %:
# 0.28675, 0.14521, 0.06862, 0.03474, 0.01695
RMSE_BOUND = {"Q2_K": 0.293, "Q3_K": 0.148, "Q4_K": 0.070, "Q5_K": 0.0355, "Q6_K": 0.0173}


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    data = np.load(DATA / "kquants_inputs.npz")
    random = kquant_random_set()
    assert array_digest(random) == str(data["random_sha256"]), (
        "the regenerated random blocks differ from those the golden bytes were made from"
    )
    return {"edge": data["edge"], "random": random, "real": data["real"], "edge_names": data["edge_names"]}


@pytest.fixture(scope="module")
def encoded(inputs) -> dict[str, dict[str, np.ndarray]]:
    """Ours for every type and set, from one call per type over all sets (so the encoders' chunking is crossed)."""
    sizes = [len(inputs[s]) for s in SETS]
    everything = torch.from_numpy(np.concatenate([inputs[s] for s in SETS]))
    out = {}
    for name in KQUANT_TYPES:
        parts = np.split(quantize(GGMLType[name], everything), np.cumsum(sizes)[:-1])
        out[name] = dict(zip(SETS, parts))
    return out


@pytest.mark.parametrize("set_name", SETS)
@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
def test_kquant_quantize_matches_llama_cpp(type_name, set_name, inputs, encoded, record_property):
    expected = np.load(DATA / f"kquants_{type_name}.npz")[set_name]
    ours = encoded[type_name][set_name]
    assert ours.shape == expected.shape
    same = (ours == expected).all(1)
    record_property("identical_fraction", float(same.mean()))
    print(f"{type_name} {set_name}: {same.mean():.4%} of {len(same)} blocks byte-identical to llama.cpp")
    where = inputs["edge_names"][~same].tolist() if set_name == "edge" else np.nonzero(~same)[0][:10].tolist()
    assert same.mean() >= REQUIRED[set_name], (
        f"{type_name} {set_name}: only {same.mean():.4%} of blocks identical; first differing: {where}"
    )


@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
def test_kquant_round_trip_rmse(type_name):
    x = kquant_random_blocks("normal_1", 256)
    ggml_type = GGMLType[type_name]
    back = dequantize(ggml_type, quantize(ggml_type, torch.from_numpy(x)), 256).numpy()
    rmse = float(np.sqrt(np.mean((back - x) ** 2)))
    print(f"{type_name}: round-trip RMSE {rmse:.5f} (sigma 1)")
    assert rmse <= RMSE_BOUND[type_name]


@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
def test_kquant_quantize_rows_match_blocks(type_name):
    """A [rows, n_cols] matrix encodes block by block, in row-major order."""
    x = kquant_random_blocks("heavy", 12)
    ggml_type = GGMLType[type_name]
    as_rows = quantize(ggml_type, torch.from_numpy(x.reshape(3, 1024)))
    as_blocks = quantize(ggml_type, torch.from_numpy(x))
    assert as_rows.shape == (3, 4 * as_blocks.shape[1])
    np.testing.assert_array_equal(as_rows.reshape(as_blocks.shape), as_blocks)


def test_nearest_int_is_the_magic_number_trick():
    """Round half to even inside ±2^22, and C's bit pattern outside it."""
    v = np.array(
        [0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998, 4194303.0, -4194303.0, 5e6, -3e7, 1e20, 0.0, -0.0], dtype=np.float32
    )
    bits = (v + np.float32(12582912.0)).view(np.int32)
    expected = (bits & 0x7FFFFF) - 0x400000
    ours = nearest_int(torch.from_numpy(v)).numpy()
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(ours[:7], [0, 2, 2, 0, -2, 2, 4194303])
