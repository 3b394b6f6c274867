"""Token-by-token decoding on the CPU: juno-py's native decoder (every product from the quantized bytes) against
the streaming forward it replaces (`JUNO_PY_NATIVE=0`, the fp32 weights cache `juno-py local` keeps for a small
model), and llama.cpp through llama-cpp-python on the same GGUF when it is installed.

    python -m benchmarks.decode_cpu --threads 2                       # SmolLM2-135M from the model store
    python -m benchmarks.decode_cpu --synthetic smollm2 --threads 2   # its shapes and types, random valid blocks

Decode tokens/s: greedy steps after a short prompt, timed from the first step to the last (prefill apart), the
best of `--rounds` runs, the configurations interleaved so a busy spell of the machine reaches them alike. Prefill
tokens/s: a `--prefill`-token prompt through the forward (llama.cpp: the same prompt as one batch).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from benchmarks import harness

COLUMNS = ["work", "juno-py tokens/s", "streaming forward tokens/s", "**× streaming**", "llama.cpp tokens/s", "× peer"]

# SmolLM2-135M as the model store's GGUF holds it: Q4_1 blocks, the tied output a Q8_0 token embedding
SMOLLM2 = dict(n_embd=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152, rope_base=100000.0)


def synthetic_gguf(path: Path, shape: dict, seed: int = 0) -> Path:
    """A llama-architecture GGUF of `shape` (SMOLLM2's keys) with random valid Q4_1 blocks and a Q8_0 tied
    embedding, written with our writer (no tokenizer: the benchmark feeds token ids)."""
    from juno_py.gguf import GGMLType, GGUFWriter, ValueType
    from juno_py.testing.blocks import random_rows

    s = shape
    hd = s["n_embd"] // s["n_head"]
    u32, f32 = ValueType.UINT32, ValueType.FLOAT32
    meta = [
        ("general.architecture", "llama", ValueType.STRING),
        ("general.name", "synthetic", ValueType.STRING),
        ("llama.context_length", 8192, u32),
        ("llama.embedding_length", s["n_embd"], u32),
        ("llama.block_count", s["n_layer"], u32),
        ("llama.feed_forward_length", s["n_ff"], u32),
        ("llama.attention.head_count", s["n_head"], u32),
        ("llama.attention.head_count_kv", s["n_head_kv"], u32),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5, f32),
        ("llama.rope.freq_base", s["rope_base"], f32),
        ("llama.rope.dimension_count", hd, u32),
        ("llama.vocab_size", s["n_vocab"], u32),
    ]
    q, kv = s["n_embd"], s["n_head_kv"] * hd
    layer = {
        "attn_q": (q, s["n_embd"]),
        "attn_k": (kv, s["n_embd"]),
        "attn_v": (kv, s["n_embd"]),
        "attn_output": (s["n_embd"], q),
        "ffn_gate": (s["n_ff"], s["n_embd"]),
        "ffn_up": (s["n_ff"], s["n_embd"]),
        "ffn_down": (s["n_embd"], s["n_ff"]),
    }
    ones = torch.ones(s["n_embd"]).numpy()
    with GGUFWriter(path) as w:
        for key, value, vtype in meta:
            w.add_field(key, value, vtype)
        embd = (s["n_vocab"], s["n_embd"])
        w.add_tensor("token_embd.weight", random_rows(GGMLType.Q8_0, *embd, seed=seed), GGMLType.Q8_0, embd)
        w.add_tensor("output_norm.weight", ones, GGMLType.F32, (s["n_embd"],))
        for il in range(s["n_layer"]):
            for role in ("attn_norm", "ffn_norm"):
                w.add_tensor(f"blk.{il}.{role}.weight", ones, GGMLType.F32, (s["n_embd"],))
            for i, (name, rows_cols) in enumerate(layer.items()):
                rows = random_rows(GGMLType.Q4_1, *rows_cols, seed=seed + 1 + 7 * il + i)
                w.add_tensor(f"blk.{il}.{name}.weight", rows, GGMLType.Q4_1, rows_cols)
    return path


def decode_seconds(model, prompt: list[int], n: int, native_path: bool) -> float:
    """Wall seconds of `n` greedy decode steps after `prompt` (prefill not counted)."""
    from juno_py.models.decode import NativeDecoder
    from juno_py.models.generate import decode_one_token, prefill

    os.environ["JUNO_PY_NATIVE"] = "1" if native_path else "0"
    try:
        with torch.no_grad():
            cache = model.new_cache(batch=1, max_len=len(prompt) + n + 1)
            logits = prefill(model, torch.tensor([prompt]), cache)
            decoder = NativeDecoder.build(model, cache) if native_path else None
            if native_path and decoder is None:
                raise RuntimeError(f"the native decoder does not apply: {NativeDecoder.unsupported(model, cache)}")
            step: Callable[[int], torch.Tensor] = (
                decoder.step if decoder is not None else (lambda t: decode_one_token(model, t, cache))
            )
            token = int(logits.argmax())
            start = time.perf_counter()
            for _ in range(n):
                token = int(step(token).argmax())
            return time.perf_counter() - start
    finally:
        os.environ.pop("JUNO_PY_NATIVE", None)


def prefill_seconds(model, prompt: list[int]) -> float:
    from juno_py.models.generate import prefill

    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt))
        start = time.perf_counter()
        prefill(model, torch.tensor([prompt]), cache)
        return time.perf_counter() - start


def _llama_cpp(path: Path, threads: int, **kw):
    """llama-cpp-python's model of the file (`kw`: its context options), or None where it is not installed."""
    try:
        import llama_cpp  # type: ignore[import-not-found]
    except ImportError:
        return None
    return llama_cpp.Llama(model_path=str(path), n_threads=threads, verbose=False, **kw)


def llama_cpp_tokens_per_s(path: Path, prompt: list[int], n: int, threads: int, rounds: int) -> Optional[float]:
    """llama.cpp's decode tokens/s on the same file, or None where llama-cpp-python is not installed."""
    llm = _llama_cpp(path, threads, n_ctx=len(prompt) + n + 8)
    if llm is None:
        return None
    best = float("inf")
    for _ in range(rounds):
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(n):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        best = min(best, time.perf_counter() - start)
    return n / best


def llama_cpp_prefill_tokens_per_s(path: Path, prompt: list[int], threads: int, rounds: int) -> Optional[float]:
    """llama.cpp's prefill tokens/s on the same file (the prompt in one batch), or None without llama-cpp-python."""
    n = len(prompt)
    llm = _llama_cpp(path, threads, n_ctx=n + 8, n_batch=n)
    if llm is None:
        return None
    best = float("inf")
    for _ in range(rounds):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        best = min(best, time.perf_counter() - start)
    return n / best


def with_lora(model, rank: int, seed: int = 0):
    """Random LoRA adapters of rank `rank` on q and v (B non-zero, so the products are not skipped)."""
    from juno_py.lora import attach

    aset = attach(model, "qv", rank=rank, alpha=2.0 * rank, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.02, generator=g)
    aset.eval()
    return aset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a .gguf file or a model-store name")
    ap.add_argument("--synthetic", choices=["smollm2"], help="a random-block model of these shapes instead")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per run")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill row")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every configuration (the best is kept)")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: juno_py.threads.choose())")
    ap.add_argument("--lora-rank", type=int, default=8, help="rank of the LoRA row (0: no such row)")
    harness.add_output_args(ap)
    args = ap.parse_args()

    from juno_py import threads
    from juno_py.models import load_model
    from juno_py.store import resolve_model

    n_threads = threads.setup(args.threads)
    tmp = None
    if args.synthetic:
        tmp = tempfile.TemporaryDirectory()
        path = synthetic_gguf(Path(tmp.name) / "synthetic.gguf", SMOLLM2)
        label = "SmolLM2-135M-shaped (random Q4_1, Q8_0 output)"
    else:
        path = resolve_model(args.model)
        label = Path(path).stem
    # the streaming forward as `juno-py local` ran it: an fp32 weights cache for a model this small
    model = load_model(path, weights_cache="fp32")
    vocab = model.layout.n_vocab
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (8,), generator=g).tolist()
    long_prompt = torch.randint(100, vocab, (args.prefill,), generator=g).tolist()

    def best_rate(native_path: bool) -> float:
        return args.tokens / min(decode_seconds(model, prompt, args.tokens, native_path) for _ in range(args.rounds))

    rates = {"native": best_rate(True), "forward": best_rate(False)}
    peer = llama_cpp_tokens_per_s(Path(path), prompt, args.tokens, n_threads, args.rounds)
    peer_cell = f"{peer:.1f}" if peer is not None else "not installed"
    rows = [
        [
            f"decode, {args.tokens} tokens, {n_threads} threads",
            f"{rates['native']:.1f}",
            f"{rates['forward']:.1f}",
            f"**{rates['native'] / rates['forward']:.2f}×**",
            peer_cell,
            f"{rates['native'] / peer:.2f}×" if peer else "-",
        ]
    ]
    if n_threads > 1:  # the same decoder on one thread: what more threads gain, or lose on a busy machine
        threads.apply(1)
        one = best_rate(True)
        threads.apply(n_threads)
        rows.append(["decode, 1 thread", f"{one:.1f}", "-", "-", "-", "-"])
    if args.lora_rank:
        with_lora(model, args.lora_rank)
        lora_native, lora_forward = best_rate(True), best_rate(False)
        rows.append(
            [
                f"decode with LoRA q,v r {args.lora_rank}",
                f"{lora_native:.1f}",
                f"{lora_forward:.1f}",
                f"**{lora_native / lora_forward:.2f}×**",
                peer_cell + (" (no adapter)" if peer else ""),
                f"{lora_native / peer:.2f}×" if peer else "-",
            ]
        )
    pre = args.prefill / min(prefill_seconds(model, long_prompt) for _ in range(args.rounds))
    peer_pre = llama_cpp_prefill_tokens_per_s(Path(path), long_prompt, n_threads, args.rounds)
    rows.append(
        [
            f"prefill, {args.prefill} tokens",
            f"{pre:.0f}",
            f"{pre:.0f}",
            "1.00×",
            f"{peer_pre:.0f}" if peer_pre is not None else "not installed",
            f"{pre / peer_pre:.2f}×" if peer_pre else "-",
        ]
    )
    notes = [
        f"Model: {label}. juno-py: `NativeDecoder` (products from the quantized bytes, {n_threads} native and "
        f"torch threads); streaming forward: the same steps through `Transformer.forward` with "
        "`JUNO_PY_NATIVE=0` and the fp32 weights cache (what `juno-py local` ran before the native decoder).",
        "Decode: greedy steps after an 8-token prompt, prefill not counted, best of "
        f"{args.rounds} runs. Prefill runs through the forward (dequantize + GEMM) in both columns.",
        "llama.cpp: llama-cpp-python on the same file and thread count"
        + (", greedy" if peer else "; it is not installed here, so its column is empty"),
        "Load average: the 1-minute load when the run finished; above the CPU count, other processes shared "
        "the cores and every number is pessimistic.",
    ]
    record = harness.results(
        "cpu-decode",
        "Token-by-token decoding on the CPU",
        harness.command_line("benchmarks.decode_cpu"),
        COLUMNS,
        rows,
        notes,
    )
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    print(f"load average {record['load_average']}")
    harness.write_results(args, record)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
