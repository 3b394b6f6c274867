"""Why `juno-py lora`'s defaults are what they are: train on the built-in facts with the defaults and with one
setting changed at a time, then score each adapter on the ten held-out rewordings (greedy playback, keyword in the
answer) and on the held-out loss. Every run is the real CLI in a fresh process; wall time includes model load.

    python benchmarks/tune_facts.py                              # prints a markdown table
    python benchmarks/tune_facts.py --append docs/training.md    # and appends it with the command
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (label, extra flags for `juno-py lora`); the first row is the defaults
SETTINGS = [
    ("defaults (lora, r 16, all targets, lr 2e-3, 8 epochs, 4 question variants)", []),
    ("--lora-mode dora", ["--lora-mode", "dora"]),
    ("--lora-targets qv", ["--lora-targets", "qv"]),
    ("--lora-rank 8 --lora-alpha 16", ["--lora-rank", "8", "--lora-alpha", "16"]),
    ("--lora-lr 5e-4", ["--lora-lr", "5e-4"]),
    ("--epochs 4", ["--epochs", "4"]),
    ("--qa-variants 1", ["--qa-variants", "1"]),
]


def score(adapter: Path) -> tuple[int, float]:
    from juno_py.lora import load_adapters
    from juno_py.models import load_model
    from juno_py.train.data import BUILTIN_FACTS_HELDOUT, load_examples
    from juno_py.train.loop import evaluate
    from juno_py.train.recall import answer_recall, read_keyword_records

    model = load_model("smollm2-135m")
    load_adapters(model, [str(adapter)])
    examples, _ = load_examples([BUILTIN_FACTS_HELDOUT], model.tokenizer, 512)
    loss = evaluate(model, examples, 10)["loss"]
    right, lines = answer_recall(model, read_keyword_records(BUILTIN_FACTS_HELDOUT))
    print("\n".join(lines), file=sys.stderr)
    return right, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=int, nargs="*", help="row numbers of SETTINGS to run (0 = defaults)")
    ap.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, flags) in enumerate(SETTINGS):
            if args.only is not None and i not in args.only:
                continue
            out = Path(tmp) / f"run{i}.bin"
            cmd = [sys.executable, "-m", "juno_py", "lora", "--lora-path", str(out), *flags]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            seconds = time.monotonic() - t0
            if proc.returncode != 0:
                raise SystemExit(f"{label}: {proc.stderr[-2000:]}")
            summary = [line for line in proc.stderr.splitlines() if line.startswith("trained ")][-1]
            right, loss = score(out)
            load = os.getloadavg()[0]
            rows.append(f"| {label} | {right}/10 | {loss:.3f} | {seconds:.0f} | {load:.1f} |")
            print(rows[-1], "  #", summary, file=sys.stderr)
    table = ("| setting | held-out rewordings answered | held-out loss | wall s (load, train, save) | load avg |\n"
             "|---|---|---|---|---|\n" + "\n".join(rows))
    print(table)
    if args.append:
        command = "python benchmarks/tune_facts.py " + " ".join(sys.argv[1:])
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(f"\n### Tried settings (SmolLM2-135M, CPU)\n\n`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
