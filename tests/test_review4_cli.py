"""Fourth break-it review of the command line (mnemo.cli, mnemo.argtypes, mnemo.commands and the
data-folder reading): each test is a defect found by the review, failing before its fix."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import mnemo.interp.capacity as capacity_lib
from mnemo.cli import main

#: a tiny capacity sweep: two variants, two pair counts, two pass counts (4 jobs of 2 cells)
CAPACITY = ["probe", "capacity", "--variants", "matrix_plain,mlp", "--pairs", "4,8", "--passes", "1,2"]
CAPACITY += ["--seeds", "3", "--streams", "3", "--theta-grid", "0.1,1", "--no-progress"]


def test_an_interrupted_capacity_probe_keeps_its_measured_cells_and_continues_from_them(
    tmp_path, capsys, monkeypatch
):
    """``mnemo probe capacity`` interrupted (Ctrl-C) threw away every cell it had measured and
    said nothing of where; now they are saved in --out and the same command measures only the
    rest, with the results of an uninterrupted run."""
    whole = tmp_path / "whole"
    assert main([*CAPACITY, "--out", str(whole)]) == 0
    want = json.loads((whole / "capacity.json").read_text())
    real, calls = capacity_lib.capacity_sweep, []

    def interrupting(variants, n_pairs, passes, *a, **k):
        calls.append((list(variants), list(n_pairs), list(passes)))
        if stop_at and len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(variants, n_pairs, passes, *a, **k)

    monkeypatch.setattr(capacity_lib, "capacity_sweep", interrupting)
    out = tmp_path / "cut"
    stop_at = 3  # two (N, passes) jobs done, the third interrupted
    capsys.readouterr()
    assert main([*CAPACITY, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    partial = out / "capacity.partial.json"
    assert str(partial) in err and "4 measured cell(s) of 8" in err
    assert not (out / "capacity.json").exists()
    calls.clear()
    stop_at = 0
    assert main([*CAPACITY, "--out", str(out)]) == 0
    assert [c[1:] for c in calls] == [([4], [2]), ([8], [2])]  # the interrupted job and the one after
    got = json.loads((out / "capacity.json").read_text())
    assert got["cells"] == want["cells"]
    assert {k: v for k, v in got["settings"].items() if k != "threads"} == {
        k: v for k, v in want["settings"].items() if k != "threads"
    }
    assert not partial.exists()


def test_a_capacity_probe_interrupted_before_any_cell_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    def interrupting(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(capacity_lib, "capacity_sweep", interrupting)
    assert main([*CAPACITY, "--out", str(tmp_path / "o")]) == 130
    assert "nothing was written" in capsys.readouterr().err
    assert not (tmp_path / "o" / "capacity.partial.json").exists()


#: the smallest continual command (review 3's): one experiment, two models, one seed, two steps
CONTINUAL = ["continual", "--experiment", "abab", "--models", "cms-1,cms-2", "--periods", "1,4"]
CONTINUAL += ["--seeds", "1", "--steps", "2", "--eval-streams", "4", "--workers", "1", "--no-progress"]


def test_a_continual_out_folder_in_use_by_another_process_is_refused(tmp_path, capsys):
    """Two ``mnemo continual`` runs on one --out wrote the same runs/ and results at once; the
    folder is now locked as ``mnemo train``'s run folder is (the lock names its holder)."""
    import fcntl

    out = tmp_path / "c"
    out.mkdir()
    holder = open(out / ".continual.lock", "a+")
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.write("4242\n")
    holder.flush()
    try:
        assert main([*CONTINUAL, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another" in err and "(pid 4242)" in err
    finally:
        holder.close()
    assert sorted(p.name for p in out.iterdir()) == [".continual.lock"]  # nothing trained, nothing written
    assert main([*CONTINUAL, "--out", str(out)]) == 0  # the holder went: the folder is free
    assert (out / "continual.json").is_file() and not (out / ".continual.lock").exists()


@pytest.mark.parametrize("newlines", [False, True])
@pytest.mark.parametrize("chunk", [12, 50, None])
def test_tokenizer_training_pieces_split_a_document_into_the_words_the_whole_document_has(
    chunk, newlines, monkeypatch
):
    """``mnemo tokenizer train`` cut a newline-free document every 65,536 characters, mid-word: the
    trainer counted two halves of a word (and a word without its leading space) that the text does
    not hold. The pieces now pre-tokenize into exactly the whole document's words."""
    tk = pytest.importorskip("tokenizers")
    import mnemo.commands.tokenizer as tok_cmd

    if chunk is not None:
        monkeypatch.setattr(tok_cmd, "_CHUNK", chunk)
    words = ["alpha", "be", "gamma12", "d", "it's", "épsilon", "zz!?"]
    seps = [" ", "  ", " ", "\n", " ", "\n\n", "\t ", " "] if newlines else [" ", "  ", " ", "\t "]
    n = 3 * tok_cmd._CHUNK // 6 + 40
    doc = "".join(words[i % len(words)] + seps[i % len(seps)] for i in range(n))
    pieces = list(tok_cmd._chunks([doc]))
    assert "".join(pieces) == doc and len(pieces) >= 3
    assert max(map(len, pieces)) <= tok_cmd._CHUNK
    pre = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    whole = [w for w, _ in pre.pre_tokenize_str(doc)]
    assert [w for p in pieces for w, _ in pre.pre_tokenize_str(p)] == whole


def test_tokenizer_training_pieces_of_text_without_whitespace_are_cut_at_the_piece_size(monkeypatch):
    import mnemo.commands.tokenizer as tok_cmd

    monkeypatch.setattr(tok_cmd, "_CHUNK", 10)
    assert list(tok_cmd._chunks(["a" * 25, "b c"])) == ["a" * 10, "a" * 10, "a" * 5, "b c"]


def test_a_data_folder_names_the_entries_it_does_not_read(tmp_path):
    """A --data folder silently left out files of other extensions (notes.md, a .csv) and its
    subfolders: a corpus smaller than the folder with no word of it. A warning now names them."""
    from mnemo.data import load_corpus

    folder = tmp_path / "corpus"
    (folder / "deeper").mkdir(parents=True)
    (folder / "a.txt").write_text("read me")
    (folder / "notes.md").write_text("not read")
    (folder / "table.csv").write_text("x,y")
    (folder / "deeper" / "b.txt").write_text("not read either")
    (folder / ".hidden").write_text("hidden files stay unsaid")
    with pytest.warns(
        UserWarning, match=r"3 entries of the folder not read .*: deeper/, notes\.md, table\.csv$"
    ):
        corpus = load_corpus(str(folder))
    assert corpus.documents == ["read me"]


def test_a_data_folder_of_known_files_only_reads_without_a_warning(tmp_path, recwarn):
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.txt.gz").write_bytes(__import__("gzip").compress(b"two"))
    from mnemo.data import load_corpus

    assert load_corpus(str(tmp_path)).documents == ["one", "two"]
    assert not [w for w in recwarn if "not read" in str(w.message)]


def test_a_data_folder_where_nothing_is_read_is_refused_naming_it_and_the_cli_says_what_it_skipped(
    tmp_path, capsys
):
    folder = tmp_path / "only_md"
    folder.mkdir()
    (folder / "notes.md").write_text("x")
    assert (
        main(
            ["tokenizer", "train", "--data", str(folder), "--vocab-size", "300", "--out", str(tmp_path / "t")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"the folder {str(folder)!r} holds none" in err
    (folder / "a.txt").write_text("some text to learn from " * 20)
    argv = ["tokenizer", "train", "--data", str(folder), "--vocab-size", "300", "--out", str(tmp_path / "t")]
    with pytest.warns(UserWarning, match=r"1 entry of the folder not read .*: notes\.md$") as seen:
        assert main(argv) == 0
    assert len([w for w in seen if "not read" in str(w.message)]) == 1  # said once


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
    """A tiny transformer (rotary attention) trained on windows of 32 tokens."""
    out = tmp_path_factory.mktemp("rope") / "run"
    argv = ["train", "--model", "transformer", "--out", str(out), "--steps", "2", "--seq-len", "32"]
    argv += ["--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1", "--d-model", "32"]
    assert main([*argv, "--n-layers", "1", "--sample-tokens", "0", "--no-progress"]) == 0
    return out


def test_eval_yarn_advice_on_beta_fast_names_a_flag_that_sets_it(rope_run, capsys):
    """``mnemo eval --yarn`` on a short training context warned "choose beta_fast <= L / 2π", but
    no flag set beta_fast. --yarn-beta-fast / --yarn-beta-slow now do, and the advice names it."""
    argv = ["eval", "--checkpoint", str(rope_run), "--yarn", "--length", "64,96"]
    with pytest.warns(UserWarning, match=r"choose beta_fast \(--yarn-beta-fast\) <= L / 2π = 5\.09") as seen:
        assert main(argv) == 0
    assert len([w for w in seen if "beta_fast" in str(w.message)]) == 1  # once, not once per length
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # beta_fast 4 <= 32 / 2π: no advice
        assert main([*argv, "--yarn-beta-fast", "4", "--yarn-beta-slow", "0.5"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["rope_scaling"] for r in lines] == [
        {
            "rope_type": "yarn",
            "factor": L / 32,
            "original_max_position_embeddings": 32,
            "beta_fast": 4.0,
            "beta_slow": 0.5,
            "attention_factor": None,
        }
        for L in (64, 96)
    ]


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--yarn", "--yarn-beta-fast", "2", "--yarn-beta-slow", "3"], "expected beta_slow < beta_fast"),
        (["--yarn-beta-fast", "4"], "pass --yarn too"),
        (["--yarn", "--yarn-beta-fast", "0"], "argument --yarn-beta-fast: expected"),
    ],
)
def test_eval_yarn_ramp_flags_are_checked_naming_the_flag(rope_run, capsys, extra, says):
    assert main(["eval", "--checkpoint", str(rope_run), "--length", "64", *extra]) == 2
    err = capsys.readouterr().err
    assert "--yarn-beta-fast" in err and says in err


def _every_parser():
    import argparse

    from mnemo.cli import build_parser
    from mnemo.commands import harness, verify

    todo, seen = [("mnemo", build_parser()), ("mnemo harness", harness.build_parser())], set()
    todo.append(("mnemo verify", verify.build_parser()))
    while todo:
        name, p = todo.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", sp) for sub, sp in a.choices.items()]


def test_no_help_page_shows_restructuredtext_markup():
    """``--help`` is plain text, but the descriptions of verify, convert, export, harness and
    tokenizer train (their module docstrings) showed ``double backticks`` and :data:`roles`."""
    import re

    rst = re.compile(r"``|:(?:[a-z]+:)?(?:data|func|class|meth|mod|attr|ref|doc|obj|exc|math|envvar):`")
    pages = dict(_every_parser())
    assert {
        "mnemo verify",
        "mnemo convert",
        "mnemo export",
        "mnemo tokenizer train",
        "mnemo probe capacity",
    } <= set(pages)
    bad = {}
    for name, p in pages.items():
        text = " ".join(p.format_help().split())
        found = rst.findall(text)
        if found:
            bad[name] = found
    assert bad == {}
    verify_help = " ".join(pages["mnemo verify"].format_help().split())
    assert "(mnemo.testing.SPECS:" in verify_help  # the role's target is kept, as text


def test_plain_text_turns_roles_and_literals_into_their_text():
    from mnemo.argtypes import plain_text

    assert plain_text("see :mod:`mnemo.hf.convert` and :func:`~mnemo.data.load_corpus`") == (
        "see mnemo.hf.convert and load_corpus"
    )
    assert plain_text('``mode="recurrent"`` loop, :py:class:`x.Y`') == 'mode="recurrent" loop, x.Y'


def test_an_interrupted_bench_suite_all_keeps_the_rows_of_its_finished_suites(tmp_path, capsys, monkeypatch):
    """``mnemo bench --suite all --json F`` gathered each suite's rows in a temporary folder and
    wrote F only at the end: an interrupt in the models suite (the last, longest) lost the ops,
    peers and decode rows it had measured. They are now written, the unfinished suites null."""
    import mnemo.commands.bench as bench_cmd

    def fake_suite(a):
        if a.suite == "decode":
            raise KeyboardInterrupt
        Path(a.json).write_text(json.dumps([{"suite": a.suite, "ms": 1.5}]))
        return 0

    monkeypatch.setattr(bench_cmd, "_run_suite", fake_suite)
    out = tmp_path / "b" / "all.json"
    assert main(["bench", "--suite", "all", "--json", str(out)]) == 130
    assert f"(ops, peers) are saved in {out}" in capsys.readouterr().err
    assert json.loads(out.read_text()) == {
        "ops": [{"suite": "ops", "ms": 1.5}],
        "peers": [{"suite": "peers", "ms": 1.5}],
        "decode": None,
        "models": None,
    }


@pytest.mark.parametrize("where", ["train", "encode"])
def test_an_interrupted_tokenizer_train_says_whether_the_tokenizer_was_written(
    tmp_path, capsys, monkeypatch, where
):
    """Ctrl-C in ``mnemo tokenizer train`` said only "interrupted": whether tokenizer.json had been
    written (the same command again is then refused without --overwrite) was left to guess."""
    pytest.importorskip("tokenizers")
    import mnemo.commands.tokenizer as tok_cmd
    import mnemo.data.corpus as corpus_mod

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if where == "train":
        monkeypatch.setattr(tok_cmd, "train_tokenizer", interrupt)
    else:
        monkeypatch.setattr(corpus_mod.Corpus, "encode", interrupt)
    (tmp_path / "a.txt").write_text("some words and some more words " * 10)
    out = tmp_path / "tok"
    argv = ["tokenizer", "train", "--data", str(tmp_path / "a.txt"), "--vocab-size", "300", "--out", str(out)]
    assert main(argv) == 130
    err = capsys.readouterr().err
    if where == "train":
        assert f"the tokenizer was not trained: {out} is as it was" in err and not out.exists()
    else:
        assert f"{out / 'tokenizer.json'} is written and complete" in err
        assert (out / "tokenizer.json").is_file()
