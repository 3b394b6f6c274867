"""IQ4_NL and IQ4_XS encoders against llama.cpp's quantizer without an importance matrix: golden bytes made by
tests/golden/make_golden.py (`--only iq4`) from `ggml_quantize_chunk`, on the edge-case, random and real-model
blocks of the k-quant set."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants import dequantize, quantizable_types, quantize
from juno_py.gguf.quants.iq4_quantize import best_index
from juno_py.gguf.quants.iquants import IQ4_LEVELS
from juno_py.testing.ggml_reference import IQ4_TYPES
from tests.golden.make_golden import iq4_inputs, kquant_random_blocks

DATA = Path(__file__).resolve().parents[1] / "golden" / "data"
SETS = ("edge", "random", "real")
REQUIRED = {"edge": 1.0, "random": 0.999, "real": 0.999}
BLOCK = {"IQ4_NL": 32, "IQ4_XS": 256}
# RMSE of quantize -> dequantize on the 256 "normal_1" blocks (sigma 1), measured once (0.07370, 0.07423) and
# rounded up by ~2 %
RMSE_BOUND = {"IQ4_NL": 0.0752, "IQ4_XS": 0.0757}


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    return iq4_inputs()


@pytest.fixture(scope="module")
def encoded(inputs) -> dict[str, dict[str, np.ndarray]]:
    """Ours for every type and set, from one call per type over all sets (so the encoders' chunking is crossed)."""
    out = {}
    for name in IQ4_TYPES:
        parts = [inputs[s].reshape(-1, BLOCK[name]) for s in SETS]
        everything = torch.from_numpy(np.concatenate(parts))
        split = np.split(quantize(GGMLType[name], everything), np.cumsum([len(p) for p in parts])[:-1])
        out[name] = dict(zip(SETS, split))
    return out


def test_iq4_types_are_encodable():
    assert {"IQ4_NL", "IQ4_XS"} <= set(quantizable_types())


@pytest.mark.parametrize("set_name", SETS)
@pytest.mark.parametrize("type_name", list(IQ4_TYPES))
def test_iq4_quantize_matches_llama_cpp(type_name, set_name, encoded, record_property):
    expected = np.load(DATA / f"iq4_{type_name}.npz")[set_name]
    ours = encoded[type_name][set_name]
    assert ours.shape == expected.shape
    same = (ours == expected).all(1)
    record_property("identical_fraction", float(same.mean()))
    print(f"{type_name} {set_name}: {same.mean():.4%} of {len(same)} blocks byte-identical to llama.cpp")
    assert same.mean() >= REQUIRED[set_name], (
        f"{type_name} {set_name}: only {same.mean():.4%} of blocks identical; first differing: "
        f"{np.nonzero(~same)[0][:10].tolist()}"
    )


@pytest.mark.parametrize("type_name", list(IQ4_TYPES))
def test_iq4_golden_bytes_decode_like_the_gguf_package(type_name, inputs):
    """The golden bytes and ours decode to the same values through juno-py and the gguf package."""
    expected = np.load(DATA / f"iq4_{type_name}.npz")["real"]
    ggml_type = GGMLType[type_name]
    ours = dequantize(ggml_type, expected, BLOCK[type_name]).numpy()
    theirs = gguf.quants.dequantize(expected, gguf.GGMLQuantizationType(int(ggml_type)))
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))


@pytest.mark.parametrize("type_name", list(IQ4_TYPES))
def test_iq4_round_trip_rmse(type_name):
    x = kquant_random_blocks("normal_1", 256)
    ggml_type = GGMLType[type_name]
    back = dequantize(ggml_type, quantize(ggml_type, torch.from_numpy(x)), 256).numpy()
    rmse = float(np.sqrt(np.mean((back - x) ** 2)))
    print(f"{type_name}: round-trip RMSE {rmse:.5f} (sigma 1)")
    assert rmse <= RMSE_BOUND[type_name]


@pytest.mark.parametrize("type_name", list(IQ4_TYPES))
def test_iq4_quantize_rows_match_blocks(type_name):
    """A [rows, n_cols] matrix encodes block by block, in row-major order."""
    x = kquant_random_blocks("heavy", 12)
    ggml_type = GGMLType[type_name]
    as_rows = quantize(ggml_type, torch.from_numpy(x.reshape(3, 1024)))
    as_blocks = quantize(ggml_type, torch.from_numpy(x.reshape(-1, BLOCK[type_name])))
    np.testing.assert_array_equal(as_rows.reshape(as_blocks.shape), as_blocks)


def test_iq4_zero_blocks():
    """All-zero input: scale 0 and every value at level 8 (the level nearest 0); IQ4_XS writes the super-block
    scale as -0 (−max/32 of a zero maximum) and every 6-bit scale as code 32 (0)."""
    nl = quantize(GGMLType.IQ4_NL, torch.zeros(1, 32))[0]
    assert nl.tolist() == [0, 0] + [0x88] * 16
    xs = quantize(GGMLType.IQ4_XS, torch.zeros(1, 256))[0]
    assert xs[:2].tolist() == [0x00, 0x80]
    assert xs[2:4].tolist() == [0xAA, 0xAA] and xs[4:8].tolist() == [0] * 4
    assert (xs[8:] == 0x88).all()


def test_best_index_is_the_nearest_level_ties_up():
    levels = IQ4_LEVELS.double()
    mids = ((levels[:-1] + levels[1:]) / 2).float()
    v = torch.cat(
        [
            torch.linspace(-140, 140, 20001),
            mids,
            torch.nextafter(mids, torch.full_like(mids, -1e9)),
            torch.nextafter(mids, torch.full_like(mids, 1e9)),
            torch.tensor([-1e6, 1e6, -0.0, 0.0]),
        ]
    )
    dist = (v.double()[:, None] - levels[None, :]).abs()
    nearest = dist.min(1, keepdim=True).values
    expected = torch.where(dist == nearest, torch.arange(16), -1).amax(1)  # the upper one on a tie
    assert torch.equal(best_index(v), expected)
    assert best_index(torch.tensor([-1e30, 1e30, float("-inf"), float("inf"), float("nan")])).tolist() == [
        0,
        15,
        0,
        15,
        15,
    ]
