"""Regression review of 1d7c057 (CLI review 2) and 84922e9 (sweep/data review 2): each test is a
defect the fixes introduced or left in a sibling path, failing before its own fix."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from mnemo.cli import main
from mnemo.train.sinks import MetricsFile
from tests.helpers import locked_sweep_db

sys.path.insert(0, str(Path(__file__).parent))
from test_review2_cli import TEXT_FAST, _corpus  # noqa: E402


def _fast(steps: int) -> list[str]:
    args = list(TEXT_FAST)
    args[args.index("--steps") + 1] = str(steps)
    return args


def test_resume_with_the_same_relative_data_is_no_change(tmp_path, monkeypatch, capsys):
    """1d7c057 saves a new run's relative ``--data c.txt`` as ``/abs/c.txt``; ``--resume`` with the
    same ``--data c.txt`` (or the same ``--config`` file naming it) then read as a changed setting
    and was refused ("a resumed run keeps data = '/abs/c.txt' (got 'c.txt')"). It names the same
    file: no change. Another file of that name elsewhere is still refused."""
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "c.txt", 0)
    (tmp_path / "cfg.yaml").write_text("data: c.txt\nmodel: gla\n")
    assert main(["train", "--config", "cfg.yaml", "--out", "run", *_fast(2)]) == 0
    capsys.readouterr()
    more = ["--resume", "--reschedule", "stretch"]
    assert main(["train", "--config", "cfg.yaml", "--out", "run", *more, *_fast(4)]) == 0, capsys.readouterr()
    assert main(["train", "--data", "c.txt", "--model", "gla", "--out", "run", *more, *_fast(6)]) == 0
    other = tmp_path / "other"
    other.mkdir()
    _corpus(other / "c.txt", 1)
    monkeypatch.chdir(other)
    capsys.readouterr()
    run = str(tmp_path / "run")
    assert main(["train", "--data", "c.txt", "--model", "gla", "--out", run, *more, *_fast(8)]) == 2
    assert "a resumed run keeps data" in capsys.readouterr().err


def test_a_locked_database_is_said_to_be_locked_by_the_cli_check_too(tmp_path, monkeypatch):
    """84922e9 made SweepDB raise TimeoutError for a database another process keeps locked, but
    ``mnemo sweep``/``mnemo report`` check the file first (``_check_database``), which waited 30 s
    (not BUSY_TIMEOUT_S) and then said it was "an SQLite database but not a sweep's (it cannot be
    read: database is locked)"."""
    from mnemo.commands.sweep import _check_database

    path = tmp_path / "s.sqlite"
    with locked_sweep_db(path, monkeypatch):
        with pytest.raises(TimeoutError, match=r"s\.sqlite stayed locked by another process"):
            _check_database(path, "db")
    _check_database(path, "db")  # unlocked: a sweep's database


def test_plot_training_reads_strict_metrics_back_with_their_nan(tmp_path):
    """84922e9 writes a NaN of metrics.jsonl as null plus a "nonfinite" field; ``mnemo probe
    plot-training`` read the file with json.loads, so its rows held None and the extra field
    instead of the NaN logged (the other readers use loads_record)."""
    from mnemo.commands.probe import _read_metrics

    sink = MetricsFile(tmp_path)
    sink.log({"step": 2, "train_loss": 1.0, "val_loss": 1.5, "val_acc": math.nan})
    (row,) = _read_metrics(tmp_path)
    assert math.isnan(row["val_acc"]) and "nonfinite" not in row
