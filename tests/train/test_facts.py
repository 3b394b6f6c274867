"""The default job on the real model: `juno-py lora` with no data arguments learns the built-in facts, and the
adapter answers rewordings of the questions it never saw. Trained once per session, shared by the tests."""

import json
import os
import subprocess
import sys
import time

import pytest

from juno_py.train.data import BUILTIN_FACTS, BUILTIN_FACTS_HELDOUT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def facts_adapter(tmp_path_factory, smollm2_path):
    """`juno-py lora --lora-path X` with every other setting at its default (model, data, rank, lr, epochs)."""
    folder = tmp_path_factory.mktemp("facts")
    out = folder / "facts.bin"
    cmd = [
        sys.executable,
        "-m",
        "juno_py",
        "lora",
        "--lora-path",
        str(out),
        "--events-out",
        str(folder / "events.jsonl"),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"\nfacts training: {time.monotonic() - t0:.0f} s; {proc.stderr.strip().splitlines()[-1]}")
    assert proc.stdout == f"{out}\n"
    return out, folder / "events.jsonl"


def heldout():
    from juno_py.train.recall import read_keyword_records

    return read_keyword_records(BUILTIN_FACTS_HELDOUT)


def test_builtin_heldout_questions_are_never_training_variants():
    from juno_py.train.data import qa_variants

    trained = {
        v.lower()
        for line in BUILTIN_FACTS.read_text().splitlines()
        if line.strip()
        for v in qa_variants(json.loads(line)["Q"], 8)
    }
    held = heldout()
    assert len(held) == 10 and all(h["keyword"].lower() in h["A"].lower() for h in held)
    assert not any(h["Q"].lower() in trained for h in held)


def test_facts_training_lowers_heldout_loss(facts_adapter, smollm2_path):
    from juno_py.lora import load_adapters
    from juno_py.models import load_model
    from juno_py.train.data import load_examples
    from juno_py.train.steps import evaluate

    model = load_model(smollm2_path)
    examples, _ = load_examples([BUILTIN_FACTS_HELDOUT], model.tokenizer, 512)
    before = evaluate(model, examples, 10)["loss"]
    load_adapters(model, [str(facts_adapter[0])])
    after = evaluate(model, examples, 10)["loss"]
    print(f"\nheld-out loss: base {before:.3f} -> adapter {after:.3f}")
    assert after < 0.6 * before
    steps = [json.loads(line) for line in facts_adapter[1].read_text().splitlines()]
    losses = [e["loss"] for e in steps if e["kind"] == "train_step"]
    assert losses[-1] < 0.1 * losses[0]


def test_facts_playback_answers_heldout_rewordings(facts_adapter, smollm2_path):
    from juno_py.lora import load_adapters
    from juno_py.models import load_model
    from juno_py.train.recall import answer_recall

    model = load_model(smollm2_path)
    load_adapters(model, [str(facts_adapter[0])])
    right, lines = answer_recall(model, heldout())
    print("\n" + "\n".join(lines) + f"\n{right}/10 held-out rewordings answered")
    assert right >= 8
