"""Regression review of 6ea3d5b (CLI review 4): what its fixes broke or missed. Each test failed
before its fix."""

from __future__ import annotations

import json
import warnings

import pytest

from mnemo.cli import main

#: a tiny capacity sweep (review 4's): two variants, two pair counts, two pass counts
CAPACITY = ["probe", "capacity", "--variants", "matrix_plain,mlp", "--pairs", "4,8", "--passes", "1,2"]
CAPACITY += ["--seeds", "3", "--streams", "3", "--theta-grid", "0.1,1", "--no-progress"]


def test_a_capacity_partial_file_of_other_code_is_not_continued_from(tmp_path, capsys):
    """``capacity.partial.json`` was continued from whenever its settings matched, whatever code
    measured its cells: an interrupted run, then a code update (a fix in the memory, the ops), then
    the same command (or ``mnemo reproduce``, which runs it with --overwrite) mixed the old code's
    cells into the new results, unlike ``mnemo continual``'s kept runs, which are keyed by the
    sources that made them. A partial file that does not name today's code is measured again."""
    from mnemo.commands import capacity as cap

    whole = tmp_path / "whole"
    assert main([*CAPACITY, "--out", str(whole)]) == 0
    want = json.loads((whole / "capacity.json").read_text())["cells"]
    # what an interrupted run of other code left: the same settings, other numbers
    args = cap.parse_command(CAPACITY[2:] + ["--out", str(tmp_path / "o")])
    old = [dict(c, recall=[0.0] * len(c["recall"])) for c in want[:4]]
    out = tmp_path / "o"
    out.mkdir()
    record = {"expected": json.loads(json.dumps(cap._expected_settings(args))), "cells": old}
    (out / cap.PARTIAL_NAME).write_text(json.dumps(record))
    capsys.readouterr()
    assert main([*CAPACITY, "--out", str(out)]) == 0
    assert json.loads((out / "capacity.json").read_text())["cells"] == want
    assert "kept from an interrupted run" not in capsys.readouterr().err


def test_a_partial_file_of_todays_code_is_still_continued_from(tmp_path, capsys, monkeypatch):
    """(The fix above keeps the resume: an interrupt, then the same command, measures only the rest.)"""
    import mnemo.interp.capacity as capacity_lib

    real, calls = capacity_lib.capacity_sweep, []

    def interrupting(variants, n_pairs, passes, *a, **k):
        calls.append((list(n_pairs), list(passes)))
        if stop and len(calls) == 2:
            raise KeyboardInterrupt
        return real(variants, n_pairs, passes, *a, **k)

    monkeypatch.setattr(capacity_lib, "capacity_sweep", interrupting)
    stop = True
    assert main([*CAPACITY, "--out", str(tmp_path / "o")]) == 130
    calls.clear()
    stop = False
    assert main([*CAPACITY, "--out", str(tmp_path / "o"), "--overwrite"]) == 0
    assert calls == [([8], [1]), ([4], [2]), ([8], [2])]
    assert "2 measured cell(s) kept" in capsys.readouterr().err


def test_a_data_folder_warns_once_per_run_not_once_per_process(tmp_path):
    """``RunData(is_main=False)`` (every rank but 0 of a distributed run) is documented as not
    warning ("this process alone warns"), but the new warning about a --data folder's unread
    entries came from every rank: N copies under torchrun."""
    from mnemo.train import TrainConfig
    from mnemo.train.batches import RunData

    (tmp_path / "a.txt").write_text("some words of text to train on. " * 40)
    (tmp_path / "notes.md").write_text("not read")
    cfg = TrainConfig(model="gla", model_overrides={"d_model": 32, "n_layers": 1}, seq_len=16, batch_size=4)
    cfg.data = str(tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        RunData(cfg, is_main=False)
    assert not [w for w in seen if "not read" in str(w.message)]
    with pytest.warns(UserWarning, match="notes.md"):  # rank 0 still says it
        RunData(cfg, is_main=True)


def test_tokenizer_pieces_are_not_cut_at_characters_the_pre_tokenizer_does_not_call_whitespace(monkeypatch):
    """``_chunks`` cuts before a whitespace character (``str.isspace``) that a word follows, so that
    the pieces split into the words of the whole document; but ``str.isspace`` also holds for the
    separators U+001C..U+001F, which the byte-level pre-tokenizer's ``\\s`` does not: a cut there
    split one pre-tokenizer word (" \\x1c") into two, and the counts differed."""
    pytest.importorskip("tokenizers")
    from tokenizers import pre_tokenizers

    import mnemo.commands.tokenizer as tok_cmd

    monkeypatch.setattr(tok_cmd, "_CHUNK", 8)
    doc = "ab cd \x1cef gh ij kl mn"
    pieces = list(tok_cmd._chunks([doc]))
    assert "".join(pieces) == doc
    pt = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = [w for w, _ in pt.pre_tokenize_str(doc)]
    assert [w for p in pieces for w, _ in pt.pre_tokenize_str(p)] == words
