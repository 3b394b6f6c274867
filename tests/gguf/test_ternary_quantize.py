"""TQ1_0, TQ2_0 and MXFP4 encoders against the `gguf` package's quantizers (which give llama.cpp's
`quantize_row_*_ref` bytes), on the edge-case, random and real-model blocks of the k-quant golden set and on
values at and next to every power of two (MXFP4's scale is one)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants import dequantize, quantizable_types, quantize
from tests.golden.make_golden import iq4_inputs

TYPES = {GGMLType.TQ1_0: 256, GGMLType.TQ2_0: 256, GGMLType.MXFP4: 32}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's float16 scale of tiny and huge blocks


def power_of_two_blocks() -> np.ndarray:
    """[n, 256]: a block whose largest magnitude is 2^k or a neighbouring float, every k of float32, the other
    values spread evenly below it."""
    p2 = np.ldexp(1.0, np.arange(-149, 128)).astype(np.float32)
    top = np.concatenate([p2, np.nextafter(p2, np.float32(0)), np.nextafter(p2, np.float32(np.inf))])
    top = top[np.isfinite(top) & (top > 0)]
    out = top[:, None] * np.linspace(-1, 1, 256, dtype=np.float32)
    out[:, 0] = top
    return out.astype(np.float32)


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    sets = iq4_inputs()
    sets["powers_of_two"] = power_of_two_blocks()
    return sets


def test_ternary_and_mxfp4_are_encodable():
    assert {"TQ1_0", "TQ2_0", "MXFP4"} <= set(quantizable_types())


@pytest.mark.parametrize("set_name", ["edge", "random", "real", "powers_of_two"])
@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
def test_quantize_matches_the_gguf_package(ggml_type, set_name, inputs):
    x = np.ascontiguousarray(inputs[set_name].reshape(-1, TYPES[ggml_type]))
    ours = quantize(ggml_type, torch.from_numpy(x))
    theirs = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(ggml_type)))).view(np.uint8)
    theirs = theirs.reshape(ours.shape)
    same = (ours == theirs).all(1)
    assert same.all(), f"{ggml_type.name} {set_name}: blocks {np.nonzero(~same)[0][:10].tolist()} differ"


@pytest.mark.parametrize("ggml_type", list(TYPES), ids=lambda t: t.name)
def test_round_trip_keeps_the_levels(ggml_type):
    """Values already on the type's grid come back unchanged (the scale of the block maximum, every level)."""
    if ggml_type == GGMLType.MXFP4:
        levels = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32) * 0.125
        x = np.tile(levels, (4, 2))  # scale 2^-4 (halved), largest 1.5
    else:
        x = np.tile(np.array([-1.0, 0.0, 1.0], dtype=np.float32) * 0.5, (4, 86))[:, :256]
    x = np.ascontiguousarray(x)
    back = dequantize(ggml_type, quantize(ggml_type, torch.from_numpy(x)), x.shape[1]).numpy()
    np.testing.assert_array_equal(back, x)
