"""Every tensor of the real models decodes bit for bit as the `gguf` package decodes it."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from juno_py.gguf import quants

pytestmark = pytest.mark.slow

# rows decoded per step, so the float32 copies of the largest tensor (Gemma's 262144-row embedding) stay small
ROWS_PER_STEP = 8192

MODELS = {
    "smollm2-135m": ("JUNO_PY_TEST_SMOLLM2", "/tmp/models/smollm2-135m.gguf"),
    "gemma3-270m": ("JUNO_PY_TEST_GEMMA3", "/tmp/models/gemma3-270m.gguf"),
}


def model_file(name: str) -> Path:
    variable, default = MODELS[name]
    path = Path(os.environ.get(variable) or default)
    if not path.is_file():
        pytest.skip(f"{name} GGUF not found at {path} (set {variable} to its path)")
    return path


@pytest.fixture
def one_torch_thread():
    """Decoding is elementwise, so the thread count cannot change a result; one thread keeps this test's time
    bounded on a busy 2-core machine, where torch's two threads wait on each other at every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_tensor_dequantizes_like_gguf(name, one_torch_thread):
    reader = gguf.GGUFReader(model_file(name))
    types_seen = set()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        n_cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        raw = tensor.data.view(np.uint8)
        raw = raw.reshape(-1, raw.shape[-1] if raw.ndim > 1 else raw.size)
        for start in range(0, raw.shape[0], ROWS_PER_STEP):
            rows = raw[start : start + ROWS_PER_STEP]
            expected = gguf.quants.dequantize(rows, qtype).reshape(rows.shape[0], n_cols)
            actual = quants.dequantize(int(qtype), rows, n_cols, what=tensor.name).numpy()
            if not np.array_equal(expected.view(np.uint32), actual.view(np.uint32)):
                bad = int(np.count_nonzero(expected.view(np.uint32) != actual.view(np.uint32)))
                pytest.fail(f"{name}: tensor {tensor.name} ({qtype.name}), rows {start}+: {bad} values differ")
        types_seen.add(qtype.name)
    assert len(types_seen) >= 2, types_seen
