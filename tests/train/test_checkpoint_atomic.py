"""Atomic checkpoints when the crash comes *after* the checkpoint directory's rename.

``save_checkpoint`` writes ``OUT/.tmp-ckpt-N``, renames it to ``OUT/ckpt-N``, fsyncs ``OUT``,
replaces ``OUT/latest`` (a temporary file, fsync, ``os.replace``, fsync of ``OUT``) and then removes
the checkpoints beyond ``keep``. A crash before the rename is covered by the trainer's tests; here
the process dies at each later point:

* ``fsync_after_rename``: the fsync of ``OUT`` right after the rename raises;
* ``before_latest``: between the rename and any write of ``latest``;
* ``latest_tmp_written``: ``latest``'s temporary file is written, its ``os.replace`` fails;
* ``fsync_after_latest``: ``latest`` is replaced, the fsync of ``OUT`` after it raises;
* ``during_cleanup``: the removal of an old checkpoint dies half-way (some of its files gone).

After each: the new checkpoint directory is complete (every file, matching its manifest),
``latest`` names a complete checkpoint (the old one before ``latest`` is replaced, the new one
after), :func:`resolve_checkpoint` returns it, a later save works, and a training run resumes from
it and ends with the same weights as a run that never crashed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mnemo.train import TrainConfig, Trainer, resolve_checkpoint
from mnemo.train import checkpoint as ckpt_mod
from mnemo.train.checkpoint import LATEST, MANIFEST_NAME, save_checkpoint, verify_checkpoint


class Crash(Exception):
    """The simulated death of the process."""


CRASH_POINTS = [
    "fsync_after_rename",
    "before_latest",
    "latest_tmp_written",
    "fsync_after_latest",
    "during_cleanup",
]
#: whether ``latest`` already names the new checkpoint when the process dies there
LATEST_IS_NEW = {
    "fsync_after_rename": False,
    "before_latest": False,
    "latest_tmp_written": False,
    "fsync_after_latest": True,
    "during_cleanup": True,
}


def plant_crash(monkeypatch, point: str, out: Path, step_name: str) -> None:
    """Make the save of checkpoint ``step_name`` in ``out`` die at ``point`` (other saves run)."""
    final = out / step_name
    real_fsync_dir = ckpt_mod._fsync_dir
    real_atomic_write_text = ckpt_mod.atomic_write_text
    real_replace = os.replace
    real_rmtree = shutil.rmtree
    out_fsyncs = []

    def fsync_dir(path):
        path = Path(path)
        if path == out and final.is_dir():  # the rename into place has happened
            out_fsyncs.append(path)
            crash_now = {"fsync_after_rename": 1, "fsync_after_latest": 2}.get(point)
            if crash_now == len(out_fsyncs):
                raise Crash(f"died in fsync of {path} ({point})")
        real_fsync_dir(path)

    def atomic_write_text(path, text):
        if point == "before_latest" and Path(path) == out / LATEST and text.strip() == step_name:
            raise Crash("died before writing latest")
        real_atomic_write_text(path, text)

    def replace(src, dst, *a, **k):
        if (
            point == "latest_tmp_written"
            and Path(dst) == out / LATEST
            and Path(src).read_text().strip() == step_name
        ):
            raise Crash("died before the rename of latest")
        return real_replace(src, dst, *a, **k)

    def rmtree(path, *a, **k):
        path = Path(path)
        if (
            point == "during_cleanup"
            and path.parent == out
            and path.name.startswith(".old-ckpt-")  # moved out of sight, then deleted
            and final.is_dir()
        ):
            # the manifest and one data file are gone, the rest is left behind
            (path / MANIFEST_NAME).unlink()
            next(f for f in sorted(path.iterdir()) if f.is_file()).unlink()
            raise Crash(f"died while removing {path}")
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(ckpt_mod, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(ckpt_mod, "atomic_write_text", atomic_write_text)
    monkeypatch.setattr(ckpt_mod.os, "replace", replace)
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", rmtree)


def _writer(step: int):
    """Files of a checkpoint whose contents depend on the step."""

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps({"step": step}))
        (tmp / "model.safetensors").write_bytes(bytes([step % 256]) * (1000 + step))
        (tmp / "trainer_state.pt").write_bytes(b"state-%d" % step)

    return write


def _assert_complete(ckpt: Path, step: int) -> None:
    assert ckpt.is_dir()
    assert sorted(f.name for f in ckpt.iterdir()) == [
        "config.json",
        MANIFEST_NAME,
        "model.safetensors",
        "trainer_state.pt",
    ]
    assert verify_checkpoint(ckpt) == []
    assert json.loads((ckpt / "config.json").read_text()) == {"step": step}
    assert (ckpt / "model.safetensors").read_bytes() == bytes([step % 256]) * (1000 + step)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_after_the_rename_leaves_latest_on_a_complete_checkpoint(tmp_path, monkeypatch, point):
    out = tmp_path / "run"
    for step in (1, 2):
        save_checkpoint(out, step, _writer(step), keep=2)
    with monkeypatch.context() as m:
        plant_crash(m, point, out, "ckpt-000003")
        with pytest.raises(Crash):
            save_checkpoint(out, 3, _writer(3), keep=2)

    _assert_complete(out / "ckpt-000003", 3)  # the rename had happened: the new directory is whole
    _assert_complete(out / "ckpt-000002", 2)  # the previous one is untouched
    latest = (out / LATEST).read_text()
    want = 3 if LATEST_IS_NEW[point] else 2
    assert latest == f"ckpt-{want:06d}\n"  # one whole line, naming a complete checkpoint
    assert resolve_checkpoint(out) == out / f"ckpt-{want:06d}"
    assert not list(out.glob(".tmp-ckpt-*"))

    # the next save (the resumed run writing step 3 again, then step 4) works and cleans up
    save_checkpoint(out, 3, _writer(3), keep=2)
    save_checkpoint(out, 4, _writer(4), keep=2)
    assert (out / LATEST).read_text() == "ckpt-000004\n"
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000004"]
    _assert_complete(out / "ckpt-000003", 3)
    _assert_complete(out / "ckpt-000004", 4)
    assert not list(out.glob(".old-*")) and not list(out.glob(".tmp-ckpt-*"))


def test_crash_during_cleanup_leaves_a_half_removed_checkpoint_that_is_never_used(tmp_path, monkeypatch):
    """The half-removed old checkpoint is not what ``latest`` names, and when the new one turns out
    damaged the fallback takes the previous intact one, not the half-removed one."""
    out = tmp_path / "run"
    for step in (1, 2, 3):
        save_checkpoint(out, step, _writer(step), keep=3)
    with monkeypatch.context() as m:
        plant_crash(m, "during_cleanup", out, "ckpt-000004")
        with pytest.raises(Crash):
            save_checkpoint(out, 4, _writer(4), keep=2)  # removes ckpt-1 (and would ckpt-2)
    assert (out / LATEST).read_text() == "ckpt-000004\n"
    assert resolve_checkpoint(out) == out / "ckpt-000004"
    # damage the new checkpoint: the fallback is ckpt-3 (intact), never the half-removed ckpt-1
    w = out / "ckpt-000004" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:10])
    notes = []
    assert resolve_checkpoint(out, warn=notes.append) == out / "ckpt-000003"
    assert len(notes) == 1 and "model.safetensors" in notes[0]


def test_atomic_write_bytes_crash_after_the_replace_keeps_the_new_content(tmp_path, monkeypatch):
    """``os.replace`` done, the directory fsync fails: the file holds the whole new content and no
    temporary file is left; a crash before the replace leaves the whole old content."""
    p = tmp_path / "latest"
    ckpt_mod.atomic_write_bytes(p, b"old\n")

    def fsync_dir(path):
        raise Crash("died in the directory fsync")

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod, "_fsync_dir", fsync_dir)
        with pytest.raises(Crash):
            ckpt_mod.atomic_write_bytes(p, b"new\n")
    assert p.read_bytes() == b"new\n"
    assert [f.name for f in tmp_path.iterdir()] == ["latest"]

    def replace(src, dst):
        raise Crash("died before the rename")

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.os, "replace", replace)
        with pytest.raises(Crash):
            ckpt_mod.atomic_write_bytes(p, b"newer\n")
    assert p.read_bytes() == b"new\n"


# ----------------------------------------------------------------------------------------------
# a training run that dies while writing a checkpoint, then resumes
# ----------------------------------------------------------------------------------------------


def _cfg(**kw):
    base = dict(
        model="gla",
        model_overrides={"d_model": 32, "n_layers": 1},
        seq_len=32,
        batch_size=4,
        steps=6,
        eval_interval=2,
        eval_batches=1,
        lr=3e-3,
        warmup_steps=2,
        sample_tokens=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    Trainer(_cfg(), out, progress=False).fit()
    return _weights(resolve_checkpoint(out))


@pytest.mark.parametrize(
    "point", ["fsync_after_rename", "before_latest", "fsync_after_latest", "during_cleanup"]
)
def test_training_resumes_after_a_crash_after_the_rename(tmp_path, monkeypatch, point, uninterrupted):
    """Checkpoints at steps 2, 4 and 6 (``keep=2``: writing step 6 removes step 2); the process dies
    while writing step 6 (``during_cleanup``) or step 4 (the others). Resuming continues from the
    checkpoint ``latest`` names and ends with the weights of the run that never crashed."""
    crash_step = 6 if point == "during_cleanup" else 4
    with monkeypatch.context() as m:
        plant_crash(m, point, tmp_path, f"ckpt-{crash_step:06d}")
        with pytest.raises(Crash):
            Trainer(_cfg(), tmp_path, progress=False).fit()
    new = tmp_path / f"ckpt-{crash_step:06d}"
    assert new.is_dir() and verify_checkpoint(new) == []
    resumed_from = resolve_checkpoint(tmp_path)
    assert resumed_from == (new if LATEST_IS_NEW[point] else tmp_path / f"ckpt-{crash_step - 2:06d}")
    tr = Trainer(_cfg(), tmp_path, resume=True, progress=False)
    assert tr.step == int(resumed_from.name.split("-")[1])
    tr.fit()
    final = resolve_checkpoint(tmp_path)
    assert final.name == "ckpt-000006" and verify_checkpoint(final) == []
    got = _weights(final)
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert torch.equal(got[k], uninterrupted[k]), k


def test_old_checkpoints_are_removed_by_step_not_by_name(tmp_path):
    """Past step 999,999 the names stop sorting like the steps; the newest must survive cleanup."""

    def write(d: Path):
        (d / "model.safetensors").write_bytes(b"w")

    for step in (999_998, 999_999, 1_000_000):
        save_checkpoint(tmp_path, step, write, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-1000000", "ckpt-999999"]
    assert resolve_checkpoint(tmp_path).name == ckpt_mod.ckpt_name(1_000_000)


def test_a_crash_while_removing_an_old_checkpoint_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """Cleanup moves an old checkpoint out of sight before deleting it: a crash half-way through
    the delete (even one that removed its manifest first) leaves nothing a fallback could pick."""

    def write(d: Path):
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"weights")

    save_checkpoint(tmp_path, 1, write, keep=1)
    real_rmtree = shutil.rmtree

    def dies_half_way(path, *a, **k):
        (Path(path) / MANIFEST_NAME).unlink()  # the manifest goes first, then the process dies
        raise Crash

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", dies_half_way)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, 2, write, keep=1)
    assert [p.name for p in tmp_path.glob("ckpt-*")] == ["ckpt-000002"]  # ckpt-000001 is out of sight
    # the newest checkpoint damaged: no fallback to the half-deleted one
    (tmp_path / "ckpt-000002" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ckpt_mod.CorruptCheckpointError, match="no intact checkpoint is left"):
        resolve_checkpoint(tmp_path)
    # the next save clears the leftover
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real_rmtree)
    save_checkpoint(tmp_path, 3, write, keep=1)
    assert not list(tmp_path.glob(".old-*"))
