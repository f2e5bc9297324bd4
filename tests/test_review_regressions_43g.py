"""Regression review 43g: the resume refusal's ``--init-from`` path and ``consolidate_checkpoint``'s OUT
check (commit "bench --suite all checks every later suite's arguments ...")."""

from __future__ import annotations

import shlex

import pytest
import torch


def test_resume_refusal_gives_an_init_from_path_with_a_space_as_one_shell_word(tmp_path):
    """The refusal of an optimizer state of other groups suggests ``--init-from CKPT``; with a space in
    the run's path the path was printed bare, so the pasted flag split into two words (``--init-from
    /x/my`` and ``runs/...``). Read as a shell reads it, the word after ``--init-from`` must be the
    checkpoint's path."""
    from mnemo.train import TrainConfig, Trainer
    from mnemo.train.checkpoint import STATE_NAME, write_manifest

    cfg = TrainConfig(
        model="gla",
        model_overrides={"d_model": 16, "n_layers": 1},
        task="mqar",
        task_options={"num_pairs": 2, "vocab_size": 16},
        train_examples=8,
        seq_len=16,
        batch_size=2,
        steps=1,
        eval_interval=1,
        eval_batches=1,
        warmup_steps=0,
        sample_tokens=0,
    )
    run = tmp_path / "my runs" / "run"
    Trainer(cfg, run, progress=False).fit()
    ckpt = run / "ckpt-000001"
    state = torch.load(ckpt / STATE_NAME, map_location="cpu", weights_only=False)
    del state["optimizer"]["param_groups"][-1]
    torch.save(state, ckpt / STATE_NAME)
    write_manifest(ckpt)
    with pytest.raises(ValueError) as info:
        Trainer(cfg, run, resume=True, progress=False)
    after = str(info.value).split("--init-from ", 1)[1]
    assert shlex.split(after.split(" (TrainConfig", 1)[0]) == [str(ckpt)]


@pytest.mark.parametrize("inside", [False, True])
def test_consolidate_checkpoint_into_a_dangling_link_names_out(tmp_path, inside):
    """OUT (or a parent of it) a link to nothing passed the new "is a file" check (``exists()`` follows
    the link) and ``mkdir`` raised the raw ``FileExistsError`` ("[Errno 17] File exists") the check
    was added to replace; now a ValueError naming OUT, the link and its target, nothing created."""
    from mnemo.train.sharded import consolidate_checkpoint

    link = tmp_path / "out"
    target = tmp_path / "gone"
    link.symlink_to(target)
    out = link / "run" if inside else link
    with pytest.raises(ValueError, match="OUT: ") as info:
        consolidate_checkpoint(tmp_path / "no_such_run", out)
    msg = str(info.value)
    assert str(out) in msg and str(link) in msg and str(target) in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not target.exists()
