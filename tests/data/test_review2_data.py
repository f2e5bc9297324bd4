"""Second hostile review of the text pipeline, by meaning: a non-text value is refused wherever it
sits (a later file of a folder, a later Parquet file, a pretty-printed JSON object), files whose
records hold different fields read as one file of them does; and, checked by hand, the train/val
split, the windows and their ``cu_seqlens``, the tokenizers' round trips and special ids, the
bundled corpus and the resumable batch stream."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from mnemo.data import ByteTokenizer, CharTokenizer, Corpus, load_corpus, split_text

# ----------------------------------------------------------------------------- defects (fixed)


def test_a_non_text_value_in_a_later_jsonl_file_is_refused(tmp_path):
    """datasets casts every file to the first file's column types: the int of the second file came
    back as the text ``"7"`` (the check for non-text values saw only strings)."""
    pytest.importorskip("datasets")
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n{"text": 7}\n')
    with pytest.raises(
        ValueError, match=r"record 3 \(counting from 1\): field 'text' holds int.*b\.jsonl line 2"
    ):
        load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match=r"field 'text' holds int"):
        load_corpus(str(tmp_path / "*.jsonl"))


def test_one_jsonl_file_past_datasets_10_mb_chunk_is_read_as_it_holds(tmp_path):
    """datasets reads a JSON Lines file in 10 MB chunks cast to the first chunk's types and fields:
    an int past the first chunk came back as the text "7", a field first seen there failed."""
    pytest.importorskip("datasets")
    line = json.dumps({"text": "x" * 1000}) + "\n"
    p = tmp_path / "big.jsonl"
    p.write_text(line * 11_000 + '{"text": 7}\n')
    with pytest.raises(
        ValueError, match=r"record 11001 \(counting from 1\): field 'text' holds int.*line 11001"
    ):
        load_corpus(str(p))
    p.write_text(line * 11_000 + '{"url": "u"}\n{"text": "last"}\n')
    docs = load_corpus(str(p)).documents
    assert len(docs) == 11_001 and docs[-1] == "last"


def test_jsonl_files_whose_records_hold_different_fields_read_as_one_file_of_them(tmp_path):
    """One file of these records reads (a record without the field is skipped, as a null one); the
    same records in two files failed with datasets' ``CastError`` (column names don't match)."""
    pytest.importorskip("datasets")
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "a"}\n')
    (d / "b.jsonl").write_text('{"text": "b", "url": "u"}\n{"url": "v"}\n{"text": "c"}\n')
    one = tmp_path / "one.jsonl"
    one.write_text((d / "a.jsonl").read_text() + (d / "b.jsonl").read_text())
    assert load_corpus(str(one)).documents == ["a", "b", "c"]
    assert load_corpus(str(d)).documents == ["a", "b", "c"]
    assert load_corpus(str(d / "*.jsonl")).documents == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"no field 'body' \(fields present: \['text', 'url'\]\)"):
        load_corpus(str(d), text_field="body")
    # a stray file whose records never hold the field is named, not skipped in silence
    (d / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl' have no field 'text' \(its fields: \['body'\]\)"):
        load_corpus(str(d))
    # records datasets cannot read (an escaped lone surrogate) are refused by name
    (d / "c.jsonl").write_text('{"text": "a\\ud800b"}\n')
    with pytest.raises(ValueError, match=r"field 'text' holds '\\ud800', a lone surrogate.*c\.jsonl line 1"):
        load_corpus(str(d))


def test_a_pretty_printed_json_object_with_a_non_text_value_is_named(tmp_path):
    """datasets reads a ``.json`` file holding one (indented) object as one record; the re-read of a
    non-text value split it into lines and raised a bare ``JSONDecodeError``."""
    pytest.importorskip("datasets")
    p = tmp_path / "one.json"
    p.write_text(json.dumps({"text": ["a", "b"], "id": 1}, indent=2))
    with pytest.raises(ValueError, match=r"record 1 \(counting from 1\): field 'text' holds list.*one\.json"):
        load_corpus(str(p))
    p.write_text(json.dumps({"text": "2024-01-01", "id": 1}, indent=2))
    assert load_corpus(str(p)).documents == ["2024-01-01"]
    # an array of strings is one column "text", as datasets reads it
    p.write_text(json.dumps(["a", "b"]))
    assert load_corpus(str(p)).documents == ["a", "b"]
    p.write_text(json.dumps(["a", 1]))
    with pytest.raises(ValueError, match=r"record 2 \(counting from 1\): field 'text' holds int"):
        load_corpus(str(p))


def test_parquet_files_are_checked_file_by_file(tmp_path):
    """As for JSON: the int column of the second Parquet file was cast to text (``"7"``), and a
    later file with other columns failed."""
    pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a"]}), str(tmp_path / "a.parquet"))
    pq.write_table(pa.table({"text": [7]}), str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError, match=r"field 'text' holds int64, not text.*b\.parquet"):
        load_corpus(str(tmp_path))
    # files with other fields, or without the text field, read as JSON records do (they failed
    # with datasets' CastError: column names don't match)
    pq.write_table(pa.table({"text": ["b"], "url": ["u"]}), str(tmp_path / "b.parquet"))
    assert load_corpus(str(tmp_path)).documents == ["a", "b"]
    with pytest.raises(ValueError, match=r"no field 'body' \(fields present: \['text', 'url'\]\)"):
        load_corpus(str(tmp_path), text_field="body")
    pq.write_table(pa.table({"url": ["v"]}), str(tmp_path / "c.parquet"))
    with pytest.raises(ValueError, match=r"c\.parquet' have no field 'text' \(its fields: \['url'\]\)"):
        load_corpus(str(tmp_path))


# ----------------------------------------------------------------------------- checks that held


def test_split_by_hand_partitions_the_characters():
    # "abc" + "\n\n" + "defgh" = 10 characters; the cut at int(10 * 0.9) = 9 falls inside "defgh"
    train, val = Corpus(["abc", "defgh"]).split()
    assert (train.documents, val.documents) == (["abc", "defg"], ["h"])
    # a cut inside the separator moves to the next document: "ab\n\ncd", cut int(6 * 0.5) = 3
    train, val = Corpus(["ab", "cd"]).split(0.5)
    assert (train.documents, val.documents) == (["ab"], ["cd"])
    # one document: exactly split_text, every run
    text = "hello world, hello again\n" * 7
    for _ in range(2):
        t, v = Corpus([text]).split()
        assert (t.text, v.text) == split_text(text) and t.text + v.text == text
    # many documents: every document's characters go to one side, in order, none twice
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        docs = [
            "xy\n"[int(i)] * int(n)
            for i, n in zip(torch.randint(0, 3, (4,), generator=g), torch.randint(1, 6, (4,), generator=g))
        ]
        for f in (0.1, 0.35, 0.5):
            tr, va = Corpus(docs).split(f)
            T, V = tr.documents, va.documents
            glued = T + V if T + V == docs else T[:-1] + [T[-1] + V[0]] + V[1:]
            assert glued == docs
            assert len(tr.text) <= int(len(Corpus(docs).text) * (1 - f))


def test_windows_targets_and_cu_seqlens_by_hand():
    from mnemo.train.batches import packed_logits

    docs = ["abcde", "fg", "hijklmnop", "q", "rstuvwxyz"]
    corpus = Corpus(docs)
    tok = CharTokenizer.from_text(corpus.text)
    s = corpus.stream(tok, 4)
    assert tok.decode(s.ids) == "\n\n".join(docs)
    assert s.doc_starts.tolist() == [0, 7, 11, 22, 25]
    assert s.num_chars == len("\n\n".join(docs))
    g = torch.Generator().manual_seed(3)
    x, y, first = s.sample(16, g, with_documents=True)
    starts = torch.randint(0, s.ids.numel() - 4, (16,), generator=torch.Generator().manual_seed(3))
    begins = set(s.doc_starts.tolist())
    for b, p in enumerate(starts.tolist()):
        assert x[b].tolist() == s.ids[p : p + 4].tolist()
        assert y[b].tolist() == s.ids[p + 1 : p + 5].tolist()  # each target the next token
        assert first[b].tolist() == [t == 0 or p + t in begins for t in range(4)]

    class Recorder:
        def __call__(self, ids, cu_seqlens=None):
            self.cu = cu_seqlens
            return torch.zeros(1, ids.shape[1], 2), None

    m = Recorder()
    packed_logits(m, x, first)
    expect = sorted({b * 4 + t for b in range(16) for t in range(4) if first[b, t]} | {64})
    assert m.cu.tolist() == expect
    # every window start is reachable, the last one ends at the stream's last token
    assert s.ids.numel() - 4 - 1 == int(torch.randint(0, s.ids.numel() - 4, (4000,)).max())
    ev = list(s.eval_batches(3))
    xs = torch.cat([e[0] for e in ev])
    assert xs.shape == ((s.ids.numel() - 1) // 4, 4)
    assert torch.equal(xs.flatten(), s.ids[: xs.numel()])


@pytest.mark.parametrize(
    "text", ["", "\n", "\r\n\r\n", "héllo ☃ 😀\u200d👩", "a\u2028b\x85c", "  x  ", "\t\x00", "e\u0301"]
)
def test_byte_and_char_tokenizers_round_trip(text):
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text
    tok = CharTokenizer.from_text(text + "z")
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text).dtype == torch.long and tok.encode(text).shape == (len(text),)
    # a character outside the vocabulary is <unk> (id 0), decoded as U+FFFD
    assert tok.encode("Q").tolist() == [0] and tok.decode(tok.encode("Qz")) == "\ufffdz"


def test_trained_bpe_round_trips_and_keeps_its_end_of_text_id(tmp_path):
    pytest.importorskip("tokenizers")
    from mnemo.commands.tokenizer import EOT, train_tokenizer
    from mnemo.data import HFTokenizer, load_tokenizer

    text = load_corpus("tinyshakespeare").text[:20_000]
    for kind in ("bpe", "unigram"):
        tok = HFTokenizer(train_tokenizer([text], 300, kind))
        for s in ["", "\n\n", "héllo ☃ 😀", "  two  spaces\r\n", EOT]:
            assert tok.decode(tok.encode(s)) == s
        assert tok.eot_id == 0 and tok.encode(EOT).tolist() == [0]
        tok.save(tmp_path)
        again = load_tokenizer(tmp_path)
        assert again.eot_id == 0 and again.vocab_size == tok.vocab_size
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        assert config["eos_token"] == EOT
        (tmp_path / "tokenizer_config.json").unlink()
        ids, starts, _ = Corpus(["ab", "cd"]).encode(tok)
        assert ids[starts[1] - 1].item() == 0  # the separator before document 2 is the eot id


def test_bundled_corpus_loads_offline_and_matches_the_shared_copy():
    c = load_corpus("tinyshakespeare")
    assert len(c) == 1 and c.documents[0].startswith("First Citizen:")
    assert len(c.documents[0]) > 1_000_000


def test_the_batch_stream_resumes_from_the_generator_state(tmp_path):
    from mnemo.train import TrainConfig
    from mnemo.train.batches import RunData

    pytest.importorskip("datasets")
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": f"document {i} " * (i % 5 + 1)}) + "\n" for i in range(40)))
    cfg = TrainConfig(data=str(p), tokenizer="char", seq_len=8, batch_size=3, pack_documents=True)
    data = RunData(cfg)
    g = data.batch_generator()
    for step in range(2):
        data.next_batch(step, g)
    state = g.get_state()
    run = [data.next_batch(step, g) for step in range(2, 6)]
    g2 = torch.Generator()
    g2.set_state(state)
    resumed = [RunData(cfg).next_batch(step, g2) for step in range(2, 6)]
    for a, b in zip(run, resumed):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    # train and validation streams hold the two sides of the split, nothing twice
    train, val = load_corpus(str(p)).split()
    assert torch.equal(data.train_data.ids, train.stream(data.tokenizer, 8).ids)
    assert torch.equal(data.val_data.ids, val.stream(data.tokenizer, 8).ids)


def test_blank_and_bad_line_checks_read_at_constant_memory(tmp_path):
    pytest.importorskip("datasets")
    from mnemo.data.corpus import _blank, _first_bad_json_line

    peaks = []
    for n in (2_000, 8_000):
        p = tmp_path / f"f{n}.jsonl"
        line = json.dumps({"text": "x" * 1000}) + "\n"
        p.write_text(line * n)
        blank = tmp_path / f"b{n}.jsonl"
        blank.write_text(" \n" * (n * 500))
        tracemalloc.start()
        assert _first_bad_json_line([p]) is None and _blank(blank)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    # 2 MB vs 8 MB files: the peak stays at about one 1 MiB chunk
    assert max(peaks) < 3 * 2**20
