"""Bounded memory: streaming through a large quantized layer holds about one block of rows, never the weight."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from juno_py.gguf import GGMLType, GGUFWriter
from juno_py.testing.blocks import random_rows

REPO = Path(__file__).resolve().parents[2]
N = 8192  # 8192 x 8192 in Q4_0 or Q4_K: 38 MB of blocks, 256 MiB as fp32
TYPES = (GGMLType.Q4_0, GGMLType.Q4_K)
SLACK = 4 << 20  # the codecs' own temporaries (blocks of 2^18 elements), small tensors, allocator rounding


@pytest.fixture(scope="module")
def big_layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.gguf"
    with GGUFWriter(path) as w:
        w.add_field("general.architecture", "llama")
        for t in TYPES:
            w.add_tensor(f"big.{t.name}.weight", random_rows(t, N, N, seed=int(t)), t, (N, N))
    return path


def probe(path, tensor: str, scratch_bytes: int, tokens: int) -> dict:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, "-m", "tests.weights.memory_probe", str(path), tensor, str(scratch_bytes), str(tokens)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the high-water mark from /proc")
@pytest.mark.parametrize(
    "ggml_type, scratch_mib", [(GGMLType.Q4_0, 2), (GGMLType.Q4_K, 8)], ids=["Q4_0-2MiB", "Q4_K-8MiB"]
)
def test_forward_and_transpose_of_a_large_layer_stay_within_the_scratch_budget(big_layer, ggml_type, scratch_mib):
    r = probe(big_layer, f"big.{ggml_type.name}.weight", scratch_mib << 20, tokens=4)
    scratch = r["scratch_bytes"]
    assert scratch == scratch_mib << 20 and r["chunk_rows"] < N  # several blocks of rows ran
    dense = 4 * N * N
    # resident memory beyond inputs and outputs: at most two blocks' worth plus slack, far below the weight
    assert r["rss_peak_extra"] <= 2 * scratch + r["io_bytes"] + SLACK, r
    assert r["rss_peak_extra"] < dense // 8, r
    # no tensor of n_out x n_in (or larger than one fp32 block) is ever created, in forward or backward
    assert r["largest_tensor"] <= scratch, r
