"""Sixth break-it review of the command line (mnemo.cli, mnemo.argtypes, mnemo.commands, the sweep
files and the data-folder reading): each test is a defect found by the review, failing before its
fix."""

from __future__ import annotations

import argparse

import pytest
import yaml

import mnemo.sweep.runner as runner_mod
from mnemo.cli import build_parser, main
from tests.helpers import sweep_project
from tests.tasks.test_sweep_seeds import BASE, _fake_run_one

# ------------------------------------------------------------------------------------------------
# part 1: known leftovers
# ------------------------------------------------------------------------------------------------

#: one cell, two rates, one seed: two runs (known accuracies through _fake_run_one)
_ACC = {(1e-3, 0): 0.9, (1e-2, 0): 0.5}


def _sweep_file(proj, name="where"):
    f = proj / "sweeps" / f"{name}.yaml"
    f.write_text(
        yaml.safe_dump({"name": name, "base": BASE, "models": ["gla"], "grid": {"lr": [1e-3, 1e-2]}})
    )
    return f


def test_a_sweeps_default_database_and_folder_are_its_project_folders_from_any_working_directory(
    tmp_path, monkeypatch, capsys
):
    """A sweep file's relative ``db``/``out`` (and data) were read against its project folder, but
    without them the database and run folders were made under the working directory: the same
    sweep run from two folders made two databases and resumed nothing. The default now lies under
    the project folder too, so a second working directory resumes the first one's sweep."""
    proj, away = sweep_project(tmp_path)
    f = _sweep_file(proj)
    calls = []
    monkeypatch.setattr(runner_mod, "run_one", _fake_run_one(_ACC, calls))
    monkeypatch.chdir(away)
    assert main(["sweep", str(f), "--no-progress"]) == 0
    assert len(calls) == 2
    assert (proj / "runs" / "sweeps" / "where.sqlite").is_file()
    assert not (away / "runs").exists(), "nothing is written under the working directory"
    monkeypatch.chdir(proj / "sweeps")  # another working directory: the same database, nothing to run
    capsys.readouterr()
    assert main(["sweep", str(f), "--no-progress"]) == 0
    assert len(calls) == 2
    assert "2 already finished" in capsys.readouterr().out
    assert not (proj / "sweeps" / "runs").exists()


def test_a_sweep_stored_under_the_working_directory_before_is_still_resumed_with_a_note(
    tmp_path, monkeypatch, capsys
):
    """A database made by an earlier mnemo (the default under the working directory) is found and
    continued there, with a warning saying where the default is now; when both places hold one,
    the sweep is refused naming both (never a silent choice between two stores)."""
    proj, away = sweep_project(tmp_path)
    f = _sweep_file(proj)
    calls = []
    monkeypatch.setattr(runner_mod, "run_one", _fake_run_one(_ACC, calls))
    monkeypatch.chdir(away)
    old = away / "runs" / "sweeps" / "where.sqlite"
    assert main(["sweep", str(f), "--no-progress", "--db", str(old), "--out", "runs/sweeps/where"]) == 0
    assert len(calls) == 2 and old.is_file()
    capsys.readouterr()
    with pytest.warns(UserWarning) as said:
        assert main(["sweep", str(f), "--no-progress"]) == 0
    (note,) = [str(w.message) for w in said]
    assert len(calls) == 2, "the stored sweep was resumed, not started again"
    assert "2 already finished" in capsys.readouterr().out
    assert note.startswith("continuing runs/sweeps/where.sqlite") and str(proj / "runs/sweeps") in note
    assert not (proj / "runs").exists()
    # both places hold one: refused, both named, --db the way out
    new = proj / "runs" / "sweeps" / "where.sqlite"
    assert main(["sweep", str(f), "--no-progress", "--db", str(new)]) == 0
    capsys.readouterr()
    assert main(["sweep", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(new) in err and "runs/sweeps/where.sqlite" in err and "--db" in err
    assert main(["sweep", str(f), "--no-progress", "--db", str(new)]) == 0


def test_sweep_help_says_where_the_default_database_and_folder_are():
    from mnemo.commands.sweep import _cmd_sweep  # noqa: F401

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: " ".join((a.help or "").split()) for a in sub.choices["sweep"]._actions}
    for dest in ("db", "out"):
        assert "project folder" in helps[dest] and "pyproject.toml" in helps[dest], helps[dest]


def _subparsers(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, path + (name,))


#: defaults stated in other words (a range, "all") where the value itself is a long list
_PARAPHRASED = {
    (("probe", "capacity"), "--variants"): "default: all",
    (("probe", "capacity"), "--pairs"): "default 4..256",
    (("probe", "capacity"), "--theta-grid"): "default 1e-6..5",
    (("export",), "--format"): "hf: transformers' own classes (default)",
}


def test_every_subcommands_help_names_each_default_it_runs_with():
    """``mnemo bench --help`` stated no default for --contexts, --decode-steps, --d-model,
    --lengths, --heads, --head-dim, --batch, --device, ... (a bare call ran values the user could
    not see); sweep/reproduce wrote ``(1)``. Every option of every sub-command whose default is a
    value (not off, None or empty) now says ``default VALUE`` in its help."""
    missing, checked = [], 0
    for path, parser in _subparsers(build_parser()):
        for action in parser._actions:
            d = action.default
            if not action.option_strings or d is None or d is False or d in ([], "", argparse.SUPPRESS):
                continue
            if isinstance(action, argparse._HelpAction):
                continue
            text = " ".join((action.help or "").split()).replace("default:", "default")
            isfloat = isinstance(d, float)
            said = _PARAPHRASED.get((path, action.option_strings[-1]))
            if said is not None:
                ok = said.replace("default:", "default") in text
            else:
                ok = any(
                    f"default {v}" in text or f"{v} (default" in text
                    for v in ((d, f"{d:g}") if isfloat else (d,))
                )
                ok = ok or f"{d}' (default" in text
            checked += 1
            if not ok:
                missing.append((" ".join(path), action.option_strings[-1], d, text[-80:]))
    assert not missing, missing
    assert checked >= 60


# ------------------------------------------------------------------------------------------------
# part 2: break-it
# ------------------------------------------------------------------------------------------------


def test_train_refuses_the_data_folder_as_its_out_by_name_and_writes_nothing(tmp_path, capsys):
    """``mnemo train --data DIR --out DIR`` took the run folder's lock in DIR, then refused the data
    as "a training run's folder or checkpoint (its .jsonl files are logs)": the user's corpus
    folder, named as something it is not. Now --out is refused up front as the --data folder."""
    from tests.helpers import fast_train_flags

    corpus = tmp_path / "my corpus"  # (a space in the path)
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world, this is text. " * 200)
    argv = ["train", "--model", "gla", "--data", str(corpus), *fast_train_flags(16, 2)]
    assert main([*argv, "--out", str(corpus)]) == 2
    err = capsys.readouterr().err
    assert f"--out: {corpus} is the --data folder" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"], "nothing written into the corpus"
    assert main([*argv, "--out", str(corpus / "run")]) == 0  # a folder inside it is not read: fine


def test_a_refused_default_sweep_place_is_named_as_the_default_not_as_a_key_the_file_lacks(
    tmp_path, monkeypatch, capsys
):
    """A sweep file without ``out`` whose default run folder is taken by a file was refused as
    "FILE: out: expected a folder ...": a key the file does not have. Now the message says it is
    the default and names the flag that sets another."""
    proj, away = sweep_project(tmp_path)
    f = _sweep_file(proj)
    (proj / "runs" / "sweeps").mkdir(parents=True)
    (proj / "runs" / "sweeps" / "where").write_text("a file where the run folders would go\n")
    monkeypatch.chdir(away)
    assert main(["sweep", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: the default out (the file sets no 'out'; --out): expected a folder" in err, err
    assert not (proj / "runs" / "sweeps" / "where.sqlite").exists()


@pytest.mark.parametrize("key, value", [("db", 5), ("out", ["a"]), ("db", True), ("out", "  ")])
def test_a_sweep_files_db_or_out_that_is_no_path_is_refused_naming_the_key(tmp_path, capsys, key, value):
    """``db: 5`` or ``out: [a]`` in a sweep file crashed ``mnemo sweep`` with a TypeError traceback
    (``Path(5)``); a blank one fell back to the default without a word. Each is refused in one line
    naming the key and the value."""
    proj, _ = sweep_project(tmp_path)
    f = _sweep_file(proj)
    f.write_text(f.read_text() + yaml.safe_dump({key: value}))
    assert main(["sweep", str(f), "--list"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: {key!r} must be a path (a non-empty string" in err and f"got {value!r}" in err, err
    assert err.count("\n") == 1
