"""Regression review of 7dde2ec and ae6da50 (review 38-T / 38-U fixes): each test is a defect the
fixes brought in, failing before its own fix."""

from __future__ import annotations

import os
import shutil
import time

import mnemo.commands.continual as continual
from mnemo.cli import main

#: the smallest continual command: one experiment, two models, one seed, two steps
CONTINUAL = ["continual", "--experiment", "abab", "--models", "cms-1,cms-2", "--periods", "1,4"]
CONTINUAL += ["--seeds", "1", "--steps", "2", "--eval-streams", "4", "--workers", "1", "--no-progress"]


def _counting(monkeypatch, interrupt_at: list[int]) -> list:
    """``continual.train_one`` counting its calls; the ``interrupt_at[0]``-th raises Ctrl-C."""
    real, trained = continual.train_one, []

    def counting(*a, **k):
        trained.append(a[4])
        if interrupt_at[0] and len(trained) == interrupt_at[0]:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(continual, "train_one", counting)
    return trained


def test_a_first_continual_force_retrains_kept_runs_whose_mtime_is_ahead_of_the_clock(tmp_path, monkeypatch):
    """``--force`` retrains this command's runs; since 7dde2ec a first ``--force`` call read every
    kept run whose file time is after the call began (a folder copied with ``cp -p``/``rsync -a`` from
    a machine whose clock is ahead, or an NFS server's): none was trained again."""
    argv = [*CONTINUAL, "--out", str(tmp_path / "c")]
    assert main(argv) == 0
    ahead = time.time() + 3600
    for p in (tmp_path / "c" / "runs").rglob("*.json"):
        os.utime(p, (ahead, ahead))
    trained = _counting(monkeypatch, [0])
    assert main([*argv, "--force"]) == 0
    assert len(trained) == 2, trained


def test_an_interrupted_continual_force_copied_with_plain_cp_still_retrains_what_it_had_not(
    tmp_path, monkeypatch, capsys
):
    """An interrupted ``--force`` whose ``--out`` is then copied without its file times (``cp -r``,
    ``scp -r``) and resumed there: every kept run looked newer than the marker's start time, so the
    run the interrupted call never retrained was read, not trained again."""
    argv = [*CONTINUAL, "--force"]
    assert main([*argv[:-1], "--out", str(tmp_path / "c")]) == 0
    interrupt_at = [2]  # the first run finishes, the second is interrupted
    trained = _counting(monkeypatch, interrupt_at)
    assert main([*argv, "--out", str(tmp_path / "c")]) == 130
    capsys.readouterr()
    time.sleep(0.05)
    shutil.copytree(tmp_path / "c", tmp_path / "d", copy_function=shutil.copyfile)  # new file times
    trained.clear()
    interrupt_at[0] = 0
    assert main([*argv, "--out", str(tmp_path / "d")]) == 0
    assert len(trained) == 1, trained  # the run the interrupted call did not finish, only
    assert not (tmp_path / "d" / "runs" / ".fresh.json").exists()
