"""Regression review 42b of b994f63 (data globs refused for matching training runs' files) and the
continual part of f9f62d3 (the exact t quantile): what the fixes broke or missed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def test_a_corpus_folder_named_latest_is_no_run_marker(tmp_path, monkeypatch):
    """A Wikipedia dump keeps its files in ``enwiki/latest/``: ``is_run_folder`` took the folder
    ``latest`` for a run's ``latest`` file, so ``dumps/**/*.txt`` was refused as "files of training
    run folders (their logs and checkpoints)", naming the corpus text itself."""
    from mnemo.data.corpus import _files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dumps" / "enwiki" / "latest").mkdir(parents=True)
    (tmp_path / "dumps" / "enwiki" / "latest" / "a.txt").write_text("some text")
    want = [Path("dumps/enwiki/latest/a.txt")]
    assert _files("dumps/**/*.txt") == want
    assert _files("dumps/enwiki/*/*.txt") == want
    # a real run's marker files are still found (a run beside the dump)
    (tmp_path / "dumps" / "run").mkdir()
    (tmp_path / "dumps" / "run" / "latest").write_text("ckpt-000001\n")
    (tmp_path / "dumps" / "run" / "notes.txt").write_text("log")
    with pytest.raises(ValueError, match=re.escape("dumps/run/notes.txt")):
        _files("dumps/**/*.txt")


def test_run_files_looks_at_each_folder_once_not_each_file(tmp_path, monkeypatch):
    """The run-folder check cost a walk of each matched file's parents and a checkpoint_around per
    file (as long as the glob itself on 20k files): the answer is the same for every file of one
    folder, so a large corpus tree pays per folder."""
    import mnemo.argtypes as argtypes
    from mnemo.data.corpus import run_files

    files = []
    for d in range(3):
        folder = tmp_path / "corpus" / f"d{d}"
        folder.mkdir(parents=True)
        for i in range(50):
            (folder / f"{i}.txt").write_text("x")
            files.append(folder / f"{i}.txt")
    calls = []
    real = argtypes.checkpoint_around
    monkeypatch.setattr(argtypes, "checkpoint_around", lambda p: calls.append(p) or real(p))
    assert run_files(str(tmp_path / "corpus" / "**" / "*.txt"), files) == []
    assert len(calls) <= 3, len(calls)


@pytest.mark.parametrize(
    "folder, experiment, model, metric, published",
    [
        ("continual_forgetting_mqar", "forgetting_mqar", "flat-3", "loss_fall_last_fifth", "0.883 ± 0.284"),
        ("continual_64keys_capped", "abab", "flat-3-rates", "loss_fall_last_fifth", "0.216 ± 0.125"),
        ("continual_class_incremental_capped", "class_incremental", "cms-3", "BWT", "-0.517 ± 0.078"),
    ],
)
def test_the_continual_page_quotes_the_exact_t_intervals(folder, experiment, model, metric, published):
    """f9f62d3 replaced continual's 3-decimal t table (4.303 for three seeds) by the exact quantile
    (4.30265): ``mnemo reproduce docs/results/continual.md --no-run`` now rebuilds these three cells
    0.001 lower than the page published them (and the prose quoted the BWT one)."""
    from mnemo.bench import loads_json
    from mnemo.commands.continual import summarise

    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    stored = loads_json((results / folder / "continual.json").read_text())["experiments"][experiment]
    s = summarise(stored["models"][model]["per_seed"], [metric])[metric]
    cell = f"{s['mean']:.3f} ± {s['ci95']:.3f}"
    assert cell != published  # the exact quantile moves the last digit
    page = (results / "continual.md").read_text()
    assert f"| {cell} |" in page and f"| {published} |" not in page
    assert published.replace("-", "−") not in page  # the prose quotes the block's numbers


def test_train_refuses_an_out_holding_the_data_globs_files_up_front(tmp_path, capsys):
    """``--data 'corpus/*.txt' --out corpus``: the run warned that its files "go beside" a.txt, took
    the folder's lock, then refused its own corpus file as "a file of training run folders (their
    logs and checkpoints, not text)" (b994f63's rule: the folder holds the run's .lock). The folder
    twin (``--data corpus --out corpus``) is refused up front naming --out; so is the glob now."""
    from mnemo.cli import main
    from tests.helpers import fast_train_flags

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("hello world, this is text. " * 200)
    (corpus / "sub" / "b.txt").write_text("more text")
    flags = ["train", "--model", "gla", *fast_train_flags(16, 2)]
    for data, out in ((corpus / "*.txt", corpus), (corpus / "**" / "*.txt", corpus / "sub")):
        assert main([*flags, "--data", str(data), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        held = corpus / ("a.txt" if out == corpus else "sub/b.txt")
        assert f"--out: {out} holds files that --data {str(data)!r} reads ({held})" in err, err
        assert "training run folders" not in err and "warning" not in err, err
    assert sorted(p.name for p in corpus.rglob("*")) == ["a.txt", "b.txt", "sub"], "nothing written"
