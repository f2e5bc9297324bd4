"""Break-it review of the argument layer (mnemo.argtypes, mnemo.cli, the tokenizer, sweep and
harness commands): each test is a defect found by the review, failing before its fix."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sqlite3

import pytest

from mnemo import argtypes as kinds
from mnemo.cli import build_parser, main


def _one_line(err: str, flag: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"argument {flag}: expected" in lines[0], err
    return lines[0]


def test_a_path_the_file_system_cannot_look_at_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """A name longer than the file system allows (ENAMETOOLONG) or a loop of symbolic links made
    the path kinds raise OSError / RuntimeError from inside argparse: a traceback, exit status 1.
    Now the flag's usual one-line refusal, status 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "s.yaml").write_text("name: s\nmodels: [gla]\n")
    long = "a" * 300
    tok = ["tokenizer", "train", "--data", "a.txt", "--vocab-size", "300"]
    parser = build_parser()  # (parsed, not run: `main` would import every library first)
    for argv, flag, why in (
        ([*tok, "--out", long], "--out", "File name too long"),
        ([*tok, "--out", "loop/x"], "--out", "a loop of symbolic links"),
        (["sweep", long], "config", "File name too long"),
        (["sweep", "s.yaml", "--db", f"{long}.sqlite"], "--db", "File name too long"),
        (["harness", "--checkpoint", long, "--tasks", "x"], "--checkpoint", "File name too long"),
    ):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2, argv
        assert f"({why})" in _one_line(capsys.readouterr().err, flag)
    assert not any(p.name.startswith("a" * 10) for p in tmp_path.iterdir())


def test_cuda_with_an_empty_or_non_ascii_index_is_no_device(monkeypatch):
    """``--device cuda:`` was accepted on a machine with CUDA (torch then fails on it at the first
    tensor) and refused for the wrong reason ("no CUDA device") on one without."""
    import torch

    with pytest.raises(argparse.ArgumentTypeError) as e:
        kinds.device("cuda:")
    assert str(e.value) == "expected 'cpu', 'cuda' or 'cuda:N', got 'cuda:'"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for bad in ("cuda:", "cuda:\u0661", "cuda: 1"):
        with pytest.raises(argparse.ArgumentTypeError):
            kinds.device(bad)
    assert kinds.device("cuda:1") == "cuda:1" and kinds.device("cuda") == "cuda"


def test_a_sweep_files_out_inside_a_training_run_is_refused_like_the_flag(tmp_path, capsys):
    """``--out RUN/sweeps`` was refused (the run's --overwrite discards what its folder holds) but
    ``out: RUN/sweeps`` in the sweep file was not: the sweep trained its runs inside the run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"name: s\nmodels: [gla]\nmetric: val_loss\ngrid: {{lr: [0.001]}}\nout: {run / 'sweeps'}\n"
        f"db: {tmp_path / 's.sqlite'}\n"
    )
    assert main(["sweep", str(spec), "--list"]) == 2
    err = capsys.readouterr().err
    assert f"{spec}: out: expected a folder to write into" in err and f"inside the training run {run}," in err
    assert not (run / "sweeps").exists()


def test_the_tokenizer_hint_is_a_command_that_trains_on_the_same_text(tmp_path, capsys):
    """``train with: mnemo train --tokenizer DIR --data FILE`` left out ``--text-field`` (the
    suggested command then failed: "the records have no field 'text'") and did not quote its
    paths (a space or a glob split or expanded by the shell)."""
    pytest.importorskip("tokenizers")
    data = tmp_path / "my docs.jsonl"
    data.write_text("".join(json.dumps({"body": f"the quick brown fox {i}\n"}) + "\n" for i in range(20)))
    out = tmp_path / "tok dir"
    argv = ["tokenizer", "train", "--data", str(data), "--text-field", "body", "--vocab-size", "260"]
    assert main([*argv, "--out", str(out)]) == 0
    hint = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("train with: "))
    words = shlex.split(hint.removeprefix("train with: "))
    assert words[:2] == ["mnemo", "train"]
    args = build_parser().parse_args(words[1:])
    assert (args.tokenizer, args.data, args.text_field) == (str(out), str(data), "body")


def test_harness_model_args_with_an_empty_value_are_refused():
    """``--model-args max_length=`` (or ``dtype=``) ran with the default, the option silently
    dropped: the mnemo model reads an empty value as "not given"."""
    from mnemo.commands.harness import parse_model_args

    for text in ("max_length=", "dtype= ", "rolling=state,max_gen_toks="):
        with pytest.raises(ValueError, match="has no value"):
            parse_model_args(text)
    assert parse_model_args("max_length=64, rolling=state") == {"max_length": "64", "rolling": "state"}


def test_another_programs_sqlite_database_is_refused_and_left_as_it_is(tmp_path, capsys):
    """``mnemo report OTHER.sqlite`` added the sweep tables to another program's SQLite database
    (a read-only command that writes), and one with a ``runs`` table of other columns ended in
    ``sqlite3.OperationalError``'s traceback. ``mnemo sweep --db`` would have filled it with runs."""
    other, clash = tmp_path / "other.sqlite", tmp_path / "clash.db"
    for path, table in ((other, "notes(x)"), (clash, "runs(id, name)")):
        with sqlite3.connect(path) as conn:
            conn.execute(f"CREATE TABLE {table}")
        conn.close()
    before = {p: p.read_bytes() for p in (other, clash)}
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmodels: [gla]\nmetric: val_loss\ngrid: {lr: [0.001]}\n")
    for argv, said in (
        (["report", str(other), "--out", str(tmp_path / "rep")], "its tables: notes"),
        (["report", str(clash), "--out", str(tmp_path / "rep")], "its table 'runs' has no column"),
        (["sweep", str(spec), "--db", str(other), "--out", str(tmp_path / "o"), "--list"], "its tables"),
        (["sweep", str(spec), "--db", str(clash), "--out", str(tmp_path / "o")], "has no column 'cell'"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is an SQLite database but not a sweep's" in err and said in err, err
    assert {p: p.read_bytes() for p in (other, clash)} == before
    assert not (tmp_path / "rep").exists() and not (tmp_path / "o").exists()


def test_a_path_that_is_there_but_of_no_kind_asked_is_not_called_missing(tmp_path):
    """A pipe (``mnemo sweep <(...)`` gives ``/dev/fd/63``) or a device was refused as "(not
    found)", though it is there: it is no regular file (nor a folder)."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for kind, why in (
        (kinds.ExistingFile(), "(not a regular file)"),
        (kinds.ExistingDir(), "(not a folder)"),
    ):
        for path in (str(fifo), os.devnull):
            with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
                kind(path)
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape("(not found)")):
            kind(str(tmp_path / "nothing"))


def test_a_flag_the_kind_does_not_take_is_refused_before_the_corpus_is_read(tmp_path, capsys):
    """``--kind unigram --min-frequency 3`` was refused only after the whole corpus was read (a
    folder of Parquet files: minutes); now first, as the flags' other checks are."""
    pytest.importorskip("tokenizers")
    argv = ["tokenizer", "train", "--data", str(tmp_path / "corpus-not-read.txt"), "--vocab-size", "300"]
    assert main([*argv, "--kind", "unigram", "--min-frequency", "3", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "--min-frequency applies to --kind bpe only" in err and "corpus-not-read" not in err, err
    assert not (tmp_path / "t").exists()


def test_a_tokenizer_is_not_written_into_the_corpus_folder_it_reads(tmp_path, capsys, monkeypatch):
    """``--data corp --out corp`` wrote tokenizer.json and tokenizer_config.json among the corpus's
    text files: the folder then read as "files of mixed formats" (the printed ``mnemo train
    --tokenizer corp --data corp`` failed), or, for a JSON corpus, with the tokenizer as a record."""
    pytest.importorskip("tokenizers")
    monkeypatch.chdir(tmp_path)
    corp = tmp_path / "corp"
    corp.mkdir()
    (corp / "a.txt").write_text("hello there world\n")
    for out in ("corp", "corp/", "./corp/../corp", str(corp)):
        argv = ["tokenizer", "train", "--data", "corp", "--vocab-size", "260", "--out", out]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is the --data folder" in err, err
    assert sorted(p.name for p in corp.iterdir()) == ["a.txt"]


def test_the_sweeps_report_hint_quotes_the_database(tmp_path, capsys, monkeypatch):
    """``try: mnemo report runs/my sweeps/s.sqlite``: the path unquoted, the command pasted back
    names two arguments."""
    import mnemo.sweep.runner as runner

    counts = {"total": 1, "skipped": 0, "ran": 1, "done": 1, "diverged": 0, "failed": 0}
    monkeypatch.setattr(runner, "run_sweep", lambda *a, **k: counts)  # (the hint, not the training)
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmodels: [gla]\nmetric: val_loss\ngrid: {lr: [0.001]}\n")
    db = tmp_path / "my sweeps" / "s.sqlite"
    assert main(["sweep", str(spec), "--db", str(db), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    hint = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("try: "))
    assert shlex.split(hint.removeprefix("try: ")) == ["mnemo", "report", str(db)]


def test_the_harness_seed_is_refused_where_numpy_would_refuse_it(tmp_path, capsys):
    """``mnemo harness --seed 4294967296`` was accepted (a torch seed may be 63 bits) and failed
    after the model and the tasks were loaded with numpy's "Seed must be between 0 and 2**32 - 1",
    no flag named: lm-eval seeds numpy with it too."""
    parser = build_parser()
    argv = ["harness", "--checkpoint", str(tmp_path), "--tasks", "x", "--seed"]
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*argv, str(2**32)])
    assert e.value.code == 2
    assert "in [0, 4294967295], got '4294967296'" in _one_line(capsys.readouterr().err, "--seed")
    assert parser.parse_args([*argv, str(2**32 - 1)]).seed == 2**32 - 1


def test_force_with_from_dcp_is_refused_not_ignored(tmp_path, capsys):
    """``--from-dcp`` adds a checkpoint to the run folder OUT and replaces nothing: ``--force`` had
    no effect there and was silently accepted."""
    from mnemo.cli import main

    src = tmp_path / "src"
    src.mkdir()
    assert main(["convert", "--from-dcp", str(src), str(tmp_path / "out"), "--force"]) == 2
    assert "--force: does not apply to --from-dcp" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("var", ["MNEMO_MALLOC_TUNE", "MNEMO_NATIVE"])
def test_a_mistyped_switch_in_the_environment_is_one_line_before_any_work(var, monkeypatch, capsys):
    from mnemo.cli import main

    monkeypatch.setenv(var, "maybe")
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert f"error: {var} must be one of" in err and "Traceback" not in err


def test_a_length_or_size_given_twice_is_refused(capsys):
    """``eval --length 64,64`` evaluated the same length twice, ``bench --lengths`` /
    ``--contexts`` / ``--gen-batches`` measured the same row twice (``train --eval-lengths`` was
    refused already, by TrainConfig); a list of periods may repeat (``continual --periods``)."""
    from mnemo import argtypes as kinds
    from mnemo.cli import main

    assert main(["eval", "--length", "64,128,64"]) == 2
    assert "argument --length: expected comma-separated ints >= 1, got '64,128,64' (64 given twice)" in (
        capsys.readouterr().err
    )
    assert main(["bench", "--lengths", "512,512"]) == 2
    assert "(512 given twice)" in capsys.readouterr().err
    assert kinds.IntList(1, unique=True)("64, 128") == "64, 128"
    assert kinds.IntList(1)("1,1") == "1,1"
