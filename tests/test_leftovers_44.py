"""Session 44's leftovers at the command line."""

from __future__ import annotations

import io
import os
import sys

from mnemo.cli import main


def test_a_buffered_output_cut_by_its_reader_is_quiet_too(capsys, monkeypatch):
    # `mnemo models | head -1` without PYTHONUNBUFFERED: the table stayed in stdout's buffer, main
    # returned 0 and the interpreter's exit flush failed (exit 120, "Exception ignored ...
    # BrokenPipeError" on stderr); now the flush is main's and the cut reads as exit 141, quietly
    r, w = os.pipe()
    os.close(r)  # the reader is gone
    cut = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w"), buffer_size=1 << 16))
    monkeypatch.setattr(sys, "stdout", cut)
    try:
        assert main(["models"]) == 141
        cut.flush()  # what Python does at exit
    finally:
        monkeypatch.undo()
        cut.close()
    assert capsys.readouterr().err == ""


def test_char_encode_maps_each_character_by_the_vocabulary_unknowns_to_zero():
    # encode is one array lookup now (it looped over the characters in Python: 0.15 s for the
    # bundled corpus, 0.04 s now); each character's id is still its place in the vocabulary + 1
    from mnemo.data.tokenizer import CharTokenizer

    vocab = ["\n", " ", "a", "é", "😀", "\udc80", "xy"]  # a non-BMP one, a surrogate, a two-char entry
    tok = CharTokenizer(vocab)
    hand = {c: i + 1 for i, c in enumerate(vocab)}
    for text in ("a é\n😀a", "zaq😀€", "", "xy", "a\udc80b"):  # unknowns; a lone surrogate in the text
        assert tok.encode(text).tolist() == [hand.get(c, 0) for c in text], text
        assert tok.encode(text).dtype == __import__("torch").long
    assert tok.unknown_share("zaq😀€") == 3 / 5
    assert CharTokenizer([]).encode("ab").tolist() == [0, 0]


def test_a_corpus_stream_is_its_documents_ids_joined_by_the_separator():
    from mnemo.data.corpus import Corpus
    from mnemo.data.tokenizer import CharTokenizer, document_separator

    docs = ["ab", "ba\n", "c"]
    tok = CharTokenizer(["\n", "a", "b"])
    ids, starts, chars = Corpus(docs, "hand").encode(tok)
    sep = document_separator(tok)[0].tolist()
    want, want_starts = [], []
    for d in docs:
        if want_starts:
            want += sep
        want_starts.append(len(want))
        want += [tok.stoi.get(c, 0) for c in d]
    assert ids.tolist() == want and starts.tolist() == want_starts
    assert chars == sum(map(len, docs)) + 2 * (len(docs) - 1)
