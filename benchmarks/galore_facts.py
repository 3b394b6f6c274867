"""Does a GGUF written by `juno-py full` know the built-in facts? Held-out loss of the base and of the GGUF, and the
GGUF's greedy answers to the held-out rewordings (`juno_py/data/facts_heldout.jsonl`: questions worded unlike any
training example), scored by their keyword as tests/train/test_facts.py scores adapter playback.

    juno-py full --optimizer galore --validation-data juno_py/data/facts_heldout.jsonl --output facts-full.gguf \\
        --requant auto --report facts-full.report.json
    python -m benchmarks.galore_facts facts-full.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", help="the trained model (juno-py full --output)")
    ap.add_argument("--base", default="smollm2-135m", help="the model it was trained from")
    args = ap.parse_args()

    from juno_py.models import load_model
    from juno_py.train.data import BUILTIN_FACTS_HELDOUT, load_examples
    from juno_py.train.recall import answer_recall, read_keyword_records
    from juno_py.train.steps import evaluate

    base, trained = load_model(args.base), load_model(args.gguf)
    held, _ = load_examples([BUILTIN_FACTS_HELDOUT], base.tokenizer, 512)
    print(
        f"held-out loss: base {evaluate(base, held, 10)['loss']:.3f}, {Path(args.gguf).name} "
        f"{evaluate(trained, held, 10)['loss']:.3f}"
    )
    records = read_keyword_records(BUILTIN_FACTS_HELDOUT)
    right, lines = answer_recall(trained, records)
    print("\n".join(lines))
    print(f"{right}/{len(records)} held-out rewordings answered by {Path(args.gguf).name}")


if __name__ == "__main__":
    main()
