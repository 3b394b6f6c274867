"""K-quant quantization speed: juno-py's encoders against llama.cpp's reference quantizer
(`ggml_quantize_chunk` without an importance matrix, single-threaded C) in the same run.

    python -m benchmarks.kquant_quantize [--blocks 4096] [--repeat 5] [--threads N]

Prints a markdown table in M elements/s per type and the ratio juno-py / llama.cpp, and writes
benchmarks/results/kquant-quantize.json. The llama.cpp column needs llama-cpp-python installed (see
tests/golden/README.md; `juno_py.testing.ggml_reference`) and is left empty without it. Each figure is the best
of `--repeat` alternating runs, which keeps a noisy, shared machine from favouring either side; the outputs of
the two are compared too.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks import harness
from juno_py.gguf.constants import GGMLType
from juno_py.gguf.quants import quantize
from juno_py.testing.ggml_reference import KQUANT_TYPES, ggml_quantize, load_ggml

COLUMNS = ["type", "juno-py M elements/s", "llama.cpp M elements/s", "juno-py / llama.cpp", "identical blocks"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4096, help="256-value blocks per run (default 4096: 1 M values)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    harness.add_output_args(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lib = load_ggml()
    except (ImportError, SystemExit):
        lib = None

    x = (np.random.default_rng(0).standard_normal((args.blocks, 256)) * 0.02).astype(np.float32)
    x_torch = torch.from_numpy(x)
    note = (
        f"{torch.get_num_threads()} torch threads, {args.blocks} blocks of N(0, 0.02²) values, best of "
        f"{args.repeat} alternating runs."
    )
    print(note + "\n")
    print(harness.markdown_table(COLUMNS, []))
    table = []
    for name in KQUANT_TYPES:
        ggml_type = GGMLType[name]
        quantize(ggml_type, x_torch[:64])  # warm-up
        runs = {"juno": lambda: quantize(ggml_type, x_torch)}
        if lib is not None:
            runs["llama.cpp"] = lambda: ggml_quantize(lib, int(ggml_type), x)
        best = harness.best_interleaved(runs, args.repeat)
        ours = x.size / best["juno"] / 1e6
        if lib is None:
            table.append([name, f"{ours:.2f}", "", "", ""])
        else:
            ref = x.size / best["llama.cpp"] / 1e6
            same = (quantize(ggml_type, x_torch) == ggml_quantize(lib, int(ggml_type), x)).all(1).mean()
            table.append([name, f"{ours:.2f}", f"{ref:.2f}", f"{ours / ref:.2f}", f"{same:.4%}"])
        print("| " + " | ".join(table[-1]) + " |", flush=True)
    harness.write_results(
        args,
        harness.results(
            "kquant-quantize",
            "K-quant encoding on CPU against llama.cpp",
            harness.command_line("benchmarks.kquant_quantize"),
            COLUMNS,
            table,
            [note],
        ),
    )


if __name__ == "__main__":
    main()
