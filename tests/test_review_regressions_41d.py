"""Regressions of review 41d (commits f8e34e0: layers' flags and the short conv in float32; 8b72387
and 56f1bf5: resume past steps, evaluate(lengths), fit(until), mnemo train --overwrite of linked
checkpoints): each test failed on the code of those commits."""

from __future__ import annotations

import os

from mnemo.cli import main
from tests.helpers import fast_train_flags


def test_overwrite_sets_aside_a_dangling_linked_checkpoint_of_the_old_run(tmp_path, monkeypatch, capsys):
    """56f1bf5 set aside the old run's linked ``ckpt-*`` only when the link resolved to a folder
    (``p.is_dir()``): a link whose target is gone (the other disk unmounted, the target deleted)
    stayed, and the new run's checkpoint of that step failed "Not a directory" (exit 2) after it
    had trained. It is set aside like a live link (the link itself, removed)."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "gla", *fast_train_flags(16, 2)]
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out)]) == 0
    os.replace(out / "ckpt-000002", tmp_path / "moved")
    (out / "ckpt-000002").symlink_to(tmp_path / "gone", target_is_directory=True)  # dangling
    (out / "latest").unlink()
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    ckpt = out / "ckpt-000002"
    assert ckpt.is_dir() and not ckpt.is_symlink(), "the new run's checkpoint, not the old link"
    assert not (tmp_path / "gone").exists()
