"""K-quant quantization speed: juno-py's encoders against llama.cpp's reference quantizer
(`ggml_quantize_chunk` without an importance matrix, single-threaded C) in the same run.

    python benchmarks/kquant_quantize.py [--blocks 4096] [--repeat 5] [--threads N]

Prints a markdown table in M elements/s per type and the ratio juno-py / llama.cpp. The llama.cpp column needs
llama-cpp-python installed (see tests/golden/README.md) and is left empty without it. Each figure is the best
of `--repeat` alternating runs, which keeps a noisy, shared machine from favouring either side; the outputs of
the two are compared too.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.golden.make_golden import KQUANT_TYPES, ggml_quantize, load_ggml  # noqa: E402


def timed(run, timings: list[float]) -> None:
    start = time.perf_counter()
    run()
    timings.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4096, help="256-value blocks per run (default 4096: 1 M values)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lib = load_ggml()
    except (ImportError, SystemExit):
        lib = None

    x = (np.random.default_rng(0).standard_normal((args.blocks, 256)) * 0.02).astype(np.float32)
    x_torch = torch.from_numpy(x)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads, {args.blocks} blocks of 256 values, best of {args.repeat}\n")
    print("| type | juno-py M elements/s | llama.cpp M elements/s | juno-py / llama.cpp | identical blocks |")
    print("|---|---:|---:|---:|---:|")
    for name in KQUANT_TYPES:
        ggml_type = GGMLType[name]
        quantize(ggml_type, x_torch[:64])  # warm-up
        ours_t: list[float] = []
        ref_t: list[float] = []
        for _ in range(args.repeat):
            timed(lambda: quantize(ggml_type, x_torch), ours_t)
            if lib is not None:
                timed(lambda: ggml_quantize(lib, int(ggml_type), x), ref_t)
        ours = x.size / min(ours_t) / 1e6
        if lib is None:
            print(f"| {name} | {ours:.2f} | | | |")
            continue
        ref = x.size / min(ref_t) / 1e6
        same = (quantize(ggml_type, x_torch) == ggml_quantize(lib, int(ggml_type), x)).all(1).mean()
        print(f"| {name} | {ours:.2f} | {ref:.2f} | {ours / ref:.2f} | {same:.4%} |")


if __name__ == "__main__":
    main()
