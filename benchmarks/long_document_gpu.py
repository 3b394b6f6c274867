"""Long-document training through the command line on one GPU: `juno-py lora --device cuda --max-seq-len 32768`
on long `.txt` files, end to end.

For each model shape it writes a GGUF of random valid blocks in the real shapes (`benchmarks/train_gpu.py`'s
`model_spec`, with the test suite's byte-level tokenizer, so one character of the text is about one token), and
plain-text files long enough for several sequences of `--seq` tokens each, then runs the command a user would run,
as a subprocess, and reads back what it printed and wrote: the data summary (how the texts were split), the
training summary (tokens/s, loss, peak RSS and peak GPU memory), the events file's per-step losses and the
adapter. A row fails if the command fails, the texts were not split into `--seq`-token sequences, a loss is not
finite, or the adapter is missing.

    python -m benchmarks.long_document_gpu --json long_document_gpu.json
    python -m benchmarks.long_document_gpu --models gemma3-270m --seq 4096 --steps 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.train_gpu import build_tensors, model_spec
from juno_py.gguf import GGUFWriter
from juno_py.testing.tiny_models import item_type, tokenizer_metadata

WORDS = (
    "the river carried cold water past the mill while the miller counted sacks of grain and his daughter wrote "
    "letters to a cousin in the city about the harvest the weather the price of salt and the new bridge"
).split()


def write_model(path: Path, name: str, device: str = "cuda") -> Path:
    """The GGUF of `name`'s shape (random valid blocks made on `device`, norms as ones) with the tiny tokenizer."""
    meta, spec = model_spec(name)
    tensors = build_tensors(spec, device)
    with GGUFWriter(path) as w:
        for key, value in meta.items():
            w.add_field(key, value)
        for key, value, vtype in tokenizer_metadata():
            w.add_field(key, value, vtype, item_type(key))
        for tname, (t, dims, data) in tensors.items():
            w.add_tensor(tname, data.cpu().numpy(), t, dims)
    del tensors
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def write_texts(folder: Path, n_files: int, chars: int, seed: int = 0) -> list[Path]:
    """`n_files` plain-text files of about `chars` characters each: sentences of common words."""
    rng = random.Random(seed)
    paths = []
    for i in range(n_files):
        parts, size = [], 0
        while size < chars:
            sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + ". "
            parts.append(sentence)
            size += len(sentence)
        p = folder / f"long-{i}.txt"
        p.write_text("".join(parts))
        paths.append(p)
    return paths


def run_cli(model: Path, texts: list[Path], out: Path, args, extra: list[str]) -> dict:
    events = out.with_suffix(".events.jsonl")
    cmd = [sys.executable, "-m", "juno_py", "lora", "--model-path", str(model), "--device", args.device]
    for t in texts:
        cmd += ["--data", str(t)]
    cmd += ["--max-seq-len", str(args.seq), "--batch-size", "1", "--max-steps", str(args.steps)]
    cmd += ["--lora-targets", "all", "--lora-rank", "16", "--output", str(out), "--events-out", str(events)]
    cmd += ["--overwrite", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    said = proc.stderr.splitlines()
    row: dict = dict(command="juno-py " + " ".join(cmd[3:]), rc=proc.returncode, wall_s=round(wall, 1))
    if proc.returncode:
        row["error"] = " | ".join(said[-6:])
        return row
    summary = next((s for s in said if s.startswith("trained ")), "")
    data_line = next((s for s in said if "long texts split" in s), "")
    row["data"] = data_line.strip()
    row["summary"] = summary
    m = re.search(r"in ([\d.]+) s, (\d+) tokens/s", summary)
    g = re.search(r"peak GPU ([\d.]+ \w+)", summary)
    row["tokens_per_s"] = int(m.group(2)) if m else None
    row["peak_gpu"] = g.group(1) if g else None
    lines = events.read_text().splitlines() if events.exists() else []
    losses = [e["loss"] for e in map(json.loads, lines) if e.get("kind") == "train_step" and "loss" in e]
    row["losses"] = [round(x, 4) for x in losses]
    row["checkpointing"] = [s for s in said if "checkpoint" in s][:2]
    problems = []
    if not data_line:
        problems.append("the texts were not split into sequences")
    if not out.exists():
        problems.append("no adapter written")
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"losses {losses}")
    if problems:
        row["error"] = "; ".join(problems)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["gemma3-270m", "llama8b"])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--files", type=int, default=2, help="text files; each holds about 2 sequences")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--extra", default="", help="more options for juno-py lora, as one string")
    harness.add_output_args(ap)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        texts = write_texts(folder, args.files, int(args.seq * 2.35))
        for name in args.models:
            model = write_model(folder / f"{name}.gguf", name, args.device)
            row = dict(
                model=name, seq=args.seq, **run_cli(model, texts, folder / f"{name}.bin", args, args.extra.split())
            )
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            model.unlink()
    table = [
        [
            r["model"],
            r["seq"],
            r.get("tokens_per_s") or "-",
            r.get("peak_gpu") or "-",
            " → ".join(str(x) for x in r.get("losses", [])[:1] + r.get("losses", [])[-1:]) or "-",
            r.get("data") or "-",
            r.get("error", "ok"),
        ]
        for r in rows
    ]
    record = harness.results(
        "gpu-long-document-cli",
        "Long documents through the command line on one GPU",
        harness.command_line("benchmarks.long_document_gpu"),
        ["model", "max-seq-len", "tokens/s", "peak GPU", "loss first → last", "data", "result"],
        table,
        [
            f"`juno-py lora --device {args.device} --max-seq-len {args.seq} --batch-size 1 --lora-targets all --lora-rank 16 "
            f"--max-steps {args.steps}` on {args.files} plain-text files of about {int(args.seq * 2.35)} characters "
            "(the tiny byte-level tokenizer: about a token a character); every other option at its default "
            "(checkpointing, chunked loss and the attention backend chosen by juno-py). tokens/s and peak GPU: the "
            "command's own summary line (peak GPU: max_memory_allocated, weights included);"
            " tokens/s covers the whole run, whose first step compiles the kernels (the steady rate is in the "
            "long-sequence table).",
            "Models: GGUF files of random valid blocks in the real shapes, written before the run.",
        ],
        device=args.device,
    )
    record["rows_raw"] = rows
    print(harness.markdown_table(record["columns"], record["rows"]))
    print("\n".join(record["notes"]))
    harness.write_results(args, record)
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
