"""Second break-it review of the command line (mnemo.cli, mnemo.argtypes, mnemo.commands): each test
is a defect found by the review, failing before its fix."""

from __future__ import annotations

import json
import random
import shlex

import pytest

from mnemo.cli import main
from tests.helpers import fast_train_flags

TASK_FAST = [
    "--task",
    "mqar",
    "--task-option",
    "num_pairs=2",
    "--task-option",
    "vocab_size=16",
    "--seq-len",
    "16",
    "--steps",
    "2",
    "--batch-size",
    "4",
    "--eval-interval",
    "2",
    "--eval-batches",
    "1",
    "--warmup-steps",
    "1",
    "--d-model",
    "16",
    "--n-layers",
    "1",
    "--no-progress",
]

TEXT_FAST = fast_train_flags()


def _corpus(path, seed: int) -> None:
    rng = random.Random(seed)
    path.write_text("".join(rng.choice("abcdefgh \n") for _ in range(6000)))


def _try_line(out: str) -> list[str]:
    lines = [x for x in out.splitlines() if x.startswith("try: ")]
    assert len(lines) == 1, out
    return shlex.split(lines[0][len("try: ") :])


def test_the_try_command_after_training_quotes_a_run_folder_with_a_space(tmp_path, capsys):
    """``mnemo train`` ends with a command to paste (``try: mnemo eval --checkpoint OUT ...``); a run
    folder with a space in its name was printed bare, so the pasted command named two arguments
    (``mnemo tokenizer train`` and ``mnemo sweep`` already quoted theirs)."""
    task_run, text_run = tmp_path / "my task run", tmp_path / "my text run"
    assert main(["train", "--model", "gla", "--out", str(task_run), *TASK_FAST]) == 0
    argv = _try_line(capsys.readouterr().out)
    assert argv[:4] == ["mnemo", "eval", "--checkpoint", str(task_run)] and argv[4:] == ["--length", "64"]
    assert main(["train", "--model", "gla", "--out", str(text_run), *TEXT_FAST]) == 0
    argv = _try_line(capsys.readouterr().out)
    assert argv == ["mnemo", "generate", "--checkpoint", str(text_run), "--prompt", "KING:"]


def test_a_relative_data_path_is_the_same_text_from_another_working_directory(tmp_path, capsys, monkeypatch):
    """``--data c.txt`` was saved as ``c.txt``: ``mnemo eval`` (and ``--resume``) run from another
    folder read that folder's ``c.txt`` instead, a different text, and eval still said
    ``"as_in_training": true``. The run now saves the absolute path; eval then reads the run's text
    from anywhere, and a relative ``--data`` naming that same file still counts as the training one."""
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    _corpus(home / "c.txt", 0)
    _corpus(other / "c.txt", 1)  # same characters, other text: no <unk> warning gives it away
    monkeypatch.chdir(home)
    assert main(["train", "--model", "gla", "--data", "c.txt", "--out", "run", *TEXT_FAST]) == 0
    saved = json.loads((home / "run" / "ckpt-000002" / "train_config.json").read_text())
    assert saved["data"] == str(home / "c.txt")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", "run"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert here["as_in_training"] is True and here["data"] == str(home / "c.txt")
    assert main(["eval", "--checkpoint", "run", "--data", "c.txt"]) == 0  # (the same file, written relative)
    again = json.loads(capsys.readouterr().out)
    assert again["as_in_training"] is True and again["val_loss"] == here["val_loss"]
    monkeypatch.chdir(other)
    assert main(["eval", "--checkpoint", str(home / "run")]) == 0
    there = json.loads(capsys.readouterr().out)
    assert there["data"] == str(home / "c.txt") and there["val_loss"] == here["val_loss"]
    assert main(["eval", "--checkpoint", str(home / "run"), "--data", "c.txt"]) == 0  # another text
    assert json.loads(capsys.readouterr().out)["as_in_training"] is False


def test_a_bundled_name_and_a_missing_path_are_saved_as_given(tmp_path, monkeypatch):
    """(The fix above keeps a bundled corpus's name, and leaves a path that exists nowhere for the
    data loader to refuse as the user wrote it.)"""
    from mnemo.commands.train import _absolute_data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tinyshakespeare").write_text("a file of the bundled corpus's name\n")
    assert _absolute_data("tinyshakespeare") == "tinyshakespeare"
    assert _absolute_data("nowhere.txt") == "nowhere.txt"
    assert _absolute_data("docs/*.txt") == str(tmp_path / "docs" / "*.txt")
    assert _absolute_data(str(tmp_path / "x.txt")) == str(tmp_path / "x.txt")


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("review2") / "task"
    assert main(["train", "--model", "gla", "--out", str(out), *TASK_FAST]) == 0
    return out


def test_eval_of_a_task_checkpoint_refuses_seq_len_beside_length(task_run, capsys):
    """``mnemo eval --length 32 --seq-len 64`` on a task checkpoint evaluated at 32 and ignored
    --seq-len without a word (a text checkpoint refused the pair)."""
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(task_run), "--length", "32", "--seq-len", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--length and --seq-len: give one of them" in captured.err
    assert main(["eval", "--checkpoint", str(task_run), "--seq-len", "32"]) == 0  # alone: fine
    assert json.loads(capsys.readouterr().out)["length"] == 32


def test_bench_suite_all_refuses_ops_which_it_does_not_apply(monkeypatch, capsys):
    """``mnemo bench --suite all --ops gla`` ran every suite whole (each op timed, for many
    minutes): ``--ops`` was dropped without a word, as ``_bench_all``'s docstring knew. Refused now,
    before any suite runs."""
    from mnemo.commands import bench

    ran = []
    monkeypatch.setattr(bench, "_run_suite", lambda a: ran.append(a.suite) or 0)
    assert main(["bench", "--suite", "all", "--ops", "gla"]) == 2
    err = capsys.readouterr().err
    assert "--ops gla: --suite all runs each suite whole and does not apply it" in err
    assert ran == []
