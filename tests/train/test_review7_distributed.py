"""Review 7 (distributed and run-state training): consolidating a sharded checkpoint into a folder
that holds a run no longer rotates that run's checkpoints out nor repoints its ``latest``; a damaged
shard of an unchecked (manifest-less) sharded checkpoint is a named ``CorruptCheckpointError``, not
DCP's ``CheckpointException`` (a ``BaseException`` that escaped every ``except Exception``);
``latest`` naming a ``ckpt-NNNNNN`` link, and the fallback past a damaged checkpoint, resume from
the run's own folder, never from the link (which the resumed run then moved away, leaving
``latest`` dangling)."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mnemo.train import TrainConfig, Trainer
from mnemo.train.checkpoint import (
    CorruptCheckpointError,
    load_trainer_state,
    resolve_checkpoint,
    save_torch,
    write_manifest,
)


def _tiny_cfg(**kw) -> TrainConfig:
    base = dict(
        model="gated_deltanet",
        model_overrides={"d_model": 8, "n_layers": 1},
        seq_len=32,
        batch_size=2,
        steps=1,
        eval_interval=1,
        eval_batches=1,
        warmup_steps=1,
        sample_tokens=0,
        task="copying",
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[Path, dict]:
    """A run folder whose step-1 checkpoint holds DCP shards (as an FSDP run writes it, made in
    one process), and the trained weights."""
    import torch.distributed.checkpoint as dcp

    from mnemo.train.sharded import _state_dicts

    run = tmp_path_factory.mktemp("review7d") / "run"
    tr = Trainer(_tiny_cfg(), run, progress=False, log=lambda *a: None)
    tr.fit()
    ckpt = run / "ckpt-000001"
    (ckpt / "model.safetensors").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state_dicts(tr.model, tr.optimizer), checkpoint_id=str(ckpt / "sharded"))
    state = load_trainer_state(ckpt)
    state.pop("optimizer")
    save_torch({**state, "sharded": True}, ckpt / "trainer_state.pt")
    (ckpt / "train_config.json").write_text(
        (ckpt / "train_config.json").read_text().replace('"fsdp": false', '"fsdp": true')
    )
    write_manifest(ckpt)
    weights = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    return run, weights


def _other_run(out: Path) -> dict:
    """A folder holding another run's two checkpoints and ``latest``; returns its files' contents."""
    for step in (1, 2):
        c = out / f"ckpt-00000{step}"
        c.mkdir(parents=True)
        (c / "model.safetensors").write_bytes(b"theirs %d" % step)
    (out / "latest").write_text("ckpt-000002\n")
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_consolidating_into_a_folder_holding_a_run_deletes_nothing_of_it(sharded_run, tmp_path):
    """``mnemo convert --from-dcp SRC OUT`` "adds OUT/ckpt-STEP (and OUT/latest) ... and replaces
    nothing else": into a folder holding another run's ckpt-000001 and ckpt-000002 it wrote
    ckpt-000001 over theirs (their checkpoint of that step deleted), kept the newest two and
    pointed their ``latest`` at it. Now refused, naming the folder and what it holds."""
    from mnemo.train.sharded import consolidate_checkpoint

    run, weights = sharded_run
    out = tmp_path / "other"
    before = _other_run(out)
    with pytest.raises(ValueError, match=r"already holds a run \(ckpt-000001, ckpt-000002, latest\)"):
        consolidate_checkpoint(run, out)
    after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    # the source's own run folder holds a run too: its sharded checkpoint is never replaced
    with pytest.raises(ValueError, match="already holds a run"):
        consolidate_checkpoint(run / "ckpt-000001", run)
    assert (run / "ckpt-000001" / "sharded" / ".metadata").is_file()
    # a new folder: the single-file checkpoint of the same weights
    ckpt = consolidate_checkpoint(run, tmp_path / "new")
    got = load_file(str(ckpt / "model.safetensors"))
    assert "embed.weight" in got
    for k, w in got.items():  # (a tied head is saved once)
        torch.testing.assert_close(w, weights[k], rtol=0, atol=0)


def test_a_damaged_shard_without_a_manifest_is_a_named_corrupt_checkpoint(sharded_run, tmp_path):
    """A sharded checkpoint without ``manifest.json`` (an older mnemo's, or the manifest deleted)
    is loaded unverified; a truncated shard then raised DCP's ``CheckpointException`` — a
    ``BaseException``, so ``except Exception`` (the CLI's error handling, the trainer's
    ``CorruptCheckpointError`` for a damaged single-file checkpoint) never saw it."""
    from mnemo.train.sharded import consolidate_checkpoint

    run = tmp_path / "run"
    shutil.copytree(sharded_run[0], run)
    ckpt = run / "ckpt-000001"
    (ckpt / "manifest.json").unlink()
    shard = next((ckpt / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    where = f"DCP could not read {ckpt / 'sharded'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (loading it unverified: said)
        with pytest.raises(
            CorruptCheckpointError, match="no manifest.json: its shards were not checked"
        ) as e:
            Trainer(None, run, resume=True, progress=False, log=lambda *a: None)
        assert where in str(e.value) and e.value.ckpt == ckpt
        with pytest.raises(CorruptCheckpointError, match="its shards were not checked"):
            consolidate_checkpoint(run, tmp_path / "single")


def _ckpt(run: Path, step: int) -> Path:
    c = run / f"ckpt-{step:06d}"
    c.mkdir(parents=True)
    (c / "config.json").write_text("{}")
    write_manifest(c)
    return c


def test_latest_naming_a_link_beside_its_checkpoint_resolves_to_the_folder(tmp_path):
    """``ckpt-000009 -> ckpt-000003`` (a link made by hand inside the run): mnemo never resumes from
    nor rotates a link, yet ``latest`` naming it returned the link; the resumed run (step 3) then
    set the "newer" ckpt-000009 aside and wrote ``latest`` = ckpt-000009, which had just moved."""
    run = tmp_path / "run"
    own = _ckpt(run, 3)
    os.symlink("ckpt-000003", run / "ckpt-000009")
    (run / "latest").write_text("ckpt-000009\n")
    assert resolve_checkpoint(run) == own


def test_the_fallback_past_a_damaged_checkpoint_skips_links(tmp_path):
    """``latest`` names a damaged ckpt-000010; the fallback took the newest ``ckpt-*`` directory
    below it, the link ckpt-000009 (to ckpt-000003) included."""
    run = tmp_path / "run"
    own = _ckpt(run, 3)
    os.symlink("ckpt-000003", run / "ckpt-000009")
    bad = _ckpt(run, 10)
    (bad / "config.json").write_text("{1}")
    (run / "latest").write_text("ckpt-000010\n")
    said: list[str] = []
    assert resolve_checkpoint(run, warn=said.append) == own
    assert f"{bad / 'config.json'} has 3 bytes" in said[0] and f"using {own} instead" in said[0]


def test_an_fsdp_run_resumed_on_one_process_writes_a_checkpoint_torchrun_can_resume(sharded_run, tmp_path):
    """An FSDP run "resumes on any number of processes (one included)"; on one process it writes
    single-file checkpoints, but their ``train_config.json`` kept ``fsdp: true``: a later
    ``torchrun ... mnemo train --resume`` then ran sharded and refused the single-file checkpoint
    ("resume it without --fsdp"), and no flag of ``mnemo train --resume`` turns a saved --fsdp off.
    The checkpoint now says ``fsdp: false`` (as a consolidated one does): it resumes data-parallel."""
    from mnemo.train.checkpoint import load_json
    from mnemo.train.strategy import DataParallel, make_strategy

    run = tmp_path / "run"
    shutil.copytree(sharded_run[0], run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warm-up as long as the schedule: said)
        tr = Trainer({"steps": 2, "schedule_steps": 1}, run, resume=True, progress=False, log=lambda *a: None)
        assert tr.cfg.fsdp and not tr.fsdp  # one process: the saved flag, trained unsharded
        tr.fit()
    saved = TrainConfig.from_dict(load_json(run / "ckpt-000002" / "train_config.json"))
    assert not (run / "ckpt-000002" / "sharded").exists() and saved.fsdp is False
    assert saved == TrainConfig.from_dict({**tr.cfg.to_dict(), "fsdp": False})
    assert isinstance(make_strategy(saved, torch.device("cpu"), 0, 2), DataParallel)
