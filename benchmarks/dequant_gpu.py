"""GPU decode bandwidth and the frozen linear's forward at few tokens, in one run.

1. Decode: `dequantize_tile` of a whole W (random valid blocks made on the GPU) into bf16, per type and shape,
   against a device copy timed in the same run. Bandwidth = bytes moved (quantized bytes read + bf16 written)
   / time; "of copy" divides it by the copy's bandwidth (`out.copy_(src)`, bf16 `[n_out, n_in]` both ways, and a
   1 GiB uint8 clone). Also the transposed tile the backward decodes (all rows, 4096 columns) and fp32 output.
   --sweep instead times every type of `dequant.TRITON_TYPES` in every kernel variant (`dequant.variants`) at a
   few (blocks a program, warps) settings, each against the copy of its shape, compiled first in parallel worker
   processes (Triton's disk cache), and prints the best setting per type as lines to paste into
   `juno_py/kernels/dequant.py` (also written to --best). --check decodes random valid blocks of every type in
   every variant on the GPU (whole rows, a rectangle cutting blocks, the split halves, the matvec) against the
   torch codecs.
2. Forward `x·Wᵀ` at 1 to 64 tokens: the fused dequantize-matvec, decode-then-cuBLAS tiles, and a resident bf16
   copy (cuBLAS alone): where the matvec stops paying (MATVEC_MAX_TOKENS).

Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed between runs).

    python -m benchmarks.dequant_gpu --json dequant_gpu.json      # needs a CUDA GPU; results/gpu-decode.json
    python -m benchmarks.dequant_gpu --sweep --json sweep.json --best best.py   # every type × variant × config
    python -m benchmarks.dequant_gpu --check                      # every variant bit-exact on the GPU
    TRITON_INTERPRET=1 python -m benchmarks.dequant_gpu --smoke --out /tmp/d.json   # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import harness
from juno_py.atomic import atomic_write_bytes
from juno_py.gguf import GGMLType
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.kernels import dequant
from juno_py.kernels.dequant import (
    dequant_matvec,
    dequantize_reference,
    dequantize_split_reference,
    dequantize_split_tile,
    dequantize_tile,
    matvec_reference,
)
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


def decode_table(types, shapes, gen, table: list) -> list[dict]:
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
            raw = make_raw(t, n_out, n_in, gen)
            out = torch.empty(n_out, n_in, dtype=torch.bfloat16, device=DEV)
            configs = [dequant.KERNEL_CONFIG[t]]
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
                # the resident linear's tile height on a GPU; the streaming one's block of rows on the CPU (--smoke)
                step = lin._device_step(n_in, 2) if DEV == "cuda" else lin.chunk_rows

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


# ---- --sweep and --check: every type, every variant -------------------------------------------------------------

SWEEP_COLUMNS = ["type", "W", "variant", "blocks, warps", "ms", "GB/s", "of bf16 copy", "exact"]


def all_types() -> list[str]:
    return [GGMLType(t).name for t in sorted(dequant.TRITON_TYPES)]


def sweep_configs(t: GGMLType) -> list[tuple[int, int]]:
    """(blocks a program, warps) settings the sweep times: the current one and a few around it."""
    current = tuple(dequant.KERNEL_CONFIG[t][:2])
    if GGML_BLOCK_SIZES[t][0] == 32:
        grid = [(64, 4), (128, 4), (256, 4), (256, 8), (512, 8)]
    else:
        grid = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8)]
    return sorted(set(grid) | {(current[0], current[1])})


def make_raw(t: GGMLType, n_out: int, n_in: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 `[n_out, row bytes]` on DEV: random valid blocks (float types: normal values)."""
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        dtype = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}[t]
        w = torch.randn(n_out, n_in, device=DEV, generator=gen).to(dtype)
        return w.view(torch.uint8).view(n_out, -1)
    return random_blocks(t, n_out, n_in, gen, device=DEV).view(n_out, -1)


def use(t: GGMLType, variant: int, nb: int, warps: int) -> None:
    """Make the decode of `t` launch with this variant and setting (the matvec's BN, KB kept)."""
    dequant.KERNEL_CONFIG[t] = (nb, warps, *dequant.KERNEL_CONFIG[t][2:])
    dequant.KERNEL_VARIANT[t] = variant


def _compile_worker(items: list[tuple[str, int, int, int, int]]) -> list[str]:
    """Compile (by launching once on 16 rows: the same specialization as the timed shapes) every (type, variant,
    blocks, warps, columns) of `items` into Triton's disk cache; the errors, one line each."""
    errors = []
    gen = torch.Generator(DEV).manual_seed(1)
    for name, variant, nb, warps, n_in in items:
        t = GGMLType[name]
        try:
            use(t, variant, nb, warps)
            raw = make_raw(t, 16, n_in, gen)
            out = torch.empty(16, n_in, dtype=torch.bfloat16, device=DEV)
            dequantize_tile(raw, t, n_in, out=out)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, and the setting left out of the sweep
            errors.append(f"{name} variant {variant} ({nb}, {warps}): {type(e).__name__}: {str(e).splitlines()[0]}")
    return errors


def precompile(items: list[tuple[str, int, int, int, int]], jobs: int) -> list[str]:
    """`_compile_worker` over `items` in `jobs` processes at once (compiling is most of a sweep's time otherwise)."""
    import multiprocessing

    if jobs <= 1 or DEV != "cuda":
        return _compile_worker(items)
    chunks = [items[i::jobs] for i in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return [e for part in pool.map(_compile_worker, chunks) for e in part]


def same_bits(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Bit for bit; NaN positions equal (any payload)."""
    got = got.cpu()
    nan = torch.isnan(ref)
    view = torch.int16 if ref.dtype == torch.bfloat16 else torch.int32
    return bool(
        got.shape == ref.shape
        and torch.equal(torch.isnan(got), nan)
        and torch.equal(got.view(view)[~nan], ref.view(view)[~nan])
    )


def sweep_table(
    types: list[str],
    shapes: list[tuple[int, ...]],
    gen: torch.Generator,
    jobs: int,
    rep: int,
    table: list[list[object]],
) -> tuple[list[dict[str, object]], dict[str, dict[str, object]]]:
    """Time every type × variant × setting of `sweep_configs` on every shape; (rows, best setting per type)."""
    items = [
        (name, v, nb, w, n_in)
        for name in types
        for v in dequant.variants(GGMLType[name])
        for nb, w in sweep_configs(GGMLType[name])
        for n_in in sorted({n_in for _, n_in in shapes})
    ]
    start = time.perf_counter()
    errors = precompile(items, jobs)
    print(f"compiled {len(items)} kernels in {time.perf_counter() - start:.0f} s ({jobs} processes)", flush=True)
    for e in errors:
        print("  compile error:", e, flush=True)
    print(harness.markdown_table(SWEEP_COLUMNS, []))
    rows = []
    saved = {t: (dequant.KERNEL_CONFIG[t], dequant.KERNEL_VARIANT[t]) for t in map(GGMLType.__getitem__, types)}
    for n_out, n_in in shapes:
        copy_gbs = copy_bandwidth(n_out, n_in)
        emit(
            table,
            [
                "copy",
                f"{n_out}x{n_in} bf16",
                "-",
                "-",
                f"{4 * n_out * n_in / copy_gbs / 1e6:.3f}",
                f"{copy_gbs:.0f}",
                "100%",
                "",
            ],
        )
        for name in types:
            t = GGMLType[name]
            raw = make_raw(t, n_out, n_in, gen)
            out = torch.empty(n_out, n_in, dtype=torch.bfloat16, device=DEV)
            probe = torch.cat([raw[:8], raw[-8:]]).cpu()
            ref = dequantize_reference(probe, t, n_in, torch.bfloat16)
            for v in dequant.variants(t):
                for nb, w in sweep_configs(t):
                    use(t, v, nb, w)
                    row = dict(type=name, n_out=n_out, n_in=n_in, variant=v, blocks=nb, warps=w, copy_gbs=copy_gbs)
                    try:
                        out.fill_(0)
                        ms = bench(lambda: dequantize_tile(raw, t, n_in, out=out), rep=rep)
                    except Exception as e:  # noqa: BLE001 - a setting that does not compile or launch
                        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
                        emit(table, [name, f"{n_out}x{n_in}", v, f"{nb}, {w}", "error", "", "", row["error"]])
                        rows.append(row)
                        continue
                    moved = raw.numel() + 2 * out.numel()
                    exact = same_bits(torch.cat([out[:8], out[-8:]]), ref)
                    row.update(ms=ms, gbs=moved / ms / 1e6, of_copy=moved / ms / 1e6 / copy_gbs, exact=exact)
                    emit(
                        table,
                        [
                            name,
                            f"{n_out}x{n_in}",
                            v,
                            f"{nb}, {w}",
                            f"{ms:.3f}",
                            f"{row['gbs']:.0f}",
                            f"{row['of_copy']:.0%}",
                            "bit-exact" if exact else "MISMATCH",
                        ],
                    )
                    rows.append(row)
            raw = out = None  # type: ignore[assignment]  # freed
    for t, (cfg, v) in saved.items():
        dequant.KERNEL_CONFIG[t], dequant.KERNEL_VARIANT[t] = cfg, v
    return rows, best_settings(rows, saved, len(shapes))


def best_settings(rows: list[dict[str, Any]], saved: dict[GGMLType, Any], n_shapes: int) -> dict[str, dict[str, Any]]:
    """Per type: the bit-exact setting whose worst share of the copy over the shapes is highest, and the current
    setting's, {name: dict(variant, blocks, warps, of_copy (worst), current_of_copy)}."""
    by: dict[str, dict[tuple[int, int, int], list[float]]] = {}
    for r in rows:
        if r.get("exact"):
            by.setdefault(r["type"], {}).setdefault((r["variant"], r["blocks"], r["warps"]), []).append(r["of_copy"])
    best = {}
    for name, settings in by.items():
        full = {k: min(v) for k, v in settings.items() if len(v) == n_shapes}
        if not full:
            continue
        (v, nb, w), share = max(full.items(), key=lambda kv: kv[1])
        cfg, cur_v = saved[GGMLType[name]]
        best[name] = dict(
            variant=v, blocks=nb, warps=w, of_copy=share, current_of_copy=full.get((cur_v, cfg[0], cfg[1]))
        )
    return best


def paste_lines(best: dict[str, dict[str, Any]], hardware: str) -> str:
    """The best settings as lines for juno_py/kernels/dequant.py, after KERNEL_VARIANT / MATVEC_VARIANT (formatted as
    ruff formats them)."""
    cfg = "".join(
        f"        GGMLType.{n}: {(b['blocks'], b['warps'], *dequant.KERNEL_CONFIG[GGMLType[n]][2:])},\n"
        for n, b in best.items()
    )
    var = "".join(f"        GGMLType.{n}: {b['variant']},\n" for n, b in best.items())
    return (
        f"# chosen by `python -m benchmarks.dequant_gpu --sweep` on {hardware}\n"
        f"KERNEL_CONFIG.update(\n    {{\n{cfg}    }}\n)\nKERNEL_VARIANT.update(\n    {{\n{var}    }}\n)\n"
    )


def _check_worker(item: tuple[str, int]) -> list[str]:
    """Every check of one (type, variant) on DEV: the names of those that failed."""
    name, variant = item
    t = GGMLType[name]
    failed = []
    gen = torch.Generator(DEV).manual_seed(int(t) * 7 + variant)
    n_rows, n_in = (67, 2048) if t not in dequant.KERNEL_BLOCK else (67, 1000)
    raw = make_raw(t, n_rows, n_in, gen)
    cpu = raw.cpu()
    default = dequant.KERNEL_CONFIG[t]
    biggest = sweep_configs(t)[-1]
    dequant.KERNEL_VARIANT[t] = dequant.MATVEC_VARIANT[t] = variant

    def check(what: str, ok: Callable[[], bool]) -> None:
        try:
            if not ok():
                failed.append(what)
        except Exception as e:  # noqa: BLE001 - a failure to report
            failed.append(f"{what} ({type(e).__name__}: {str(e).splitlines()[0]})")

    ref16 = dequantize_reference(cpu, t, n_in, torch.bfloat16)
    ref32 = dequantize_reference(cpu, t, n_in, torch.float32)
    split = dequantize_split_reference(cpu, t, n_in)
    check("bf16", lambda: same_bits(dequantize_tile(raw, t, n_in), ref16))
    check("fp32", lambda: same_bits(dequantize_tile(raw, t, n_in, dtype=torch.float32), ref32))
    (r0, r1), (c0, c1) = (3, 60), (5, n_in - 3)

    def rectangle() -> bool:
        out = torch.full((n_rows, n_in + 9), 7.0, dtype=torch.bfloat16, device=DEV)
        tile = dequantize_tile(raw, t, n_in, (r0, r1), (c0, c1), out=out)
        rest = out.clone()
        rest[: r1 - r0, : c1 - c0] = 7.0
        return same_bits(tile, ref16[r0:r1, c0:c1]) and bool((rest == 7.0).all())

    check("bf16 rectangle cutting blocks", rectangle)
    check("split", lambda: same_bits(dequantize_split_tile(raw, t, n_in), split))
    check(
        "split rectangle",
        lambda: same_bits(dequantize_split_tile(raw, t, n_in, (r0, r1), (c0, c1)), split[:, r0:r1, c0:c1]),
    )

    def matvec() -> bool:
        x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(variant))
        y = dequant_matvec(raw, t, n_in, x.to(DEV)).cpu().double()
        want = matvec_reference(cpu, t, n_in, x)
        w = ref16.double()
        bound = n_in * 2.0**-24 * (x.double().abs() @ w.abs().T)
        fin = torch.isfinite(want) & torch.isfinite(bound)
        return bool(fin.any()) and bool(((y - want).abs()[fin] <= bound[fin]).all())

    check("matvec", matvec)
    dequant.KERNEL_CONFIG[t] = (*biggest, *default[2:])
    check(f"bf16 at {biggest}", lambda: same_bits(dequantize_tile(raw, t, n_in), ref16))
    torch.cuda.synchronize() if DEV == "cuda" else None
    return failed


def check_all(types: list[str], jobs: int) -> bool:
    """`_check_worker` for every type × variant, `jobs` at once; prints one line each; whether all passed."""
    import multiprocessing

    items = [(name, v) for name in types for v in dequant.variants(GGMLType[name])]
    start = time.perf_counter()
    if jobs <= 1 or DEV != "cuda":
        results = [_check_worker(i) for i in items]
    else:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            results = pool.map(_check_worker, items, chunksize=1)
    bad = 0
    for (name, v), failed in zip(items, results):
        bad += bool(failed)
        print(f"{name:8s} variant {v}: " + ("bit-exact" if not failed else "FAILED " + "; ".join(failed)), flush=True)
    print(f"{len(items) - bad}/{len(items)} type × variant pairs pass ({time.perf_counter() - start:.0f} s)")
    return bad == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", help=f"default {' '.join(TYPES)}; with --sweep or --check every type")
    ap.add_argument("--shapes", nargs="*", default=[f"{a}x{b}" for a, b in SHAPES])
    ap.add_argument(
        "--sweep", action="store_true", help="time every variant × (blocks a program, warps) setting per type"
    )
    ap.add_argument("--check", action="store_true", help="every type × variant bit-exact on the GPU, then exit")
    ap.add_argument("--best", type=Path, help="--sweep: write the best settings here, as lines for dequant.py")
    ap.add_argument("--rep", type=int, default=25, help="--sweep: milliseconds of repetitions per timing")
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1), help="compiling processes")
    ap.add_argument("--matvec-types", nargs="*", help="default Q4_K Q8_0 (none with --sweep)")
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
    if args.check:
        raise SystemExit(0 if check_all(args.types or all_types(), args.jobs) else 1)
    if args.sweep:
        sweep_rows: list[list[object]] = []
        rows, best = sweep_table(args.types or all_types(), shapes, gen, args.jobs, args.rep, sweep_rows)
        print("\n" + harness.markdown_table(["type", "variant", "blocks, warps", "worst of copy", "current"], []))
        for name, b in best.items():
            cur = "-" if b["current_of_copy"] is None else f"{b['current_of_copy']:.0%}"
            print(f"| {name} | {b['variant']} | {b['blocks']}, {b['warps']} | {b['of_copy']:.0%} | {cur} |")
        lines = paste_lines(best, env["hardware"])
        print("\n" + lines)
        if args.best:
            atomic_write_bytes(args.best, lines.encode())
        if args.json:
            record = dict(hardware=env["hardware"], software=env["software"], sweep=rows, best=best)
            atomic_write_bytes(args.json, json.dumps(record, indent=1).encode())
        return
    decode_rows, matvec_rows = [], []
    result = dict(
        hardware=env["hardware"],
        software=env["software"],
        decode=decode_table(args.types or TYPES, shapes, gen, decode_rows),
    )
    if args.matvec_types is None:
        args.matvec_types = ["Q4_K", "Q8_0"]
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
