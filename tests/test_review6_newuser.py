"""Sixth new-user review (README, docs/guides, ``mnemo --help``): each test is a defect a first-day
user met by following the docs, failing before its fix."""

from __future__ import annotations

import pytest

from mnemo.cli import main
from tests.helpers import fast_train_flags


@pytest.mark.parametrize("pattern", ["**/*.jsonl", "*/*.jsonl", "**/*.json"])
def test_train_refuses_an_out_folder_its_data_glob_would_read(tmp_path, capsys, monkeypatch, pattern):
    """``mnemo train --data "corpus/**/*.jsonl" --out corpus/run`` trained, but the glob then matched
    the run's own ``metrics.jsonl`` (or a checkpoint's ``config.json`` for ``*.json``): ``--resume``
    and ``mnemo eval`` of the run failed on "records ... have no field 'text'" (or read its logs as
    text). Now --out is refused up front, naming both flags, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus"
    (corpus / "part").mkdir(parents=True)
    (corpus / "part" / "a.jsonl").write_text('{"text": "hello world, this is text."}\n' * 300)
    (corpus / "part" / "a.json").write_text('[{"text": "hello world, this is text."}]')
    data = f"corpus/{pattern}"
    argv = ["train", "--model", "gla", "--tokenizer", "byte", "--data", data, *fast_train_flags(16, 2)]
    assert main([*argv, "--out", "corpus/run"]) == 2
    err = capsys.readouterr().err
    assert "--out: corpus/run is where --data '" in err and f"{data}' reads" in err, err
    assert err.count("\n") == 1, err
    assert not (corpus / "run").exists(), "nothing written"


def test_an_out_folder_beside_a_data_glob_still_trains(tmp_path, monkeypatch):
    """The check refuses only what the glob reads: a run beside the corpus trains (and a hidden
    folder is not matched by ``**``, as glob does not descend into it)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "hello world, this is text."}\n' * 300)
    argv = ["train", "--model", "gla", "--tokenizer", "byte", *fast_train_flags(16, 2)]
    assert main([*argv, "--data", "corpus/**/*.jsonl", "--out", "corpus/.run"]) == 0
    assert main([*argv, "--data", "corpus/**/*.jsonl", "--out", "runs/x"]) == 0
    assert main([*argv, "--data", "corpus/*.jsonl", "--out", "corpus/run"]) == 0  # */ is not read
