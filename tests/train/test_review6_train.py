"""Sixth break-it review of the training loop. Resuming a run with ``steps`` below the step it
reached trained nothing and said nothing (the library's ``fit()`` returned ``{}``; without
``reschedule`` the error asked to choose a schedule for a run that would not train): both now
name ``steps``, the step reached and what to do. ``Trainer.evaluate(lengths=...)`` on a text run
ignored ``lengths``: it is refused, naming it."""

from __future__ import annotations

import warnings

import pytest

from mnemo.cli import main
from mnemo.train import TrainConfig, Trainer
from tests.train.test_review2_training import TINY

QUIET = dict(progress=False, log=lambda *a: None)


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A tiny text run trained to step 4 (checkpoints at 2 and 4)."""
    out = tmp_path_factory.mktemp("r6g") / "run"
    Trainer(TrainConfig.from_dict({**TINY, "steps": 4, "eval_interval": 2}), out, **QUIET).fit()
    return out


def test_resume_below_the_reached_step_warns_naming_steps(run4):
    """``Trainer({"steps": 2}, run, resume=True, reschedule="hold").fit()`` on a run at step 4
    returned ``{}`` without a word."""
    t = Trainer({"steps": 2}, run4, resume=True, reschedule="hold", **QUIET)
    with pytest.warns(
        UserWarning, match=r"steps: the run is already at step 4, past steps=2: .*raise steps above 4"
    ):
        assert t.fit() == {}
    assert t.step == 4 and (run4 / "latest").read_text() == "ckpt-000004\n"
    # a run that still has steps to go says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer({"steps": 4}, run4, resume=True, **QUIET)


def test_resume_below_the_reached_step_without_reschedule_names_steps_not_the_schedule(run4, capsys):
    """Without ``reschedule`` the error asked to choose ``stretch`` or ``hold`` for a run that would
    then train nothing; it now says the run is past ``steps`` (library and ``mnemo train``)."""
    said = r"TrainConfig.steps: the run is already at step 4, past steps=2 .*raise steps above 4"
    with pytest.raises(ValueError, match=said):
        Trainer({"steps": 2}, run4, resume=True, **QUIET)
    argv = ["train", "--out", str(run4), "--resume", "--steps", "2", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already at step 4, past steps=2" in err and "--reschedule" not in err, err


def test_evaluate_lengths_on_a_text_run_is_refused_naming_lengths(run4):
    """``evaluate(lengths=[64])`` on a text run returned the seq_len evaluation as if the lengths
    had been evaluated (no ``@64`` keys, no word)."""
    t = Trainer(None, run4, resume=True, **QUIET)
    with pytest.raises(ValueError, match=r"^lengths: .*task run.*got lengths=\[64\].*mnemo eval"):
        t.evaluate(1, lengths=[64])
    assert set(t.evaluate(1, lengths=[])) == {"val_loss", "val_bpc", "val_tokens"}


@pytest.mark.parametrize("until", [1.5, -1, True, "3"])
def test_fit_until_refuses_what_is_not_a_step_number(tmp_path, until):
    """``fit(until=1.5)`` trained 2 steps and wrote no checkpoint at "until" (``step == 1.5`` never
    held); ``until=-1`` returned ``{}`` silently; ``True`` meant step 1. Refused, naming ``until``."""
    t = Trainer(TrainConfig.from_dict({**TINY, "steps": 3}), tmp_path, **QUIET)
    with pytest.raises(ValueError, match=rf"^until: expected None or an int >= 0 .*got {until!r}"):
        t.fit(until=until)
    assert t.step == 0 and not (tmp_path / "latest").exists()


@pytest.mark.parametrize("lengths", [64, "64"])
def test_evaluate_lengths_that_are_not_a_list_are_refused_naming_lengths(tmp_path, lengths):
    """``evaluate(lengths=64)`` on a task run crashed with "'int' object is not iterable";
    ``lengths="64"`` was read character by character ("got '6'")."""
    kw = {**TINY, "task": "mqar", "seq_len": 32}
    t = Trainer(TrainConfig.from_dict(kw), tmp_path, **QUIET)
    with pytest.raises(ValueError, match=rf"^lengths: expected None or a list .*got {lengths!r}$"):
        t.evaluate(1, lengths=lengths)
    assert "val_acc@64" in t.evaluate(1, lengths=(64,))


def test_the_cli_says_a_resume_past_steps_once(run4, capsys):
    """``mnemo train --resume --steps 2 --reschedule hold`` on a run at step 4 says so on stdout;
    the library's warning of the same thing is not printed a second time (exit 0, as before)."""
    argv = ["train", "--out", str(run4), "--resume", "--steps", "2", "--reschedule", "hold", "--no-progress"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "already trained to step 4, past --steps 2: nothing to do" in out, out
    assert not [w for w in caught if "already at step" in str(w.message)], [str(w.message) for w in caught]
