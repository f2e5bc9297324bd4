"""Third break-it review of the training loop: interactions and rarer paths. A step interrupted
between its micro-batches leaves no trace (a second ``fit`` trains on the uninterrupted run's
batches, MoE statistics included); a full ``TrainConfig`` given again to a run resumed with
``reschedule="hold"`` does not silently unpin its cosine; ``evaluate`` refuses a batch count that
means nothing instead of reporting a validation loss of 0."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.train import TrainConfig, Trainer
from mnemo.train.optim import lr_factor
from tests.train.test_review2_training import TINY as REVIEW2_TINY

TINY = {**REVIEW2_TINY, "warmup_steps": 2, "steps": 8}


def _trainer(out, cfg=None, **kw):
    cfg = TrainConfig.from_dict({**TINY, **kw}) if cfg is None else cfg
    return Trainer(cfg, out, progress=False, log=lambda *a: None)


def _losses(trainer) -> list[float]:
    """The losses of every step ``trainer`` takes from now on."""
    out, step = [], trainer.train_step

    def counted():
        loss = step()
        out.append(loss)
        return loss

    trainer.train_step = counted
    return out


_TIMING = ("tokens_per_s", "elapsed_s")


def _records(path):
    return [
        {k: v for k, v in json.loads(line).items() if k not in _TIMING}
        for line in path.read_text().splitlines()
    ]


def test_a_step_interrupted_between_micro_batches_is_run_again_on_the_same_batch(tmp_path):
    """A KeyboardInterrupt (a second Ctrl-C, or one outside the deferred handler) in the second
    micro-batch of step 3 left the batch generator one batch ahead and the MoE statistics of the
    first micro-batch in the step's sums: a second ``fit`` of the same trainer trained on other
    batches than the uninterrupted run (losses from step 3 on differed) and counted that
    micro-batch's expert loads twice."""
    kw = dict(
        model="gated_deltanet_attention_moe",
        model_overrides={"d_model": 16, "n_layers": 2},
        grad_accum=2,
        steps=6,
    )
    ref = _trainer(tmp_path / "ref", **kw)
    ref_losses = _losses(ref)
    ref.fit()
    t = _trainer(tmp_path / "run", **kw)
    losses = _losses(t)
    forward, calls = t.train_model.forward, [0]

    def interrupted_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 6:  # step 3 (1-based), micro-batch 2
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    t.train_model.forward = interrupted_forward
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    assert t.step == 2 and all(p.grad is None for p in t.model.parameters())
    t.fit()
    assert losses == ref_losses  # exact: the same batches, in the same order
    for a, b in zip(ref.model.state_dict().values(), t.model.state_dict().values()):
        assert torch.equal(a, b)
    ours, theirs = _records(tmp_path / "run" / "metrics.jsonl"), _records(tmp_path / "ref" / "metrics.jsonl")
    assert [r["moe_load"] for r in ours] == [r["moe_load"] for r in theirs]
    assert ours == theirs


def test_a_held_schedule_is_not_unpinned_by_the_full_config_given_again(tmp_path):
    """Resuming with a full TrainConfig: the first resume (steps 8 -> 12, ``hold``) pins the cosine
    to 8 steps (``schedule_steps = 8`` is saved); resuming again with the *same* TrainConfig (its
    ``schedule_steps`` None) silently stretched the cosine to 12 steps — the lr at step 6 jumped
    from 0.000975 to 0.00207 without the reschedule choice the first resume had to make."""
    cfg12 = TrainConfig.from_dict({**TINY, "steps": 12})
    _trainer(tmp_path).fit(until=4)
    held = Trainer(cfg12, tmp_path, resume=True, reschedule="hold", progress=False, log=lambda *a: None)
    assert held.cfg.cosine_steps == 8
    held.fit(until=6)
    with pytest.raises(
        ValueError, match=r"schedule_steps: 8 -> None.*--reschedule stretch.*--reschedule hold"
    ):
        Trainer(cfg12, tmp_path, resume=True, progress=False, log=lambda *a: None)
    again = Trainer(cfg12, tmp_path, resume=True, reschedule="hold", progress=False, log=lambda *a: None)
    assert again.cfg.cosine_steps == 8
    # by hand: warm-up 2, cosine over 8 steps to 0.1·lr; step 6 is 4/6 of the way: 0.1 + 0.9·(1 + cos(2π/3))/2
    assert again.scheduler.get_last_lr()[0] == pytest.approx(3e-3 * 0.325, rel=1e-12)
    lrs = []
    step = again.train_step

    def logged():
        loss = step()
        lrs.append(again.last_lr)
        return loss

    again.train_step = logged
    again.fit()
    assert lrs == pytest.approx([3e-3 * lr_factor(s, 2, 8, 0.1) for s in range(6, 12)], rel=1e-12)
    assert lrs[2:] == pytest.approx([3e-4] * 4, rel=1e-12)  # past the held cosine: lr · min_lr_ratio
    # a number given for schedule_steps pins the cosine there, no reschedule needed
    pinned = Trainer({"schedule_steps": 10}, tmp_path, resume=True, progress=False, log=lambda *a: None)
    assert pinned.cfg.cosine_steps == 10


@pytest.mark.parametrize("task", [None, "mqar"])
def test_evaluate_refuses_a_batch_count_that_means_nothing(tmp_path, task):
    """``Trainer.evaluate(0)`` of a text run returned ``val_loss 0.0`` (no batch: 0 / 1), ``-1``
    evaluated all but the last batch of the split, ``1.5`` raised torch's "slice indices must be
    integers"; a task run's error named ``batch_size``, not the argument given."""
    kw = {"task": task, "seq_len": 32} if task else {}
    t = _trainer(tmp_path, **kw)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"max_batches: expected None or an int >= 1.*got {bad!r}"):
            t.evaluate(bad)
    assert t.evaluate(1)["val_loss"] > 0
