"""FrozenQuantLinear on CPU against a dense fp32 `F.linear` on the same (dequantized) weight, in one run.

For each SmolLM2-135M projection (its real Q4_1 tensors from the model store) and each token count, times
the forward and the forward+backward (input gradient only, as in adapter training: the dense weight has no
gradient either) of: the dense reference, the streaming layer (cache none) in fp32 and bf16 compute, and
the resident caches. Prints a markdown table and writes benchmarks/results/frozen-linear.json; ratios are
time / dense time of the same pass.

    python -m benchmarks.frozen_linear [--tokens 1 64 512] [--threads N] [--rounds 5] [--sweep-chunks] [--synthetic]

The runner is shared and noisy: every configuration is timed as the fastest single call, over several
interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

from benchmarks import harness
from juno_py import store
from juno_py.gguf import GGMLType, GGUFFile, GGUFWriter, quants
from juno_py.weights import FrozenQuantLinear

LAYERS = {  # logical target: tensor of SmolLM2-135M
    "wup": "blk.0.ffn_up.weight",
    "wdown": "blk.0.ffn_down.weight",
    "wq": "blk.0.attn_q.weight",
    "wk": "blk.0.attn_k.weight",
}
SHAPES = {"wup": (1536, 576), "wdown": (576, 1536), "wq": (576, 576), "wk": (192, 576)}  # (n_out, n_in)
CONFIGS = [  # label, FrozenQuantLinear keyword arguments (None: the dense reference)
    ("dense fp32 F.linear", None),
    ("none, fp32", dict(cache="none", compute_dtype=torch.float32)),
    ("none, bf16", dict(cache="none", compute_dtype=torch.bfloat16)),
    ("bf16 cache, fp32", dict(cache="bf16", compute_dtype=torch.float32)),
    ("bf16 cache, bf16", dict(cache="bf16", compute_dtype=torch.bfloat16)),
    ("fp32 cache, fp32", dict(cache="fp32", compute_dtype=torch.float32)),
]


time_per_call = harness.fastest_call


def passes(layer, x: torch.Tensor, dy: torch.Tensor):
    def forward():
        with torch.no_grad():
            layer(x)

    def forward_backward():
        xg = x.detach().requires_grad_()
        layer(xg).backward(dy)

    return forward, forward_backward


def bench(f: GGUFFile, target: str, tokens: int, rounds: int) -> list[tuple[str, float, float]]:
    name = LAYERS[target]
    w = f.dequantize(name)
    layers = [
        (label, (lambda x: F.linear(x, w)) if kw is None else FrozenQuantLinear.from_gguf(f, name, **kw))
        for label, kw in CONFIGS
    ]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, w.shape[1], generator=gen)
    dy = torch.randn(tokens, w.shape[0], generator=gen)
    best = {label: [float("inf"), float("inf")] for label, _ in layers}
    for _ in range(rounds):
        for label, layer in layers:
            for i, fn in enumerate(passes(layer, x, dy)):
                best[label][i] = min(best[label][i], time_per_call(fn))
    return [(label, *best[label]) for label, _ in layers]


def sweep_chunks(f: GGUFFile, targets, token_counts, rounds: int) -> None:
    """Streaming fp32 (cache none) time by chunk size: what DEFAULT_SCRATCH_BYTES is chosen from."""
    fractions = {"1/24": 1 / 24, "1/12": 1 / 12, "1/6": 1 / 6, "1/3": 1 / 3, "all": 1}
    print()
    print("fwd+bwd ms of the streaming layer (cache none, fp32) by rows per chunk (fraction of the layer)")
    print()
    print("| target | T | " + " | ".join(f"{label} of rows" for label in fractions) + " |")
    print("|---|---:|" + "---:|" * len(fractions))
    for target in targets:
        name = LAYERS[target]
        n_out, n_in = f.tensor(name).shape
        layers = [
            FrozenQuantLinear.from_gguf(f, name, chunk_rows=max(1, round(n_out * fr))) for fr in fractions.values()
        ]
        for tokens in token_counts:
            x, dy = torch.randn(tokens, n_in), torch.randn(tokens, n_out)
            best = [float("inf")] * len(layers)
            for _ in range(rounds):
                for i, layer in enumerate(layers):
                    best[i] = min(best[i], time_per_call(passes(layer, x, dy)[1]))
            cells = " | ".join(f"{t * 1e3:.2f} ({layer.chunk_rows})" for layer, t in zip(layers, best))
            print(f"| {target} | {tokens} | {cells} |", flush=True)


def write_synthetic_model(path: str) -> str:
    """The same four tensors as random N(0, 0.02²) weights quantized to Q4_1 (for machines without the store:
    the time of a codec does not depend on the values)."""
    with GGUFWriter(path) as w:
        w.add_field("general.architecture", "llama")
        for target, name in LAYERS.items():
            x = torch.randn(SHAPES[target], generator=torch.Generator().manual_seed(0)) * 0.02
            w.add_tensor(name, quants.quantize(GGMLType.Q4_1, x), GGMLType.Q4_1, SHAPES[target])
    return path


COLUMNS = ["target (n_out×n_in, type)", "T", "configuration", "forward ms", "× dense", "fwd+bwd ms", "× dense"]


def report(f: GGUFFile, args) -> list[list]:
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {harness.cpu_name()}, load average "
        f"{os.getloadavg()[0]:.1f}; fastest call of {args.rounds} interleaved rounds; "
        f"model {os.path.basename(f.path)}"
    )
    print()
    print(harness.markdown_table(COLUMNS, []))
    table = []
    for target in args.targets:
        info = f.tensor(LAYERS[target])
        shape = f"{target} ({info.shape[0]}×{info.shape[1]}, {info.type_name})"
        for tokens in args.tokens:
            rows = bench(f, target, tokens, args.rounds)
            _, dense_f, dense_fb = rows[0]
            for label, t_f, t_fb in rows:
                table.append(
                    [
                        shape,
                        tokens,
                        label,
                        f"{t_f * 1e3:.3f}",
                        f"{t_f / dense_f:.2f}",
                        f"{t_fb * 1e3:.3f}",
                        f"{t_fb / dense_fb:.2f}",
                    ]
                )
                print("| " + " | ".join(str(c) for c in table[-1]) + " |", flush=True)
    if args.sweep_chunks:
        sweep_chunks(f, args.targets, args.tokens, args.rounds)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="model-store name or GGUF path")
    ap.add_argument("--synthetic", action="store_true", help="random Q4_1 tensors of the same shapes, not --model")
    ap.add_argument("--targets", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 512])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--sweep-chunks", action="store_true", help="also time fwd+bwd of the fp32 streaming layer (ms) by chunk size"
    )
    harness.add_output_args(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            path = write_synthetic_model(os.path.join(tmp, "synthetic-smollm2-q4_1.gguf"))
        else:
            path = args.model if os.path.exists(args.model) else store.resolve_model(args.model)
        with GGUFFile(path) as f:
            table = report(f, args)
            model = os.path.basename(f.path)
    note = (
        f"{'synthetic Q4_1 tensors in SmolLM2-135M shapes' if args.synthetic else model}; "
        f"{torch.get_num_threads()} torch threads; each cell the fastest single call over {args.rounds} "
        "interleaved rounds; × dense: time over the dense fp32 F.linear's of the same pass."
    )
    harness.write_results(
        args,
        harness.results(
            "frozen-linear",
            "The frozen quantized linear on CPU",
            harness.command_line("benchmarks.frozen_linear"),
            COLUMNS,
            table,
            [note],
        ),
    )


if __name__ == "__main__":
    main()
