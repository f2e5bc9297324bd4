"""Leftovers of review 41: ``MNEMO_CHECK_FINITE`` reads the usual switch spellings and refuses a
typo; a library run refuses a folder that holds a linked (or dangling) ``ckpt-NNNNNN`` of another
run, and a resumed run sets such a newer link aside instead of failing on it later. Each test
failed on the code before these changes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import tiny_mqar_trainer


@pytest.mark.parametrize(
    "value, on", [("0", False), ("false", False), ("OFF", False), (" No ", False), ("1", True), ("Yes", True)]
)
def test_mnemo_check_finite_reads_the_usual_switch_spellings(monkeypatch, value, on):
    """Any value but ``"0"`` kept the checks on: ``MNEMO_CHECK_FINITE=false`` / ``off`` / ``no``
    were read as on, silently (``MNEMO_NATIVE`` and ``MNEMO_MALLOC_TUNE`` take all of these)."""
    from mnemo.ops import _common

    monkeypatch.setenv("MNEMO_CHECK_FINITE", value)
    assert _common._finite_checks_from_env() is on


def test_mnemo_check_finite_typo_is_refused_naming_the_variable_and_the_values():
    """``MNEMO_CHECK_FINITE=flase`` left the checks on without a word; now the import raises a
    ``ValueError`` naming the variable, the accepted values and the value received, and ``mnemo``
    says it in one line (status 2, no traceback)."""
    env = {**os.environ, "MNEMO_CHECK_FINITE": "flase"}
    r = subprocess.run(
        [sys.executable, "-c", "import mnemo.ops"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    assert "ValueError: MNEMO_CHECK_FINITE must be one of 1, true, on, yes" in r.stderr
    assert "0, false, off, no (off), got 'flase'" in r.stderr
    code = "import sys; from mnemo.cli import main; sys.exit(main(['models']))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert (
        r.stderr.startswith("mnemo: error: MNEMO_CHECK_FINITE must be one of") and "Traceback" not in r.stderr
    )
    assert r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("dangling", [False, True])
def test_a_library_run_refuses_a_folder_holding_only_a_linked_checkpoint(tmp_path, dangling):
    """``run_checkpoints`` skips links (cebbee6), so ``Trainer(...).fit()`` into a folder whose only
    trace of a run is a linked ``ckpt-000002`` (``latest`` lost) was no longer refused: it trained
    and then failed (dangling link) or replaced the link (``mnemo train`` refuses such a folder).
    Now refused before any step, naming the link; the link and its target are left as they were."""
    first = tiny_mqar_trainer(tmp_path)
    first.fit()
    run, disk = tmp_path / "run", tmp_path / "disk"
    disk.mkdir()
    os.replace(run / "ckpt-000002", disk / "ckpt-000002")
    (run / "ckpt-000002").symlink_to(disk / "ckpt-000002", target_is_directory=True)
    (run / "latest").unlink()
    (run / "metrics.jsonl").unlink()
    target = sorted(p.name for p in (disk / "ckpt-000002").iterdir())
    if dangling:
        os.replace(disk / "ckpt-000002", disk / "moved")
    with pytest.raises(ValueError, match=r"already holds a run \(ckpt-000002\)"):
        tiny_mqar_trainer(tmp_path).fit()
    assert os.readlink(run / "ckpt-000002") == str(disk / "ckpt-000002")
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-000002"]
    left = disk / ("moved" if dangling else "ckpt-000002")
    assert sorted(p.name for p in left.iterdir()) == target, "the target is untouched"


def test_a_resumed_run_sets_a_newer_linked_checkpoint_aside_and_leaves_its_target(tmp_path):
    """Resumed from ckpt-000002 (``latest`` pointed back by hand) while ``ckpt-000004`` is a link
    to a folder elsewhere: ``set_aside_newer`` skipped links, so the run trained to step 4 and its
    checkpoint write met the link. The link now moves to ``kept/superseded-1`` (as a link: the
    target is never followed, its files are left as they were) and the run writes its own."""
    tiny_mqar_trainer(tmp_path, steps=4).fit()
    run, disk = tmp_path / "run", tmp_path / "disk"
    disk.mkdir()
    os.replace(run / "ckpt-000004", disk / "ckpt-000004")
    (run / "ckpt-000004").symlink_to(disk / "ckpt-000004", target_is_directory=True)
    target = {p.name: p.read_bytes() for p in (disk / "ckpt-000004").iterdir() if p.is_file()}
    (run / "latest").write_text("ckpt-000002\n")
    from mnemo.train import Trainer

    with pytest.warns(UserWarning, match=r"later checkpoints \(ckpt-000004\) moved to"):
        Trainer(None, run, resume=True, progress=False, log=lambda *a: None).fit()
    moved = run / "kept" / "superseded-1" / "ckpt-000004"
    assert moved.is_symlink() and os.readlink(moved) == str(disk / "ckpt-000004")
    assert (run / "ckpt-000004").is_dir() and not (run / "ckpt-000004").is_symlink()
    assert (run / "latest").read_text().strip() == "ckpt-000004"
    assert {p.name: p.read_bytes() for p in (disk / "ckpt-000004").iterdir() if p.is_file()} == target
