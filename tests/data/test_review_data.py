"""Hostile review of the text pipeline: what a file holds is what the corpus reads (a UTF-8 BOM is
no text; JSON text values stay text), empty files and bad values are named, and a token stream
refuses a window length it cannot cut."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.data import TokenStream, load_corpus, load_text


def test_a_utf8_bom_is_not_read_as_text(tmp_path):
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbfhello\nworld\n")
    assert load_corpus(str(p)).documents == ["hello\nworld\n"]
    assert load_text(str(p)) == "hello\nworld\n"
    (tmp_path / "only_bom.txt").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path / "only_bom.txt"))
    # a folder of files: each file's BOM goes, a BOM inside the text stays
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_bytes(b"\xef\xbb\xbfone")
    (d / "b.txt").write_bytes("two \ufeff".encode())
    assert load_corpus(str(d)).documents == ["one", "two \ufeff"]


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_jsonl_file_is_named_empty(tmp_path, content):
    pytest.importorskip("datasets")
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match=r"'.*empty\.jsonl' is empty"):
        load_corpus(str(p))
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.jsonl").write_text(content)
    (d / "b.jsonl").write_text(content)
    with pytest.raises(ValueError, match="holds no text"):
        load_corpus(str(d))


def _jsonl(tmp_path, values, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps({"text": v, "id": i}) + "\n" for i, v in enumerate(values)))
    return str(p)


def test_json_text_values_that_look_like_dates_stay_text(tmp_path):
    pytest.importorskip("datasets")
    values = ["2024-01-01", "2024-01-02"]
    assert load_corpus(_jsonl(tmp_path, values)).documents == values


@pytest.mark.parametrize(
    "values, record",
    [(["1", 2, "abc"], 2), (["007", "x", 5.5], 3), ([None, "a", True], 3)],
)
def test_a_non_text_json_value_is_blamed_on_its_own_record(tmp_path, values, record):
    pytest.importorskip("datasets")
    kind = type(values[record - 1]).__name__
    with pytest.raises(ValueError, match=rf"record {record} \(counting from 1\): field 'text' holds {kind}"):
        load_corpus(_jsonl(tmp_path, values))


@pytest.mark.parametrize("seq_len", [0, -1, 2.5, True])
def test_token_stream_refuses_a_bad_seq_len(seq_len):
    with pytest.raises(ValueError, match=r"seq_len: expected an int >= 1, got"):
        TokenStream(torch.arange(10), seq_len)


def test_tokenizer_train_overwrite_replaces_the_transformers_config(tmp_path, capsys):
    """`--overwrite` kept the old tokenizer_config.json (another end-of-text token, add_eos_token):
    transformers would then read the new tokenizer.json with the old tokenizer's settings; and a
    folder holding only a tokenizer_config.json was written into without --overwrite."""
    pytest.importorskip("tokenizers")
    from mnemo.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    out = tmp_path / "tok"
    out.mkdir()
    stale = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "add_eos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(stale))
    argv = ["tokenizer", "train", "--data", str(corpus), "--vocab-size", "270", "--out", str(out)]
    assert main(argv) == 2
    assert "tokenizer_config.json exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert json.loads((out / "tokenizer_config.json").read_text()) == stale
    assert main([*argv, "--overwrite"]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config["add_eos_token"] is False


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85"])
def test_a_line_separator_inside_a_json_string_does_not_split_its_line(tmp_path, sep):
    """The re-read after datasets' type guesses split the file with ``str.splitlines``, which also
    breaks at U+2028, U+2029 and NEL: JSON allows them raw inside a string (``ensure_ascii=False``
    writes them so), and the half line failed as ``Unterminated string`` with neither file nor line."""
    pytest.importorskip("datasets")
    p = tmp_path / "sep.jsonl"
    records = [{"text": f"one{sep}two"}, {"text": "2024-01-01"}, {"text": 5}]
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    with pytest.raises(ValueError, match=r"record 3 \(counting from 1\): field 'text' holds int.*line 3"):
        load_corpus(str(p))


def test_a_jsonl_file_holding_one_array_of_records_is_read_as_datasets_reads_it(tmp_path):
    """datasets reads a ``.jsonl`` file that is one (pretty-printed) array of records; the re-read
    read it line by line and failed on the ``[`` line with an unnamed ``JSONDecodeError``."""
    pytest.importorskip("datasets")
    values = ["2024-01-01", "2024-01-02"]
    p = tmp_path / "array.jsonl"
    p.write_text(json.dumps([{"text": v} for v in values], indent=1))
    assert load_corpus(str(p)).documents == values
    p.write_text(json.dumps([{"text": "a"}, {"text": 7}], indent=1))
    with pytest.raises(ValueError, match=r"record 2 \(counting from 1\): field 'text' holds int.*record 2\)"):
        load_corpus(str(p))
