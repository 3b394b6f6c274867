"""Throughput of the quant codecs against the `gguf` package, both measured in the same run.

    python -m benchmarks.codecs [--types q4_0,q4_k,...] [--rows 1024] [--cols 4096] [--repeat 7] [--threads N]
                              [--clock wall|thread]

Prints a markdown table and writes benchmarks/results/codecs.json: decode and encode speed per type in MB/s of
quantized data and M elements/s, for
juno-py and for gguf, and their ratio. juno-py's decode is `quants.dequantize`: the native decoder for the block
types it covers (where it is built; `JUNO_PY_NATIVE=0` measures without it), the torch codecs otherwise; the
torch codecs' own decode speed is shown beside it. Each figure is the best of `--repeat` alternating runs, which keeps a
noisy, shared machine from favouring either side. gguf runs on one core; torch uses its default thread count
unless `--threads` says otherwise (on a machine busy with other work, torch's threads wait on each other at
every step, so compare on an idle machine, or with `--threads 1`).
"""

from __future__ import annotations

import argparse
import time
import warnings

import gguf
import numpy as np
import torch

from benchmarks import harness
from juno_py.gguf import quants
from juno_py.gguf.constants import GGML_BLOCK_SIZES, GGMLType, parse_type_name
from juno_py.gguf.quants import native
from juno_py.gguf.quants.simple import F16_SCALE_OFFSETS

DEFAULT_TYPES = (
    "f16,bf16,q4_0,q4_1,q5_0,q5_1,q8_0,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_nl,iq4_xs,"
    "iq1_s,iq1_m,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s,tq1_0,tq2_0,mxfp4"
)
# byte offsets of the float16 scale of the codebook types, which gguf cannot encode (IQ1_M keeps its scale in the
# top nibbles of the four uint16s at byte 48)
CODEBOOK_SCALES = {
    GGMLType.IQ1_S: (0,),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.IQ2_XS: (0,),
    GGMLType.IQ2_S: (0,),
    GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,),
}


def sample_rows(ggml_type: GGMLType, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Float rows and their encoding: gguf's encoder where it has one (TQ1_0, TQ2_0 and MXFP4 too), else random
    codes under small scales."""
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    gtype = gguf.GGMLQuantizationType(int(ggml_type))
    if has_gguf_encoder(gtype):
        raw = np.ascontiguousarray(gguf.quants.quantize(x, gtype)).view(np.uint8).reshape(rows, -1)
    else:
        block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
        raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
        blocks = raw.reshape(-1, type_size)
        scales = rng.uniform(1e-4, 1e-3, blocks.shape[0]).astype(np.float16)
        for offset in F16_SCALE_OFFSETS.get(ggml_type, CODEBOOK_SCALES.get(ggml_type, ())):
            blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        if ggml_type == GGMLType.IQ1_M:
            words = blocks[:, 48:56].copy().view("<u2")
            bits = scales.view(np.uint16)
            for i in range(4):
                words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
            blocks[:, 48:56] = words.view(np.uint8)
    return x, raw


def has_gguf_encoder(gtype: gguf.GGMLQuantizationType) -> bool:
    """Encoders are compared only where gguf has one (it has none for k-quants and i-quants)."""
    try:
        gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), gtype)
        return True
    except NotImplementedError:
        return False


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
clock = time.perf_counter


def best_times(runs: dict[str, callable], repeat: int) -> dict[str, float]:
    return harness.best_interleaved(runs, repeat, clock)


def measure(ggml_type: GGMLType, rows: int, cols: int, repeat: int, rng: np.random.Generator) -> dict:
    x, raw = sample_rows(ggml_type, rows, cols, rng)
    gtype = gguf.GGMLQuantizationType(int(ggml_type))
    x_torch = torch.from_numpy(x)
    result = {"type": ggml_type.name, "bytes": raw.nbytes, "elements": x.size}
    codec = quants.get_codec(ggml_type)
    blocks = torch.from_numpy(raw).view(-1, codec.type_size)
    decode = best_times(
        {
            "juno": lambda: quants.dequantize(int(ggml_type), raw, cols),
            "torch": lambda: codec.dequantize_blocks(blocks),
            "gguf": lambda: gguf.quants.dequantize(raw, gtype),
        },
        repeat,
    )
    result["decode"] = decode
    if ggml_type.name in quants.quantizable_types() and has_gguf_encoder(gtype):
        result["encode"] = best_times(
            {"juno": lambda: quants.quantize(int(ggml_type), x_torch), "gguf": lambda: gguf.quants.quantize(x, gtype)},
            repeat,
        )
    return result


def _cells(times: dict[str, float] | None, n_bytes: int, n_elements: int, torch_column: bool = False) -> list[str]:
    if times is None:
        return ["", "", "", ""]
    juno, ref = times["juno"], times.get("gguf")
    cells = [f"{n_bytes / juno / 1e6:,.0f}", f"{n_elements / juno / 1e6:,.0f}"]
    if torch_column:
        cells.append(f"{n_elements / times['torch'] / 1e6:,.0f}")
    if ref is None:
        return cells + ["", ""]
    return cells + [f"{n_elements / ref / 1e6:,.0f}", f"**{ref / juno:.2f}×**"]


COLUMNS = [
    "type",
    "decode MB/s",
    "decode M el/s",
    "torch codecs M el/s",
    "gguf M el/s",
    "ratio",
    "encode MB/s",
    "encode M el/s",
    "gguf M el/s",
    "ratio",
]


def table_rows(results: list[dict]) -> list[list[str]]:
    return [
        [
            r["type"],
            *_cells(r["decode"], r["bytes"], r["elements"], torch_column=True),
            *_cells(r.get("encode"), r["bytes"], r["elements"]),
        ]
        for r in results
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated GGML type names")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096, help="row length, a multiple of 256")
    parser.add_argument("--repeat", type=int, default=7, help="runs per measurement; the best one counts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="'thread' counts CPU time of this thread only: steady on a busy machine, and exact for "
        "both sides with --threads 1",
    )
    parser.add_argument("--seed", type=int, default=0)
    harness.add_output_args(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread measures one thread: use it with --threads 1")
    global clock
    clock = CLOCKS[args.clock]

    warnings.simplefilter("ignore", RuntimeWarning)
    rng = np.random.default_rng(args.seed)
    types = [parse_type_name(name) for name in args.types.split(",") if name.strip()]
    # the first large allocations of a process fault in fresh pages: warm the allocators up before measuring
    measure(types[0], args.rows, args.cols, 2, rng)
    results = [measure(t, args.rows, args.cols, args.repeat, rng) for t in types]
    note = (
        f"{args.rows} × {args.cols} elements per type, best of {args.repeat} ({args.clock} clock); "
        f"{torch.get_num_threads()} torch threads; native decoder "
        f"{'built: ' + ', '.join(GGMLType(t).name for t in sorted(native.TYPES)) if native.library() else 'off'}."
    )
    record = harness.results(
        "codecs",
        "Quant codecs on CPU against the gguf package",
        harness.command_line("benchmarks.codecs"),
        COLUMNS,
        table_rows(results),
        [note],
    )
    print(note + "\n")
    print(harness.markdown_table(record["columns"], record["rows"]))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
