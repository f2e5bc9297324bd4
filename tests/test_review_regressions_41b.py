"""Regressions of review 41b (commits f17382a: sweep default places, train --out == --data; and
cebbee6: checkpoint manifests and linked ckpt folders): each test failed on the code of those
commits."""

from __future__ import annotations

import os

from mnemo.cli import main
from tests.helpers import fast_train_flags


def test_a_run_folder_named_as_the_bundled_corpus_is_resumed_not_refused_as_the_data_folder(
    tmp_path, monkeypatch, capsys
):
    """``--data tinyshakespeare`` (the default) is the bundled corpus, never a folder of that name:
    a run with ``--out tinyshakespeare`` was made, then its ``--resume`` refused as "the --data
    folder" (the run's own folder now existed under the bundled corpus's name)."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "gla", *fast_train_flags(16, 2)]
    assert main([*argv, "--out", "tinyshakespeare"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--out",
                "tinyshakespeare",
                "--resume",
                "--steps",
                "4",
                "--reschedule",
                "hold",
                "--no-progress",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert (tmp_path / "tinyshakespeare" / "ckpt-000004").is_dir()


def test_overwrite_sets_aside_a_linked_checkpoint_of_the_old_run_and_leaves_its_target(
    tmp_path, monkeypatch, capsys
):
    """A run whose ``ckpt-*`` folder was moved to another disk and linked back: ``--overwrite``
    set aside the old run's own checkpoints but no longer the linked one (``run_checkpoints`` skips
    links since cebbee6), so the old model's ``ckpt-000004`` stayed in the new run's folder beside
    its checkpoints. It is set aside (the link itself) and removed; its target is untouched."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "gla", *fast_train_flags(16, 2)]
    out = tmp_path / "run"
    assert main([*[a if a != "2" else "4" for a in argv[:-1]], "--no-progress", "--out", str(out)]) == 0
    disk = tmp_path / "other disk"
    disk.mkdir()
    os.replace(out / "ckpt-000004", disk / "ckpt-000004")
    (out / "ckpt-000004").symlink_to(disk / "ckpt-000004", target_is_directory=True)
    before = sorted(p.name for p in (disk / "ckpt-000004").iterdir())
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (disk / "ckpt-000004").iterdir()) == before, "the target is left whole"
    assert not os.path.lexists(out / "ckpt-000004"), "the old run's linked checkpoint is not left behind"
    assert (out / "latest").read_text().strip() == "ckpt-000002"


def test_a_run_whose_checkpoint_folder_is_linked_is_refused_naming_the_link(tmp_path, monkeypatch, capsys):
    """Since cebbee6 a linked ``ckpt-*`` folder is never resumed from, but the refusals did not say
    so: ``--resume`` said ``latest`` named something "not one of this run's checkpoints (expected
    the name of a ckpt-NNNNNN directory inside run)" (it does), and without ``latest`` "no
    checkpoint in 'run'" beside ``ckpt-000002`` (after the train command itself said to --resume).
    Both now name the link and what to do."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--model", "gla", *fast_train_flags(16, 2)]
    assert main([*argv, "--out", "run"]) == 0
    (tmp_path / "disk").mkdir()
    os.replace(tmp_path / "run" / "ckpt-000002", tmp_path / "disk" / "ckpt-000002")
    (tmp_path / "run" / "ckpt-000002").symlink_to(tmp_path / "disk" / "ckpt-000002")
    resume = ["train", "--out", "run", "--resume", "--steps", "2", "--no-progress"]
    for drop_latest in (False, True):
        if drop_latest:
            (tmp_path / "run" / "latest").unlink()
        capsys.readouterr()
        assert main(resume) == 2
        err = capsys.readouterr().err
        assert "ckpt-000002 in run is a symbolic link" in err and "move the checkpoint folder" in err, err
    assert sorted(p.name for p in (tmp_path / "disk" / "ckpt-000002").iterdir()), "the target is untouched"
