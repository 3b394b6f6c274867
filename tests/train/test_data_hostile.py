"""Hostile training data: empty records are skipped and counted, and malformed JSON (deep nesting, huge numbers,
huge lines or JSON array records) is a one-line error naming the file and line or record, never a traceback."""

import json

import pytest
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.train import data as data_module
from juno_py.train.data import MAX_DEPTH, MAX_LINE_BYTES, DataError, DataStats, read_records


def invoke(*args):
    return CliRunner().invoke(cli, ["lora", *map(str, args)], catch_exceptions=False)


def test_empty_records_are_skipped_and_counted(tiny_path, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": ""}\n{"text": "hello there"}\n{"prompt": "", "completion": "fine"}\n')
    r = invoke(
        "--model-path",
        tiny_path,
        "--data",
        data,
        "--lora-path",
        tmp_path / "a.bin",
        "--max-steps",
        2,
        "--lora-rank",
        2,
        "--no-progress",
    )
    assert r.exit_code == 0, r.stderr
    assert "1 records with nothing to learn skipped" in r.stderr and (tmp_path / "a.bin").exists()


def test_only_empty_records_are_refused_up_front(tiny_path, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text('{"text": ""}\n{"text": ""}\n')
    r = invoke(
        "--model-path", tiny_path, "--data", data, "--lora-path", tmp_path / "a.bin", "--max-steps", 2, "--no-progress"
    )
    assert r.exit_code == 1 and r.stdout == "" and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"juno-py: error: {data}: no usable records") and not (tmp_path / "a.bin").exists()


@pytest.mark.parametrize(
    "line, says",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),  # RecursionError inside json
        ('{"text": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}", "nested deeper"),
        ('{"text": "a", "n": ' + "9" * 5000 + "}", "digits"),  # int parsing limit
    ],
)
def test_hostile_json_is_one_line_error_naming_file_and_line(tmp_path, line, says):
    data = tmp_path / "h.jsonl"
    data.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"^{data}:2: .*{says}"):
        read_records(data)
    assert len(read_records(data, skip_bad=True)) == 1
    arr = tmp_path / "h.json"
    arr.write_text("[" + line + "]")
    with pytest.raises(DataError, match=f"^{arr}: .*{says}"):
        read_records(arr)


def test_over_long_line_is_refused(tmp_path):
    data = tmp_path / "long.jsonl"
    with open(data, "w") as f:
        f.write('{"text": "' + "x" * (MAX_LINE_BYTES + 10) + '"}\n{"text": "ok"}\n')
    with pytest.raises(DataError, match=f"^{data}:1: line longer than 16 MiB"):
        read_records(data)
    assert [n for n, _ in read_records(data, skip_bad=True)] == [2]


def test_line_numbers_follow_every_line_break(tmp_path):
    data = tmp_path / "cr.jsonl"
    data.write_bytes(b'{"text": "a"}\r{"text": "b"}\r\n\n{"text": "c"}\n{"Q": "x"}\n')
    with pytest.raises(DataError, match=f"^{data}:5: "):
        read_records(data)
    assert [n for n, _ in read_records(data, skip_bad=True)] == [1, 2, 4]


def test_json_array_records_have_the_size_bound_of_a_line(tmp_path):
    arr = tmp_path / "long.json"
    with open(arr, "w") as f:
        f.write('[{"text": "ok"}, {"text": "' + "x" * (MAX_LINE_BYTES + 10) + '"}, {"text": "b"}]')
    with pytest.raises(DataError, match=f"^{arr}: record 2: longer than 16 MiB") as e:
        read_records(arr)
    assert len(str(e.value)) < 200
    stats = DataStats()
    assert [n for n, _ in read_records(arr, skip_bad=True, stats=stats)] == [1, 3] and stats.skipped_bad == 1


def test_json_array_nesting_is_bounded_per_record(tmp_path):
    arr = tmp_path / "deep.json"
    deep = "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)
    arr.write_text(f'[{{"text": "ok"}}, {{"text": "a", "n": {deep}}}]')
    with pytest.raises(DataError, match=f"^{arr}: record 2: JSON nested deeper than {MAX_DEPTH} levels"):
        read_records(arr)
    stats = DataStats()
    assert [n for n, _ in read_records(arr, skip_bad=True, stats=stats)] == [1] and stats.skipped_bad == 1
    arr.write_text("[" * 100_000)  # deeper than the parser recurses
    with pytest.raises(DataError, match="nested deeper"):
        read_records(arr)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_json_array_read_in_pieces_equals_json_load(tmp_path, monkeypatch, chunk):
    """Records cut anywhere by the read size (inside a number, a multi-byte character, an escape) parse as the
    whole file does with json.loads."""
    records = [
        {"text": f'r{i} é€😀 \\" \n', "n": 10**i + i, "f": i / 7, "ok": i % 2 == 0, "x": None, "l": [i, [i]]}
        for i in range(40)
    ]
    text = json.dumps(records, ensure_ascii=False, indent=1 if chunk == 7 else None)
    arr = tmp_path / "a.json"
    arr.write_text(" \n" + text + "\n ", encoding="utf-8")
    monkeypatch.setattr(data_module, "_ARRAY_CHUNK", chunk)
    assert [r for _, r in read_records(arr)] == json.loads(text)


@pytest.mark.parametrize(
    "content, says",
    [
        ('[{"text": "a"}, ]', "record 2: invalid JSON"),
        ('[{"text": "a"} {"text": "b"}]', "expected ',' or ']'"),
        ('[{"text": "a"}] [', "text after its closing"),
        ('[{"text": "a"}', "expected ',' or ']'"),
        ("[]", None),
    ],
)
def test_malformed_json_arrays_are_one_line_errors(tmp_path, content, says):
    arr = tmp_path / "bad.json"
    arr.write_text(content)
    if says is None:
        assert read_records(arr) == []
        return
    with pytest.raises(DataError, match=f"^{arr}: .*{says}"):
        read_records(arr)


def test_degenerate_json_array_records_are_skipped_and_counted(tiny_path, tmp_path):
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps([{"text": ""}, {"text": "hello there"}, {"prompt": "", "completion": ""}]))
    r = invoke(
        "--model-path", tiny_path, "--data", arr, "--lora-path", tmp_path / "a.bin", "--max-steps", 2,
        "--lora-rank", 2, "--no-progress",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "2 records with nothing to learn skipped" in r.stderr
