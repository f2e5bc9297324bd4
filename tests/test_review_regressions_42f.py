"""Regression review 42f of 34c1026 (distributed / run-state parts) and a29f63f.

1. ``load_sharded`` turned every ``CheckpointException`` into ``CorruptCheckpointError`` (no
   manifest) or ``RuntimeError`` (verified). DCP wraps *every* ``BaseException`` of its read step
   in that exception, so a Ctrl-C (``KeyboardInterrupt``), a ``SystemExit`` or running out of
   memory while the shards load was reported as a damaged checkpoint, and with a manifest as a
   ``RuntimeError`` the trainer turns into "its (verified) weights do not fit model ... written by
   another version?" (its ``except torch.OutOfMemoryError: raise`` no longer saw the OOM).
2. An FSDP run on one process now saves ``fsdp: false`` (so a later torchrun ``--resume`` trains
   data-parallel): a saved setting changed with no note, where every other change of a resumed
   run's setting is said.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mnemo.train.sharded import SHARDED_DIR, load_sharded
from tests.train import test_review7_distributed as _review7

sharded_run = _review7.sharded_run  # (the fixture: a run whose checkpoint holds DCP shards)


def _tiny_sharded(tmp_path: Path, manifest: bool) -> tuple[Path, torch.nn.Module]:
    model = torch.nn.Linear(3, 2)
    ckpt = tmp_path / "ckpt-000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: intended)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / SHARDED_DIR))
    if manifest:
        from mnemo.train.checkpoint import write_manifest

        write_manifest(ckpt)
    return ckpt, model


@pytest.mark.parametrize("manifest", [False, True])
@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), SystemExit(3), torch.OutOfMemoryError("CUDA out of memory"), MemoryError()]
)
def test_an_interrupt_or_oom_inside_dcp_load_is_not_a_damaged_checkpoint(
    tmp_path, monkeypatch, manifest, exc
):
    ckpt, model = _tiny_sharded(tmp_path, manifest)

    def read_data(self, *a, **k):
        raise exc

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", read_data)
    with pytest.raises(type(exc)) as got:
        load_sharded(ckpt, model)
    assert got.value is exc  # itself: not a CorruptCheckpointError / RuntimeError naming it


def test_a_damaged_shard_is_still_named(tmp_path, monkeypatch):
    """(what 34c1026 fixed holds: an ordinary read error still names the folder)"""
    from mnemo.train.checkpoint import CorruptCheckpointError

    ckpt, model = _tiny_sharded(tmp_path, manifest=False)

    def read_data(self, *a, **k):
        raise OSError("short read")

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", read_data)
    with pytest.raises(CorruptCheckpointError, match="OSError: short read") as e:
        load_sharded(ckpt, model)
    assert e.value.ckpt == ckpt
    verified, _ = _tiny_sharded(tmp_path / "b", manifest=True)
    with pytest.raises(RuntimeError, match=f"DCP could not read {verified / SHARDED_DIR}: OSError"):
        load_sharded(verified, model)


def test_an_fsdp_run_on_one_process_says_its_checkpoints_drop_fsdp(sharded_run, tmp_path):
    """34c1026 saves ``fsdp: false`` in the single-file checkpoints of an FSDP run resumed on one
    process; the change of that saved setting was silent (a later ``torchrun ... --resume`` then
    trains data-parallel, every process holding the whole model and optimizer state)."""
    import shutil

    from mnemo.train import Trainer

    run = tmp_path / "run"
    shutil.copytree(sharded_run[0], run)
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = Trainer({"steps": 2, "schedule_steps": 1}, run, resume=True, progress=False, log=said.append)
    assert tr.cfg.fsdp and not tr.fsdp
    notes = [m for m in said if "fsdp: false" in m]
    assert len(notes) == 1 and "data-parallel" in notes[0], said


def test_force_with_from_dcp_does_not_invite_writing_into_a_run(tmp_path, capsys):
    """The ``--force`` refusal said --from-dcp "adds OUT/ckpt-STEP (and OUT/latest) to the run folder
    OUT ...; leave --force out", yet since 34c1026 an OUT holding a run is refused: a user repeating
    a consolidation into the same OUT with --force was told to drop the flag, then refused."""
    from mnemo.cli import main

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (out / "ckpt-000001").mkdir(parents=True)
    (out / "latest").write_text("ckpt-000001\n")
    assert main(["convert", "--from-dcp", str(src), str(out), "--force"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--force: does not apply to --from-dcp" in err and "to the run folder OUT" not in err
    assert "holds no run" in err and "new or empty folder" in err


def test_consolidating_into_an_existing_folder_without_a_run_still_works(sharded_run, tmp_path):
    """(held) an empty existing OUT and one with unrelated files are written; a second
    consolidation into the same OUT is refused, saying what to do, and leaves it as it was."""
    from mnemo.train.sharded import consolidate_checkpoint

    run, _ = sharded_run
    empty, notes = tmp_path / "empty", tmp_path / "notes"
    empty.mkdir()
    notes.mkdir()
    (notes / "README.txt").write_text("mine")
    for out in (empty, notes):
        ckpt = consolidate_checkpoint(run, out)
        assert ckpt == out / "ckpt-000001" and (out / "latest").read_text().strip() == "ckpt-000001"
    assert (notes / "README.txt").read_text() == "mine"
    with pytest.raises(ValueError, match=r"already holds a run \(ckpt-000001, latest\).*new or empty folder"):
        consolidate_checkpoint(run, empty)
    assert sorted(p.name for p in empty.iterdir()) == ["ckpt-000001", "latest"]
