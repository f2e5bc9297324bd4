"""Corpora: text, JSONL and Parquet files (through `datasets`, local files only) become one token
stream of documents joined by the end-of-text token (char/byte: a blank line), with the document
starts kept; the validation split is deterministic and, for one document, the old one."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from mnemo.cli import main
from mnemo.data import (
    ByteTokenizer,
    CharTokenizer,
    Corpus,
    load_corpus,
    load_text,
    split_text,
)
from mnemo.train import TrainConfig, Trainer


@pytest.fixture(autouse=True, scope="module")
def _needs_datasets():
    """Every test here skips without ``datasets``, as a module-level ``importorskip`` made them; asked
    per test, so collecting the file does not import it (with pandas and pyarrow, ~1.5 s a process)."""
    pytest.importorskip("datasets")


DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "All:\nSpeak, speak. Ünïcödé too — 日本.",
    "\n\nSecond Citizen:\nOne word, good citizens.\n" * 3,
    "x",
]


def _write(tmp_path, docs=DOCS, field="text"):
    """The same documents as .jsonl, .parquet and a .txt of the documents joined by blank lines."""
    import datasets

    rows = [{field: d, "id": i} for i, d in enumerate(docs)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    parquet = tmp_path / "docs.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    txt = tmp_path / "docs.txt"
    txt.write_text("\n\n".join(docs), encoding="utf-8")
    return jsonl, parquet, txt


@pytest.fixture(scope="module")
def bpe():
    pytest.importorskip("tokenizers")
    from mnemo.commands.tokenizer import train_tokenizer
    from mnemo.data import HFTokenizer

    return HFTokenizer(train_tokenizer([load_text("tinyshakespeare")[:30_000]], 300))


def test_jsonl_and_parquet_give_the_txt_stream(tmp_path):
    jsonl, parquet, txt = _write(tmp_path)
    corpora = [load_corpus(str(p)) for p in (jsonl, parquet, txt)]
    assert corpora[0].documents == corpora[1].documents == DOCS
    assert corpora[2].documents == ["\n\n".join(DOCS)]  # a text file is one document
    assert corpora[0].text == corpora[1].text == corpora[2].text == txt.read_text(encoding="utf-8")
    for tok in (CharTokenizer.from_text(corpora[2].text), ByteTokenizer()):
        streams = [c.encode(tok) for c in corpora]
        ids, starts, chars = streams[0]
        for other in streams[1:]:
            assert torch.equal(other[0], ids) and other[2] == chars == len(corpora[2].text)
        assert torch.equal(ids, tok.encode(corpora[2].text))
        # the document starts point at each document's first token
        for doc, s in zip(DOCS, starts.tolist()):
            assert torch.equal(ids[s : s + len(tok.encode(doc))], tok.encode(doc))
        assert starts[0] == 0 and len(starts) == len(DOCS)
        # and the splits are the text's (the cut falls inside a document)
        for c in corpora:
            train, val = c.split()
            assert (train.text, val.text) == split_text(corpora[2].text)


def test_hf_stream_separates_documents_with_the_end_of_text_token(tmp_path, bpe):
    jsonl, parquet, _ = _write(tmp_path)
    ids, starts, chars = load_corpus(str(jsonl)).encode(bpe)
    ids2, starts2, chars2 = load_corpus(str(parquet)).encode(bpe)
    assert torch.equal(ids, ids2) and torch.equal(starts, starts2) and chars == chars2
    expected = []
    for i, doc in enumerate(DOCS):
        expected += ([bpe.eot_id] if i else []) + bpe.encode(doc).tolist()
    assert ids.tolist() == expected
    assert chars == sum(len(d) for d in DOCS)  # the end-of-text tokens stand for no characters
    assert (ids[starts[1:] - 1] == bpe.eot_id).all() and (ids == bpe.eot_id).sum() == len(DOCS) - 1
    assert bpe.decode(ids) == "<|endoftext|>".join(DOCS)


def test_missing_text_field_names_it_and_the_fields_present(tmp_path):
    jsonl, parquet, _ = _write(tmp_path, field="body")
    for p in (jsonl, parquet):
        message = r"no field 'text' \(fields present: \['body', 'id'\]\).*--text-field"
        with pytest.raises(ValueError, match=message):
            load_corpus(str(p))
        assert load_corpus(str(p), text_field="body").documents == DOCS
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"record 2 \(counting from 1\): field 'text' holds int, not text"):
        load_corpus(str(bad))


def test_folders_globs_and_errors(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    for i in range(2):
        (d / f"part-{i}.jsonl").write_text(json.dumps({"text": f"doc {i}"}) + "\n")
    assert load_corpus(str(d)).documents == ["doc 0", "doc 1"]
    assert load_corpus(str(d / "*.jsonl")).documents == ["doc 0", "doc 1"]
    (d / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="mixed formats"):
        load_corpus(str(d))
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_corpus(str(tmp_path / "none.jsonl"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path / "empty.txt"))


def test_a_run_folder_is_not_a_corpus(tmp_path):
    """Hostile trial 13: ``eval --data RUN`` read the run's metrics.jsonl as a corpus."""
    run = tmp_path / "run"
    (run / "ckpt-000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "text": "val_loss 3.1"}) + "\n")
    (run / "latest").write_text("ckpt-000002")
    (run / "ckpt-000002" / "notes.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    for where in (run, run / "ckpt-000002"):
        with pytest.raises(ValueError, match="is a training run's folder or checkpoint"):
            load_corpus(str(where))
    assert load_corpus(str(run / "metrics.jsonl")).documents == ["val_loss 3.1"]  # a file named on purpose


def test_missing_datasets_library_says_how_to_install(tmp_path, monkeypatch):
    jsonl, _, txt = _write(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r'pip install "mnemo\[hf\]"'):
        load_corpus(str(jsonl))
    assert load_corpus(str(txt)).documents  # text files never need it


def test_split_is_deterministic_across_documents():
    c = Corpus(["a" * 50, "b" * 30, "c" * 14])  # 50 + 2 + 30 + 2 + 14 = 98 characters joined
    train, val = c.split()
    assert train.text + val.text == c.text and len(train.text) == int(98 * 0.9)
    assert train.documents == ["a" * 50, "b" * 30, "c" * 4] and val.documents == ["c" * 10]
    # a cut between two documents moves to the start of the next one
    train, val = Corpus(["a" * 88, "b" * 8]).split()  # 98 chars: the cut, 88, is in the separator
    assert train.documents == ["a" * 88] and val.documents == ["b" * 8]
    assert Corpus(["", "abc"]).documents == ["abc"]  # empty documents are dropped


def test_char_and_byte_training_unchanged():
    """tinyshakespeare: the streams are the old `encode(split_text(text))` ones."""
    text = load_text("tinyshakespeare")
    train_text, val_text = split_text(text)
    for kind in ("char", "byte"):
        tiny = {"d_model": 16, "n_layers": 1}
        cfg = TrainConfig(model="gla", model_overrides=tiny, tokenizer=kind, seq_len=16)
        tr = Trainer(cfg, "/nonexistent/never-written", progress=False)
        assert torch.equal(tr.train_data.ids, tr.tokenizer.encode(train_text))
        assert torch.equal(tr.val_data.ids, tr.tokenizer.encode(val_text))
        assert tr.val_chars == len(val_text) and tr.train_data.doc_starts.tolist() == [0]


def test_train_on_jsonl_with_text_field(tmp_path, capsys):
    docs = [load_text("tinyshakespeare")[i : i + 3000] for i in range(0, 30_000, 3000)] + ["the end. " * 40]
    jsonl, _, txt = _write(tmp_path, docs, field="body")
    out = tmp_path / "run"
    fast = ["--steps", "2", "--seq-len", "32", "--batch-size", "4", "--eval-interval", "2"]
    fast += ["--eval-batches", "1", "--d-model", "16", "--n-layers", "1", "--sample-tokens", "0"]
    fast += ["--no-progress"]
    argv = ["train", "--model", "gla", "--data", str(jsonl), "--out", str(out), *fast]
    assert main([*argv, "--text-field", "body"]) == 0
    saved = json.loads((out / "ckpt-000002" / "train_config.json").read_text())
    assert saved["text_field"] == "body" and saved["data"] == str(jsonl)
    assert main([*argv, "--overwrite"]) == 2  # the default field, "text", is not there
    assert "no field 'text' (fields present: ['body', 'id'])" in capsys.readouterr().err
    # the same run on the .txt of the same documents gives the same streams and losses
    a = Trainer(TrainConfig(model="gla", data=str(jsonl), text_field="body", seq_len=32), tmp_path / "a")
    b = Trainer(TrainConfig(model="gla", data=str(txt), seq_len=32), tmp_path / "b")
    assert torch.equal(a.train_data.ids, b.train_data.ids) and torch.equal(a.val_data.ids, b.val_data.ids)
    assert a.val_chars == b.val_chars
    assert len(a.train_data.doc_starts) == 10 and len(a.val_data.doc_starts) == 2
