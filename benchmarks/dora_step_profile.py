"""Where one juno-py DoRA training step (dense bf16 W) spends its time on the GPU, per shape of
benchmarks/dora_layer.py: the step's time from an idle GPU (as dora_layer.py measures it) next to PEFT's, the
CPU time to issue it, the step's pieces (each from an idle GPU), host syncs, and torch.profiler's kernel table.
`--cprofile`: instead, where the step's CPU time goes (cProfile of juno-py's step on dense and Q4_K W, by own time).
`--graphed`: instead, each step eager and replayed as a CUDA graph, with the GPU kernels of both.

    python benchmarks/dora_step_profile.py [--shapes 0,3] [--trace-dir DIR] [--cprofile | --graphed]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dora_layer as dl  # noqa: E402


def idle_ms(fn, reps=20):
    """Median CUDA-event ms of fn() started on an idle GPU."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def issue_ms(fn, reps=20):
    """Median CPU ms to issue fn() (the call returns before the GPU finishes) from an idle GPU."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def back_to_back_ms(fn, reps=20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def profile_shape(T, d_in, d_out, r, trace_dir):
    dev = torch.device("cuda")
    d = dl.layer_data(T, d_in, d_out, r, dev)
    x = d["x"].clone().requires_grad_(True)
    juno = dl.juno_layer(dl.DenseBase(d["W"]), d).train()
    lora = dl.peft_layer(d, False, torch.bfloat16).train()
    dora = dl.peft_layer(d, True, torch.bfloat16).train()
    steps = {}
    for name, lay in (("juno", juno), ("PEFT LoRA bf16", lora), ("PEFT DoRA bf16", dora)):
        params = [p for p in lay.parameters() if p.requires_grad]
        fresh = (lambda lay=lay: setattr(lay, "_g_cache", None)) if lay is juno else None
        steps[name] = dl.train_call(lay, x, d["dy"], params, fresh)
    for f in steps.values():
        for _ in range(5):
            f()
    print(f"\n## T={T}, {d_in}->{d_out}, r={r}\n")
    for name, f in steps.items():
        print(f"{name}: idle-start {idle_ms(f):.3f} ms, CPU issue {issue_ms(f):.3f} ms, "
              f"back-to-back {back_to_back_ms(f):.3f} ms/step")

    # pieces of the juno step, each from an idle GPU
    ad = juno.dora
    with torch.no_grad():
        out = juno(x)
    pieces = {
        "base matmul": lambda: juno.base.matmul(x),
        "delta_input (x·Aᵀ·Bᵀ)": lambda: ad.delta_input(x),
        "weight_row_norm": lambda: juno.weight_row_norm(),
        "dora_scale (fresh)": lambda: (setattr(juno, "_g_cache", None), juno.dora_scale()),
        "forward (fresh norm)": lambda: (setattr(juno, "_g_cache", None), juno(x)),
    }
    for name, f in pieces.items():
        f()
        print(f"  piece {name}: idle-start {idle_ms(f):.3f} ms, CPU issue {issue_ms(f):.3f} ms")

    def bwd_only():
        juno._g_cache = None
        y = juno(x)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        y.backward(d["dy"])
        b.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return a.elapsed_time(b), (t1 - t0) * 1e3
    res = [bwd_only() for _ in range(15)]
    print(f"  piece backward only: idle-start {statistics.median(r_[0] for r_ in res):.3f} ms, CPU issue "
          f"{statistics.median(r_[1] for r_ in res):.3f} ms")

    # host syncs inside one step
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            steps["juno"]()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:120] for w in caught if "synchron" in str(w.message).lower()]
    print(f"  host syncs in one juno step: {len(syncs)} {syncs[:5]}")

    from torch.profiler import ProfilerActivity, profile
    for name in ("juno", "PEFT LoRA bf16", "PEFT DoRA bf16"):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                steps[name]()
                torch.cuda.synchronize()
        ka = prof.key_averages()
        try:
            table = ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60)
        except Exception:
            table = ka.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60)
        print(f"\n### profiler, {name}, 3 steps\n")
        print(table)
        if trace_dir is not None and name == "juno":
            prof.export_chrome_trace(str(trace_dir / f"trace_{name.split()[0]}_{T}_{d_in}_{d_out}_{r}.json"))
    del juno, lora, dora, steps, pieces, out
    torch.cuda.empty_cache()


def kernel_table(fn, reps=3, rows=18, trace=None):
    """torch.profiler's GPU kernel table (by own GPU time) of `reps` calls of fn, each followed by a sync; the
    chrome trace to `trace` if given."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    ka = prof.key_averages()
    try:
        return ka.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70)
    except Exception:
        return ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)


def graphed_shape(T, d_in, d_out, r, trace_dir=None):
    """juno-py's step (both forms of the dense stand-in's combined product) and PEFT DoRA bf16's, eager and replayed
    as a CUDA graph: ms from an idle GPU, and the GPU kernels of each, to see what a graph changes."""
    dev = torch.device("cuda")
    d = dl.layer_data(T, d_in, d_out, r, dev)
    x = d["x"].clone().requires_grad_(True)
    print(f"\n## T={T}, {d_in}->{d_out}, r={r}: eager against graphed\n")
    makers = {"juno stacked=False": lambda: dl.juno_layer(dl.DenseBase(d["W"], stacked=False), d),
              "juno stacked=True": lambda: dl.juno_layer(dl.DenseBase(d["W"], stacked=True), d),
              "PEFT DoRA bf16": lambda: dl.peft_layer(d, True, torch.bfloat16)}
    for name, make in makers.items():
        lay = make().train()
        params = [p for p in lay.parameters() if p.requires_grad]
        fresh = (lambda lay=lay: setattr(lay, "_g_cache", None)) if name.startswith("juno") else None
        f = dl.train_call(lay, x, d["dy"], params, fresh)
        for _ in range(5):
            f()
        eager = idle_ms(f)
        graph = dl.capture(f)
        graph.replay()
        replayed = idle_ms(graph.replay)
        print(f"{name}: eager {eager:.3f} ms, graphed {replayed:.3f} ms from an idle GPU")
        tag = f"{name.split()[0]}{'_stacked' if name.endswith('True') else ''}_{T}_{d_in}_{d_out}_{r}"
        traces = [None, None] if trace_dir is None else [trace_dir / f"eager_{tag}.json", trace_dir / f"graph_{tag}.json"]
        print(f"\n### {name}, eager, 3 steps\n\n{kernel_table(f, trace=traces[0])}")
        print(f"\n### {name}, graphed, 3 replays\n\n{kernel_table(graph.replay, trace=traces[1])}")
        del graph, lay, f
        torch.cuda.empty_cache()


def cprofile_shape(T, d_in, d_out, r, steps=100):
    """cProfile of `steps` juno-py steps (fresh norm each, as dora_layer.py's rows), dense and Q4_K W."""
    import cProfile
    import io
    import pstats

    dev = torch.device("cuda")
    d = dl.layer_data(T, d_in, d_out, r, dev)
    x = d["x"].clone().requires_grad_(True)
    for name, base in (("dense", dl.DenseBase(d["W"])), ("Q4_K", dl.quant_layer("Q4_K", d_in, d_out, dev))):
        lay = dl.juno_layer(base, d).train()
        params = [p for p in lay.parameters() if p.requires_grad]
        f = dl.train_call(lay, x, d["dy"], params, dl.optimizer_nudge(lay))
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            f()
        prof.disable()
        cpu = (time.perf_counter() - t0) * 1e3 / steps
        torch.cuda.synchronize()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(40)
        print(f"\n## T={T}, {d_in}->{d_out}, r={r}, {name}: {cpu:.3f} ms of CPU a step under cProfile\n")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:9000])
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
        lines = [line for line in out.getvalue().splitlines() if line.strip()]
        print("\nby cumulative time:\n" + "\n".join(lines)[:9000])
        del lay, base, f
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="comma-separated indices into dora_layer.SHAPES")
    ap.add_argument("--trace-dir", type=Path, default=None)
    ap.add_argument("--cprofile", action="store_true", help="only the step's CPU profile (cProfile)")
    ap.add_argument("--graphed", action="store_true",
                    help="only eager against CUDA-graph replay: times and kernel tables of juno-py and PEFT DoRA")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    idx = range(len(dl.SHAPES)) if args.shapes is None else [int(i) for i in args.shapes.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    for i in idx:
        if args.cprofile:
            cprofile_shape(*dl.SHAPES[i])
        elif args.graphed:
            graphed_shape(*dl.SHAPES[i], args.trace_dir)
        else:
            profile_shape(*dl.SHAPES[i], args.trace_dir)


if __name__ == "__main__":
    main()
