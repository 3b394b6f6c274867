"""Hostile training data: empty records are skipped and counted, and malformed JSON (deep nesting, huge numbers,
huge lines) is a one-line error naming the file and line, never a traceback."""

import pytest
from click.testing import CliRunner

from juno_py.cli.main import cli
from juno_py.train.data import MAX_DEPTH, MAX_LINE_BYTES, DataError, read_records


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
