"""The playback GEMV on one GPU: sweep its configurations, check them, then decode with the best.

`--sweep` times every candidate (rows a program BR, blocks a step KB, warps; then split-K for the best few) of
`matvec_triton.gemv_kernel` at 1 token on the shapes of playback's products, per type:
  Q4_K, Q6_K   4096x4096 (attn_q/o), 14336x4096 (ffn_gate/up), 4096x14336 (ffn_down), 128256x4096 (output)
  Q8_0         the same, and 49152x576 (SmolLM2-135M's tied output)
  Q4_1         SmolLM2-135M's 576x576, 1536x576, 576x1536
prints each config's times and effective bandwidth (quantized bytes read / time), the best per type (least total
time over its shapes) as a JUNO_PY_GEMV value, and sets it for the rest of the run. `--check` compares the GEMV
with the torch reference (`matvec_reference`, fp64 over the codec's values) on the GPU for every type it takes and
every candidate config (1 token; odd row counts; block counts that steps and splits do not divide), and the chosen
config at 1 to 4 tokens, within the fp32 accumulation bound: bf16 x with bf16-rounded weights (playback's case),
and fp32 x with fp32 weights once per shape. `--decode` then runs `benchmarks.decode_gpu` with the
chosen configs (extra arguments after `--`).

    python -m benchmarks.gemv_gpu --sweep --check --decode          # the whole round, about 5 min on an H200
    python -m benchmarks.gemv_gpu --sweep --types Q4_K               # one type's sweep
    python -m benchmarks.gemv_gpu --check                            # the current table (or JUNO_PY_GEMV)
    python -m benchmarks.gemv_gpu --decode -- --models llama8b --impls graph

Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed between runs). The sweep's record goes to
`benchmarks/results/gpu-gemv.json`.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import harness
from juno_py.gguf import GGMLType
from juno_py.gguf.constants import GGML_BLOCK_SIZES
from juno_py.kernels import dequant
from juno_py.testing.synthetic import random_blocks

LLAMA = [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
SHAPES = {
    "Q4_K": LLAMA,
    "Q6_K": LLAMA,
    "Q8_0": [*LLAMA, (49152, 576)],
    "Q4_1": [(576, 576), (1536, 576), (576, 1536)],
}
COLUMNS = [
    "type",
    "config (BR, KB, warps, split)",
    *(f"{a}x{b} µs (GB/s)" for a, b in LLAMA),
    "other shapes µs",
    "total µs",
]
U32 = 2.0**-24


def values_per_part(t: GGMLType) -> int:
    """Values of one block part a step holds per row and block (the kernel's `[G, M, I]`)."""
    return 32 if t == GGMLType.Q8_0 else GGML_BLOCK_SIZES[t][0] // 2


def candidates(t: GGMLType) -> list[tuple[int, int, int, int]]:
    """(BR, KB, warps, 1) whose step holds 4 to 32 values a thread (one of them, under --smoke)."""
    kbs = (1, 2, 4, 8) if GGML_BLOCK_SIZES[t][0] == 256 else (2, 4, 8, 16)
    out = []
    for br in (1, 2, 4, 8, 16):
        for kb in kbs:
            for warps in (2, 4, 8):
                per_thread = br * kb * values_per_part(t) / (32 * warps)
                if 4 <= per_thread <= 32:
                    out.append((br, kb, warps, 1))
    return out[:1] if SMOKE else out


SMOKE = False  # --smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (the script runs; the times mean nothing)
DEV = "cuda"


def bench_us(fn) -> float:
    if SMOKE:
        return 1e6 * min(harness.cpu_times(fn, 1))
    return 1e3 * harness.do_bench_ms(fn, rep=10, warmup=5)


def sweep(types: list[str], gen: torch.Generator, table: list, raw_rows: list) -> dict[int, tuple]:
    best: dict[int, tuple] = {}
    print(harness.markdown_table(COLUMNS, []), flush=True)
    for name in types:
        t = GGMLType[name]
        weights = []
        for n_out, n_in in SHAPES[name] if not SMOKE else [(5, SHAPES[name][0][1])]:
            raw = random_blocks(t, n_out, n_in, gen, device=DEV).view(n_out, -1)
            weights.append((raw, n_in, torch.randn(1, n_in, device=DEV, dtype=torch.bfloat16)))

        def run(cfg):
            times = []
            for raw, n_in, x in weights:
                fn = lambda: dequant.dequant_matvec(raw, t, n_in, x, out_dtype=torch.bfloat16, config=cfg)  # noqa: E731
                try:
                    fn()
                    times.append(bench_us(fn))
                except Exception as e:  # noqa: BLE001 - a config that does not compile: reported, skipped
                    print(f"{name} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
                    return None
            row = dict(type=name, config=list(cfg), us=times, total_us=sum(times))
            raw_rows.append(row)
            n_llama = len(LLAMA) if SHAPES[name][: len(LLAMA)] == LLAMA and not SMOKE else 0
            main = [f"{us:.1f} ({r.numel() / us / 1e3:.0f})" for (r, _, _), us in zip(weights, times[:n_llama])]
            other = " ".join(f"{us:.1f}" for us in times[n_llama:]) or "-"
            line = [name, ", ".join(map(str, cfg)), *(main or ["-"] * len(LLAMA)), other, f"{sum(times):.1f}"]
            table.append(line)
            print("| " + " | ".join(line) + " |", flush=True)
            return sum(times)

        scored = []
        for cfg in [dequant.MATVEC_CONFIG[t], *candidates(t)]:
            total = run(cfg)
            if total is not None:
                scored.append((total, cfg))
        scored.sort()
        for _, (br, kb, warps, _) in scored[: 1 if SMOKE else 3]:  # split-K for the best few
            for split in (2,) if SMOKE else (2, 4):
                total = run((br, kb, warps, split))
                if total is not None:
                    scored.append((total, (br, kb, warps, split)))
        scored.sort()
        best[int(t)] = scored[0][1]
        print(f"best {name}: {scored[0][1]} ({scored[0][0]:.1f} µs over its shapes)", flush=True)
        weights = []
    return best


def check(types: list[str], gen: torch.Generator, sweep_types: set) -> bool:
    """Every candidate config at 1 token (the sweep's candidates for the swept types, a small grid for the others)
    and the chosen config at 1 to 4 tokens, within the fp32 accumulation bound of the fp64 reference."""
    from juno_py.kernels.dequant import dequantize_reference

    ok_all = True
    for name in types:
        t = GGMLType[name]
        block = GGML_BLOCK_SIZES[t][0]
        shapes = [(1027, 4096), (515, 14336), (263, 17 * 256 if block == 256 else 130 * 32)]
        if SMOKE:
            shapes = [(7, 5 * 256 if block == 256 else 9 * 32)]
        grid = candidates(t) if name in sweep_types else [(1, 1, 4, 1), (4, 4, 4, 1), (2, 2, 8, 3)][: 1 if SMOKE else 3]
        chosen = dequant.gemv_config(t)
        cases = [(cfg, 1) for cfg in dict.fromkeys([*grid, (2, 2, 4, 3), chosen])]
        cases += [(chosen, n) for n in (2, 3, 4)]
        worst = 0.0
        failed = []
        t0 = time.perf_counter()
        for n_out, n_in in shapes:
            raw = random_blocks(t, n_out, n_in, gen, device=DEV).view(n_out, -1)
            w = {
                rb: dequantize_reference(raw, t, n_in, torch.bfloat16 if rb else torch.float32).double()
                for rb in (True, False)
            }
            for cfg, tokens in cases:
                for rb in (True, False) if tokens == 1 and cfg == chosen else (True,):
                    x = torch.randn(tokens, n_in, generator=torch.Generator().manual_seed(tokens))
                    if rb:  # playback's case: bf16 activations, read as packed words
                        x = x.to(torch.bfloat16)
                    y = dequant.dequant_matvec(raw, t, n_in, x.to(DEV), round_bf16=rb, config=cfg).cpu().double()
                    x = x.float()
                    ref = x.double() @ w[rb].T  # matvec_reference, over the codec's values decoded once
                    bound = n_in * U32 * (x.double().abs() @ w[rb].abs().T)
                    excess = ((y - ref).abs() / bound.clamp_min(1e-300)).max().item()
                    worst = max(worst, excess)
                    if not bool(((y - ref).abs() <= bound).all()):
                        failed.append(f"{n_out}x{n_in} {cfg} {tokens} tokens round_bf16={rb}")
        ok_all &= not failed
        status = "ok" if not failed else "FAILED: " + "; ".join(failed[:6])
        print(
            f"check {name}: {len(cases)} cases x {len(shapes)} shapes, worst |Δ| / bound {worst:.3f}, "
            f"{time.perf_counter() - t0:.0f} s: {status}",
            flush=True,
        )
    return ok_all


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time the candidate configs, keep the best per type")
    ap.add_argument("--check", action="store_true", help="check every type and config against the torch reference")
    ap.add_argument("--decode", action="store_true", help="then run benchmarks.decode_gpu (its arguments after --)")
    ap.add_argument("--types", nargs="*", default=list(SHAPES), choices=list(SHAPES), help="types to sweep")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): a script test")
    harness.add_output_args(ap)
    args = ap.parse_args(argv)
    global SMOKE, DEV
    if args.smoke:
        SMOKE, DEV = True, "cpu"
        rest = [*rest, "--smoke", "--no-results"]
    elif not torch.cuda.is_available():
        raise SystemExit("gemv_gpu.py needs a CUDA GPU")
    gen = torch.Generator(DEV).manual_seed(0)
    env = harness.environment(DEV)
    print(env["hardware"], env["software"], "\n", flush=True)
    if args.sweep:
        table: list = []
        raw_rows: list = []
        best = sweep(args.types, gen, table, raw_rows)
        dequant.MATVEC_CONFIG.update(best)
        value = ";".join(f"{GGMLType(t).name}={','.join(map(str, c))}" for t, c in sorted(best.items()))
        print(f"\nJUNO_PY_GEMV='{value}'\n", flush=True)
        record = harness.results(
            "gpu-gemv",
            "The playback GEMV's configurations on one GPU (1 token)",
            harness.command_line("benchmarks.gemv_gpu", argv),
            COLUMNS,
            table,
            [
                "Medians of triton.testing.do_bench (L2 flushed); GB/s = quantized bytes read / time; bf16 x and "
                f"output. Best per type (least total over its shapes): JUNO_PY_GEMV='{value}'."
            ],
            env=env,
        )
        record["rows_raw"] = raw_rows
        record["best"] = {GGMLType(t).name: list(c) for t, c in best.items()}
        harness.write_results(args, record)
    if args.check:
        ok = check(
            [GGMLType(t).name for t in sorted(dequant.GEMV_TYPES)], gen, set(args.types) if args.sweep else set()
        )
        if not ok:
            raise SystemExit("the GEMV check failed")
    if args.decode:
        from benchmarks import decode_gpu

        sys.argv = ["benchmarks.decode_gpu", *rest]
        decode_gpu.main()


if __name__ == "__main__":
    main()
