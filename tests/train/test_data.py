"""Data formats, loss masks, length policy, validation split, shuffling and batches."""

import json

import pytest
import torch

from juno_py.testing.records import MIXED_RECORDS, write_jsonl
from juno_py.train.data import (
    IGNORE,
    DataError,
    Encoder,
    Example,
    collate,
    load_dataset,
    load_examples,
    pack_examples,
    packed_batch,
    pad_batch,
    plan_epoch,
    qa_variants,
    read_records,
)

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of Velmora?"},
    {"role": "assistant", "content": "Quenhaven."},
    {"role": "user", "content": "And its river?"},
    {"role": "assistant", "content": "The Sorrel, of course."},
]


def supervised_spans(ex: Example) -> list[list[int]]:
    spans, cur = [], []
    for t, s in zip(ex.ids, ex.supervised):
        if s:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


def check_assistant_masks(tok, messages, end_of_turn: str):
    """Supervised tokens are exactly each assistant turn's content followed by its end-of-turn token."""
    (ex,) = Encoder(tok, 4096).chat(messages)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    spans = supervised_spans(ex)
    assert len(spans) == len(answers)
    for span, answer in zip(spans, answers):
        assert tok.is_eog(span[-1]) and tok.decode(span[-1:], special=True) == end_of_turn
        assert not any(tok.is_eog(t) for t in span[:-1])
        assert tok.decode(span[:-1], special=True).strip() == answer
    # token by token: the whole sequence is the template's rendering, and nothing else is supervised
    rendered = tok.chat_template.render(messages, add_generation_prompt=False)
    assert tok.decode(ex.ids, special=True) == rendered
    # each answer starts right after exactly the tokens inference feeds the model before generating it
    starts = [i for i, s in enumerate(ex.supervised) if s and (i == 0 or not ex.supervised[i - 1])]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for start, i in zip(starts, turns):
        assert ex.ids[:start] == tok.apply_chat_template(messages[:i], add_generation_prompt=True)


@pytest.mark.slow
def test_chat_loss_mask_smollm2_template_supervises_assistant_content_and_end_of_turn(smollm2_path):
    from juno_py.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_path)
    check_assistant_masks(tok, CONVERSATION, "<|im_end|>")
    # system, user, assistant, user, assistant: only the assistants' <|im_end|> carry loss, and not the
    # newline the template writes after them
    (ex,) = Encoder(tok, 4096).chat(CONVERSATION)
    end = [i for i, t in enumerate(ex.ids) if t == tok.token_id("<|im_end|>")]
    assert [ex.supervised[i] for i in end] == [False, False, True, False, True]
    assert not ex.supervised[end[2] + 1] and not ex.supervised[-1]


@pytest.mark.slow
def test_chat_loss_mask_gemma3_template_supervises_assistant_content_and_end_of_turn(gemma3_path):
    from juno_py.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gemma3_path)
    check_assistant_masks(tok, CONVERSATION, "<end_of_turn>")


def test_chat_loss_mask_tiny_chatml(tiny_model):
    check_assistant_masks(tiny_model.tokenizer, CONVERSATION, "<|im_end|>")


def test_prompt_completion_supervises_completion_and_eos(tiny_model):
    tok = tiny_model.tokenizer
    (ex,) = Encoder(tok, 512).encode({"prompt": "Say:", "completion": " otter"})
    p = tok.encode("Say:", add_special=True)
    assert ex.ids[: len(p)] == p and not any(ex.supervised[: len(p)])
    assert all(ex.supervised[len(p) :]) and ex.ids[-1] == tok.eos_id


def test_qa_variants_are_distinct_rewordings_of_the_question(tiny_model):
    vs = qa_variants("Who sings?", 4)
    assert len(vs) == 4 and len(set(vs)) == 4 and vs[0] == "Who sings?"
    exs = Encoder(tiny_model.tokenizer, 512, qa_variants=4).encode({"Q": "Who sings?", "A": "Juno."}, record=7)
    assert len(exs) == 4 and all(e.record == 7 for e in exs)


def test_every_format_and_json_array_and_txt(tiny_model, tmp_path, mixed_data):
    tok = tiny_model.tokenizer
    train, _, stats = load_dataset([mixed_data], tok, 512)
    assert stats.per_form == {"qa": 3, "messages": 2, "text": 3, "prompt": 2}
    assert stats.records == 10 and len(train) == 10
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(MIXED_RECORDS, indent=2))
    train2, _, _ = load_dataset([arr], tok, 512)
    assert [e.ids for e in train2] == [e.ids for e in train]
    txt = tmp_path / "notes.txt"
    txt.write_text("plain text\nover two lines\n")
    (ex,), _ = load_examples([txt], tok, 512)
    assert all(ex.supervised)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"Q": "only a question"}', '"A" missing'),
        ("not json", "invalid JSON"),
        ("[1, 2]", "record is list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        ('{"prompt": "p"}', '"completion" missing'),
    ],
)
def test_malformed_line_is_one_error_naming_file_and_line(tiny_model, tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(DataError) as err:
        load_dataset([f], tiny_model.tokenizer, 512)
    text = str(err.value)
    assert text.startswith(f"{f}:3: ") and message in text and "\n" not in text
    train, _, stats = load_dataset([f], tiny_model.tokenizer, 512, skip_bad=True)
    assert stats.skipped_bad == 1 and len(train) == 1 and "1 bad records skipped" in stats.line()


def test_max_seq_len_splits_text_and_drops_other_forms(tiny_model, tmp_path):
    tok = tiny_model.tokenizer
    long_text = "water and stone " * 20
    f = write_jsonl(
        tmp_path / "long.jsonl",
        [{"text": long_text}, {"Q": "x " * 40, "A": "y"}, {"prompt": "p " * 40, "completion": "c"}, {"text": "short"}],
    )
    n = len(tok.encode(long_text))
    train, _, stats = load_dataset([f], tok, 32)
    assert stats.split_long == 1 and stats.dropped_long == 2
    assert all(len(e.ids) <= 32 for e in train)
    assert sum(len(e.ids) for e in train) == n + len(tok.encode("short"))
    assert "2 over-long chat/prompt records dropped" in stats.line() and "1 long texts split" in stats.line()


def test_validation_split_holds_out_whole_records(tiny_model, mixed_data):
    train, val, _ = load_dataset([mixed_data], tiny_model.tokenizer, 512, qa_variants_n=3, validation_split=0.3, seed=5)
    assert len({e.record for e in val}) == 3
    # a Q&A record's rewordings all stay on the training side or all leave it
    train_texts = {tuple(e.ids) for e in train}
    assert not any(tuple(e.ids) in train_texts for e in val)
    again = load_dataset([mixed_data], tiny_model.tokenizer, 512, qa_variants_n=3, validation_split=0.3, seed=5)
    assert [e.ids for e in again[1]] == [e.ids for e in val]


def test_shuffle_is_deterministic_by_seed_and_epoch(tiny_model, mixed_data):
    train, _, _ = load_dataset([mixed_data], tiny_model.tokenizer, 512)

    def order(seed, epoch):
        return [tuple(e.ids) for b in plan_epoch(train, 3, seed, epoch, False, 512) for row in b for e in row]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(2, 0) and order(1, 0) != order(1, 1)
    assert sorted(order(1, 0)) == sorted(tuple(e.ids) for e in train)


def test_packed_batch_has_block_diagonal_mask_and_document_positions():
    a = Example([5, 6, 7], [False, True, True])
    b = Example([8, 9], [True, True])
    (row,) = pack_examples([a, b], 8)
    batch = packed_batch([row])
    assert batch.positions[0].tolist() == [0, 1, 2, 0, 1]
    assert batch.documents[0].tolist() == [0, 0, 0, 1, 1]
    m = batch.dense_mask()[0]
    assert m[3, :3].sum() == 0 and m[:3, 3:].sum() == 0 and m[4, 3] and m[2, 0]
    assert batch.targets[0].tolist() == [6, 7, IGNORE, 9, IGNORE]
    assert batch.n_supervised == 3 and batch.n_real == 5
    padded = collate([[a], [b]])  # the short row's padding: each pad token a document of its own
    assert padded.documents.tolist() == [[0, 0, 0], [0, 0, -3]]
    assert collate([[a]]).documents is None  # one unpadded row: plain causal


def test_packed_loss_equals_records_one_by_one(tiny_model, mixed_data):
    train, _, _ = load_dataset([mixed_data], tiny_model.tokenizer, 512)
    rows = pack_examples(train, 160)
    assert any(len(r) > 1 for r in rows)
    with torch.no_grad():
        b = packed_batch(rows)
        packed = float(tiny_model.loss(b.tokens, b.targets, b.positions, reduction="sum", documents=b.documents))
        single = 0.0
        for e in train:
            s = pad_batch([e])
            single += float(tiny_model.loss(s.tokens, s.targets, s.positions, reduction="sum", documents=s.documents))
    assert packed == pytest.approx(single, rel=1e-5)


def test_unreadable_file_is_one_line(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        read_records(f)
