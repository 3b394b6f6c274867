"""Playback on one GPU: decode tokens/s at batch 1 with a LoRA adapter, juno-py's graph-replayed step against its
eager step, its forward path and transformers' bf16 `generate`.

Models, built on the device from random valid blocks as `benchmarks/train_gpu.py` builds them (no file, no download):
  llama8b        Llama-3-8B-shaped: 32 layers, hidden 4096, MLP 14336, 32/8 heads, vocab 128256; Q4_K, Q6_K output
  smollm2-135m   the shapes and quant types of the store's SmolLM2-135M-Instruct Q4_1 file
Adapter: LoRA on all linears, rank 16, alpha 32, B random (the adapter's products change the logits).

juno-py (bf16 compute, the base quantized on the GPU): `graph` is `CudaGraphDecoder` as `generate` runs it (the step
replayed as one CUDA graph, the frozen products through the fused dequantize-matvec kernel); `eager` the same step
without the graph; `forward` `decode_one_token` through the model's forward. Each step includes the greedy argmax
read on the host, as playback reads every token (the graph and eager steps pick it themselves: one read of two
ints). tokens/s: `--tokens` steps after `--warmup` (the capture happens
in the warmup). The peer: transformers (bf16 weights, the same decoded values, no adapter) `generate`, greedy, with
its static cache (which transformers compiles with torch.compile) where that runs, else its dynamic cache; tokens/s
from the time of `1 + --tokens` new tokens less the time of 1 (prefill and first token excluded).

    python -m benchmarks.decode_gpu                          # both models, about 4 min on an H200
    python -m benchmarks.decode_gpu --models smollm2-135m --impls graph eager
    python -m benchmarks.decode_gpu --smoke --out /tmp/decode.json   # tiny shapes on the CPU: the script runs

Each run writes `benchmarks/results/gpu-playback.json`; `python -m benchmarks.report` then rewrites
docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import torch

from benchmarks import harness
from benchmarks.train_gpu import build_tensors, hf_model, juno_model, model_spec

MODELS = ["llama8b", "smollm2-135m"]
JUNO_IMPLS = ["graph", "eager", "forward"]
IMPLS = [*JUNO_IMPLS, "transformers"]
LORA = dict(rank=16, alpha=32.0)
PROMPT = 32
TARGETS = {"llama8b": 150.0, "smollm2-135m": 1000.0}
COLUMNS = ["model", "implementation", "new tokens", "ms/token", "tokens/s", "vs transformers", "target"]


def spec_of(name: str, smoke: bool) -> tuple[dict, list]:
    if smoke and name == "llama8b":
        from benchmarks.long_context_gpu import spec_of as long_spec

        return long_spec(name, True)
    return model_spec(name, 1 if smoke else 0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def failure(e: BaseException) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def prompt_ids(n_vocab: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, n_vocab, (n,), generator=g).tolist()


def juno_rows(name: str, meta, spec, args) -> list[dict]:
    from juno_py.lora import Mode, attach
    from juno_py.models.decode_cuda import CudaGraphDecoder
    from juno_py.models.generate import decode_one_token, prefill

    compute = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = juno_model(meta, build_tensors(spec, args.device), "none", args.device, compute)
    aset = attach(model, "all", rank=LORA["rank"], alpha=LORA["alpha"], mode=Mode.LORA, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g).mul_(0.02).to(ad.lora_B.device))
    aset.eval()
    ids = prompt_ids(model.embed.n_vocab, PROMPT)
    rows = []
    for impl in [i for i in args.impls if i in JUNO_IMPLS]:
        n = args.tokens if impl == "graph" else min(args.tokens, args.slow_tokens)
        row = dict(model=name, impl=f"juno-py {impl}", tokens=n)
        try:
            with torch.no_grad():
                cache = model.new_cache(batch=1, max_len=PROMPT + args.warmup + n + args.kernels + 1)
                logits = prefill(model, torch.tensor([ids], device=args.device), cache)
                decoder = None
                if impl != "forward":
                    decoder = CudaGraphDecoder.build(model, cache, graph=impl == "graph")
                    assert decoder is not None, CudaGraphDecoder.unsupported(model, cache)

                def one(logits):
                    # as `generate` reads the greedy token: picked inside the step by the decoder
                    token = decoder.pick()[0] if decoder is not None and decoder.picked is not None else None
                    if token is None:
                        token = int(torch.argmax(logits))
                    return decoder.step(token) if decoder is not None else decode_one_token(model, token, cache)

                for _ in range(args.warmup):
                    logits = one(logits)
                if impl == "graph" and args.device.startswith("cuda"):
                    assert decoder is not None and decoder.graph is not None, decoder and decoder.graph_error
                sync(args.device)
                t0 = time.perf_counter()
                for _ in range(n):
                    logits = one(logits)
                sync(args.device)
                row["s_per_token"] = (time.perf_counter() - t0) / n
                if args.kernels and impl == "eager" and args.device.startswith("cuda"):
                    kernel_table(f"{name}, one eager step", lambda: one(logits), args.kernels)
        except Exception as e:  # noqa: BLE001
            row["error"] = failure(e)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        cache = decoder = logits = None
        gc.collect()
    model = aset = None
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def kernel_table(label: str, step, steps: int) -> None:
    """torch.profiler's kernels of `steps` decode steps, per token: count and device time by kernel name, and
    the launches per token (the graph replays the same kernels: what a token costs beyond its weight bytes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    stats = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    stats.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in stats) / steps
    launches = sum(e.count for e in stats) / steps
    print(f"\n### kernels per token: {label} ({launches:.0f} launches, {total:.0f} us)\n", file=sys.stderr)
    for e in stats[:40]:
        print(f"{e.self_device_time_total / steps:9.1f} us {e.count / steps:6.1f}x  {e.key[:110]}", file=sys.stderr)


def peer_rows(name: str, meta, spec, args) -> list[dict]:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    tensors = build_tensors(spec, args.device)
    model = hf_model(meta, tensors, args.device, dtype)
    del tensors
    gc.collect()
    model.eval()
    ids = torch.tensor([prompt_ids(model.config.vocab_size, PROMPT)], device=args.device)
    caches = ["static", "dynamic"] if args.peer_cache == "auto" else [args.peer_cache]
    row: dict[str, object] = dict(model=name, tokens=args.tokens)
    for kind in caches:
        row = dict(model=name, impl=f"transformers bf16 generate ({kind} cache)", tokens=args.tokens)
        try:
            extra = dict(cache_implementation="static") if kind == "static" else {}

            def gen(k: int) -> float:
                sync(args.device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(
                        ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0, **extra
                    )
                sync(args.device)
                assert out.shape[1] == ids.shape[1] + k, tuple(out.shape)
                return time.perf_counter() - t0

            # compiles (static cache) and warms, at both lengths measured: a new cache length would recompile
            gen(1 + args.tokens)
            gen(1)
            one = min(gen(1) for _ in range(2))
            full = gen(1 + args.tokens)
            row["s_per_token"] = max(full - one, 1e-9) / args.tokens
            print(json.dumps(row), file=sys.stderr, flush=True)
            break
        except Exception as e:  # noqa: BLE001
            row["error"] = failure(e)
            print(json.dumps(row), file=sys.stderr, flush=True)
    model = None
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return [row]


def table(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        peer = next(
            (
                p
                for p in rows
                if p["model"] == r["model"] and p["impl"].startswith("transformers") and "s_per_token" in p
            ),
            None,
        )
        if "s_per_token" not in r:
            out.append([r["model"], r["impl"], r["tokens"], "-", r.get("error", "-"), "-", "-"])
            continue
        rate = 1.0 / r["s_per_token"]
        vs = f"{peer['s_per_token'] / r['s_per_token']:.2f}x" if peer is not None and peer is not r else "-"
        target = f"≥ {TARGETS[r['model']]:.0f}" if r["impl"] == "juno-py graph" and r["model"] in TARGETS else "-"
        out.append([r["model"], r["impl"], r["tokens"], f"{1000 * r['s_per_token']:.2f}", f"{rate:.0f}", vs, target])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS, choices=MODELS)
    ap.add_argument("--impls", nargs="*", default=IMPLS, choices=IMPLS)
    ap.add_argument("--tokens", type=int, default=256, help="measured decode steps (graph and the peer)")
    ap.add_argument("--slow-tokens", type=int, default=32, help="measured steps of the eager and forward paths")
    ap.add_argument("--warmup", type=int, default=8, help="steps before the measured ones (the graph is captured)")
    ap.add_argument("--peer-cache", default="auto", choices=["auto", "static", "dynamic"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--kernels", type=int, default=0, help="profile this many eager steps and print their kernels per token"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few tokens: the script runs")
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.smoke:
        args.device = "cpu"
        args.tokens, args.slow_tokens, args.warmup = min(args.tokens, 4), min(args.slow_tokens, 4), 2
        args.peer_cache = "dynamic" if args.peer_cache == "auto" else args.peer_cache
    env = harness.environment(args.device)
    print(env["hardware"], env["software"], file=sys.stderr)
    command = harness.command_line("benchmarks.decode_gpu")
    rows: list[dict] = []
    for name in args.models:
        meta, spec = spec_of(name, args.smoke)
        rows += juno_rows(name, meta, spec, args)
        if "transformers" in args.impls:
            rows += peer_rows(name, meta, spec, args)
    record = harness.results(
        "gpu-playback",
        "Playback on one GPU: decode tokens/s at batch 1 with a LoRA adapter",
        command,
        COLUMNS,
        table(rows),
        [
            f"Prompt of {PROMPT} tokens; LoRA on all linears, r 16 (juno-py; the transformers peer has no adapter). "
            f"juno-py: mean of the measured steps after {args.warmup} warmup steps, each step with its greedy "
            "token read on the host. transformers: time of 1 + N new tokens less that of 1.",
        ],
        env=env,
    )
    record["rows_raw"] = rows
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)


if __name__ == "__main__":
    main()
