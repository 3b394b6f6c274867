"""GPU decode bandwidth and the frozen linear's forward at few tokens, in one run.

1. Decode: `dequantize_tile` of a whole W (random valid blocks made on the GPU) into bf16, per type and shape,
   against a device copy timed in the same run. Bandwidth = bytes moved (quantized bytes read + bf16 written)
   / time; "of copy" divides it by the copy's bandwidth (`out.copy_(src)`, bf16 `[n_out, n_in]` both ways, and a
   1 GiB uint8 clone). Also the transposed tile the backward decodes (all rows, 4096 columns) and fp32 output.
2. Forward `x·Wᵀ` at 1 to 64 tokens: the fused dequantize-matvec, decode-then-cuBLAS tiles, and a resident bf16
   copy (cuBLAS alone): where the matvec stops paying (MATVEC_MAX_TOKENS).

Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed between runs).

    python -m benchmarks.dequant_gpu --json dequant_gpu.json      # needs a CUDA GPU; results/gpu-decode.json
    python -m benchmarks.dequant_gpu --sweep                      # also try other blocks-per-program / warps
    TRITON_INTERPRET=1 python -m benchmarks.dequant_gpu --smoke --out /tmp/d.json   # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks import harness
from juno_py.gguf import GGMLType
from juno_py.kernels import dequant
from juno_py.kernels.dequant import dequant_matvec, dequantize_reference, dequantize_tile
from juno_py.testing.synthetic import random_blocks
from juno_py.weights import FrozenQuantLinear

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = [(8192, 8192), (28672, 8192)]
DEV = "cuda"  # "cpu" with --smoke


def bench(fn, rep: int = 100) -> float:
    """Median milliseconds (triton.testing.do_bench: CUDA events, L2 flushed between runs)."""
    if DEV == "cpu":  # --smoke: the numbers mean nothing
        return statistics.median(harness.cpu_times(fn, 2)) * 1e3
    return harness.do_bench_ms(fn, rep=rep, warmup=10)


def copy_bandwidth(n_out: int, n_in: int) -> float:
    """GB/s of a bf16 `[n_out, n_in]` device copy (read + write)."""
    src = torch.randn(n_out, n_in, device=DEV).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 4 * src.numel() / ms / 1e6


def spot_check(raw: torch.Tensor, t: GGMLType, n_in: int, out: torch.Tensor) -> bool:
    """The decoded rows 0..7 and the last 8 equal the torch codec's (bf16 bit patterns; NaN positions)."""
    for a, b in ((0, 8), (raw.shape[0] - 8, raw.shape[0])):
        ref = dequantize_reference(raw[a:b], t, n_in, torch.bfloat16)
        got = out[a:b].cpu()
        nan = torch.isnan(ref)
        if not (
            torch.equal(torch.isnan(got), nan) and torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
        ):
            return False
    return True


DECODE_COLUMNS = [
    "type",
    "W",
    "config (blocks, warps)",
    "decode bf16 ms",
    "GB/s",
    "of bf16 copy",
    "of 1 GiB clone",
    "columns 0:4096 ms (of copy)",
    "fp32 out ms (of copy)",
    "spot check",
]
MATVEC_COLUMNS = ["type", "W", "tokens", "fused matvec ms", "decode + cuBLAS ms", "bf16 cache (cuBLAS) ms"]


def emit(table: list, cells: list) -> None:
    table.append(cells)
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def decode_table(types, shapes, gen, sweep: bool, table: list) -> list[dict]:
    big = torch.empty(1 << (30 if DEV == "cuda" else 16), dtype=torch.uint8, device=DEV)
    clone_gbs = 2 * big.numel() / bench(lambda: big.clone()) / 1e6
    big = None  # freed
    print(f"1 GiB uint8 clone: {clone_gbs:.0f} GB/s (read + write)\n")
    print(harness.markdown_table(DECODE_COLUMNS, []))
    rows = []
    for n_out, n_in in shapes:
        copy_gbs = copy_bandwidth(n_out, n_in)
        emit(
            table,
            [
                "copy",
                f"{n_out}x{n_in} bf16",
                "-",
                f"{4 * n_out * n_in / copy_gbs / 1e6:.3f}",
                f"{copy_gbs:.0f}",
                "100%",
                f"{copy_gbs / clone_gbs:.0%}",
                "",
                "",
                "",
            ],
        )
        for name in types:
            t = GGMLType[name]
            raw = random_blocks(t, n_out, n_in, gen, device=DEV).view(n_out, -1)
            out = torch.empty(n_out, n_in, dtype=torch.bfloat16, device=DEV)
            configs = [dequant.KERNEL_CONFIG[t]]
            if sweep:
                nb0, w0, bn, kb = configs[0]
                configs += [
                    (nb, w, bn, kb)
                    for nb, w in ((nb0 // 4, 2), (nb0 // 2, 4), (nb0 * 2, 4), (nb0 * 2, 8), (nb0 * 4, 8))
                ]
            default = dequant.KERNEL_CONFIG[t]
            for cfg in configs:
                dequant.KERNEL_CONFIG[t] = cfg
                ms = bench(lambda: dequantize_tile(raw, t, n_in, out=out), rep=100 if cfg == default else 40)
                moved = raw.numel() + 2 * out.numel()
                row = dict(
                    type=name,
                    n_out=n_out,
                    n_in=n_in,
                    blocks=cfg[0],
                    warps=cfg[1],
                    ms=ms,
                    gbs=moved / ms / 1e6,
                    of_copy=moved / ms / 1e6 / copy_gbs,
                    of_clone=moved / ms / 1e6 / clone_gbs,
                    copy_gbs=copy_gbs,
                    clone_gbs=clone_gbs,
                )
                if cfg == default:
                    ok = spot_check(raw, t, n_in, out)
                    nc = min(4096, n_in)
                    cols = out[:, :nc]
                    ms_c = bench(lambda: dequantize_tile(raw, t, n_in, cols=(0, nc), out=cols))
                    moved_c = raw.numel() * nc // n_in + 2 * n_out * nc
                    out32 = torch.empty(n_out, n_in, dtype=torch.float32, device=DEV)
                    ms_f = bench(lambda: dequantize_tile(raw, t, n_in, dtype=torch.float32, out=out32))
                    moved_f = raw.numel() + 4 * out32.numel()
                    out32 = None  # freed
                    row.update(
                        spot_check=ok,
                        cols_ms=ms_c,
                        cols_of_copy=moved_c / ms_c / 1e6 / copy_gbs,
                        fp32_ms=ms_f,
                        fp32_of_copy=moved_f / ms_f / 1e6 / copy_gbs,
                    )
                    extra = [
                        f"{ms_c:.3f} ({row['cols_of_copy']:.0%})",
                        f"{ms_f:.3f} ({row['fp32_of_copy']:.0%})",
                        "bit-exact" if ok else "MISMATCH",
                    ]
                else:
                    extra = ["", "", ""]
                emit(
                    table,
                    [
                        name,
                        f"{n_out}x{n_in}",
                        f"{cfg[0]}, {cfg[1]}",
                        f"{ms:.3f}",
                        f"{row['gbs']:.0f}",
                        f"{row['of_copy']:.0%}",
                        f"{row['of_clone']:.0%}",
                        *extra,
                    ],
                )
                rows.append(row)
            dequant.KERNEL_CONFIG[t] = default
            raw = out = None  # freed
    return rows


def matvec_table(types, gen, table: list) -> list[dict]:
    print("\n" + harness.markdown_table(MATVEC_COLUMNS, []))
    rows = []
    for name in types:
        t = GGMLType[name]
        for n_out, n_in in [(4096, 4096), (14336, 4096)] if DEV == "cuda" else [(40, 512)]:
            raw = random_blocks(t, n_out, n_in, gen, device=DEV).view(n_out, -1)
            lin = FrozenQuantLinear(raw, t, n_in, compute_dtype=torch.bfloat16)
            cached = FrozenQuantLinear(raw, t, n_in, compute_dtype=torch.bfloat16).set_weights_cache("bf16")
            for tokens in (1, 2, 4, 8, 16, 64):
                x = torch.randn(tokens, n_in, device=DEV, dtype=torch.bfloat16)
                mv = bench(lambda: dequant_matvec(raw, t, n_in, x), rep=50)
                step = lin._device_step(n_in, 2)

                def tiles():
                    for a in range(0, n_out, step):
                        w = lin.dequantize_rows(a, min(a + step, n_out), torch.bfloat16)
                        torch.mm(x, w.t())

                tiles_ms = bench(tiles, rep=50)
                cache_ms = bench(lambda: cached(x), rep=50)
                emit(table, [name, f"{n_out}x{n_in}", tokens, f"{mv:.3f}", f"{tiles_ms:.3f}", f"{cache_ms:.3f}"])
                rows.append(
                    dict(
                        type=name,
                        n_out=n_out,
                        n_in=n_in,
                        tokens=tokens,
                        matvec_ms=mv,
                        tiles_ms=tiles_ms,
                        cache_ms=cache_ms,
                    )
                )
            raw = lin = cached = None  # freed
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--shapes", nargs="*", default=[f"{a}x{b}" for a, b in SHAPES])
    ap.add_argument("--sweep", action="store_true", help="also time other (blocks a program, warps) settings")
    ap.add_argument("--matvec-types", nargs="*", default=["Q4_K", "Q8_0"])
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): a script test")
    harness.add_output_args(ap)
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = "cpu"
        args.shapes = ["40x512"]
    elif not torch.cuda.is_available():
        raise SystemExit("dequant_gpu.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(DEV).manual_seed(0)
    env = harness.environment(DEV)
    print(env["hardware"], env["software"], "\n")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    decode_rows, matvec_rows = [], []
    result = dict(
        hardware=env["hardware"],
        software=env["software"],
        decode=decode_table(args.types, shapes, gen, args.sweep, decode_rows),
    )
    if args.matvec_types:
        result["matvec"] = matvec_table(args.matvec_types, gen, matvec_rows)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    command = harness.command_line("benchmarks.dequant_gpu")
    harness.write_results(
        args,
        harness.results(
            "gpu-decode",
            "Decoding quantized weights on one GPU",
            command,
            DECODE_COLUMNS,
            decode_rows,
            [
                "Medians of triton.testing.do_bench (CUDA events, L2 flushed between runs); bandwidth = quantized bytes "
                'read + bf16 written over the time; "of copy": over a bf16 device copy of the same shape.'
            ],
            env=env,
        ),
    )
    if matvec_rows:
        harness.write_results(
            args,
            harness.results(
                "gpu-matvec",
                "The frozen linear's forward at few tokens on one GPU",
                command,
                MATVEC_COLUMNS,
                matvec_rows,
                ["Medians of triton.testing.do_bench; bf16 activations."],
                env=env,
            ),
            part="matvec",
        )


if __name__ == "__main__":
    main()
