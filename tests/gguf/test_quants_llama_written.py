"""Blocks written by llama.cpp's own quantizer (no importance matrix: IQ3_XXS, IQ3_S, IQ1_M, TQ1_0, TQ2_0, MXFP4;
golden set `newtypes`, tests/golden/README.md) decode bit for bit as the `gguf` package decodes them, in the native
decoder and the torch codecs; and where juno-py has an encoder (TQ1_0, TQ2_0, MXFP4) it writes the same bytes
from the same values."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from juno_py.gguf import quants
from juno_py.gguf.constants import GGMLType
from juno_py.testing.ggml_reference import WRITABLE_NEW_TYPES
from tests.golden.make_golden import iq4_inputs

DATA = Path(__file__).resolve().parents[1] / "golden" / "data"
ENCODED = ("TQ1_0", "TQ2_0", "MXFP4")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's float16 scales of the edge blocks


def golden(name: str) -> dict[str, np.ndarray]:
    data = np.load(DATA / f"newtypes_{name}.npz")
    return {s: data[s] for s in data.files}


def reference(name: str, raw: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    return np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("name", list(WRITABLE_NEW_TYPES))
def test_llama_cpp_blocks_decode_as_gguf_decodes_them(name, backend, monkeypatch):
    monkeypatch.setenv("JUNO_PY_NATIVE", "0" if backend == "torch" else "1")
    for set_name, raw in golden(name).items():
        want = reference(name, raw)
        got = quants.dequantize(int(GGMLType[name]), raw, 256).numpy()
        assert got.shape == want.shape, set_name
        same_nan = np.isnan(got) == np.isnan(want)
        assert same_nan.all(), f"{name} {set_name}: NaN where gguf has none, or none where it has one"
        finite = ~np.isnan(want)
        differ = np.flatnonzero(got.view(np.int32)[finite] != want.view(np.int32)[finite])
        assert differ.size == 0, f"{name} {set_name}: {differ.size} of {finite.sum()} values differ"
        assert np.abs(want[np.isfinite(want)]).max() > 0


@pytest.mark.parametrize("name", ENCODED)
def test_encoders_write_llama_cpps_bytes(name):
    inputs = iq4_inputs()
    for set_name, expected in golden(name).items():
        ours = quants.quantize(int(GGMLType[name]), torch.from_numpy(inputs[set_name]))
        assert ours.shape == expected.shape
        same = (ours == expected).all(1)
        assert same.all(), f"{name} {set_name}: {(~same).sum()} of {len(same)} rows differ from llama.cpp's"
