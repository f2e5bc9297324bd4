"""Review of the measurements the published results rest on: each checked against an independent
computation or a measured peak (the reproducers: /work/tmp/review_metrics/)."""

from __future__ import annotations

import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task
from mnemo.train import TrainConfig, Trainer
from mnemo.train import memory_estimate as me
from mnemo.train.task_eval import task_metrics


def test_a_task_run_that_fits_is_not_refused_for_logits_it_never_holds(tmp_path, monkeypatch):
    """A task step computes the head at its supervised positions only and the evaluation holds one
    batch's fp32 logits (64 x 256 x 8192 x 4 B = 0.5 GiB): a whole run of this configuration (2
    steps and an evaluation) grew the process by 0.72 GiB on the CPU (ru_maxrss,
    /work/tmp/review_metrics/mem_peak.py). With 1 GiB free it must not be refused; the bound that
    counted three [64, 256, 8192] fp32 tensors for the step asked for 1.5 GiB."""
    monkeypatch.setattr(me, "available_memory", lambda device: (2**30, "a test"))
    cfg = TrainConfig(
        model="gated_deltanet",
        model_overrides={"d_model": 32, "n_layers": 1},
        task="mqar",
        task_options={"num_pairs": 4, "vocab_size": 8192},
        seq_len=256,
        batch_size=64,
        steps=2,
        eval_batches=1,
        warmup_steps=0,
    )
    Trainer(cfg, tmp_path / "run", progress=False)  # no ValueError
    # what cannot fit is still refused: the evaluation batch's logits alone exceed 0.25 GiB
    monkeypatch.setattr(me, "available_memory", lambda device: (2**28, "a test"))
    with pytest.raises(ValueError, match="TrainConfig.batch_size: a step of 64 x 256 tokens needs at least"):
        Trainer(cfg, tmp_path / "small", progress=False)


class _Logits(torch.nn.Module):
    """Returns fixed logits ``[N, T, V]`` for batches read in order (the state: the batch's first
    row and the piece's offset)."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.next_row = logits, 0

    def forward(self, ids, state=None):
        if state is None:  # a new batch
            state, self.next_row = (self.next_row, 0), self.next_row + ids.shape[0]
        r, a = state
        return self.logits[r : r + ids.shape[0], a : a + ids.shape[1]], (r, a + ids.shape[1])


def test_non_finite_logits_are_never_a_right_answer():
    """Logits that overflowed (NaN/inf, e.g. a model run far past its training length) predict
    nothing: argmax would read them as token 0 (NaN counts as the largest value), so every answer
    0 would count as right while the loss is NaN."""
    V = 4
    y = torch.full((2, 3), IGNORE_INDEX)
    y[:, 2] = 0  # both answers are token 0
    logits = torch.zeros(2, 3, V)
    logits[0, 2] = float("nan")  # overflowed
    logits[1, 2, 0] = 5.0  # right
    r = task_metrics(_Logits(logits), torch.zeros(2, 3, dtype=torch.long), y, batch_size=2)
    assert r["acc"] == 0.5 and r["seq_acc"] == 0.5 and r["n"] == 2


def test_text_evaluation_restores_training_mode_when_it_fails(tmp_path):
    """Evaluation runs in eval mode and gives the model back in the mode it found it, also when a
    forward pass raises (as task evaluation does)."""
    cfg = TrainConfig(
        model="gla",
        model_overrides={"d_model": 16, "n_layers": 1},
        seq_len=16,
        batch_size=2,
        steps=1,
        eval_batches=1,
        warmup_steps=0,
        sample_tokens=0,
    )
    tr = Trainer(cfg, tmp_path / "run", progress=False)
    seen = []

    def boom(module, args):
        seen.append(module.training)
        raise RuntimeError("a forward pass failed")

    handle = tr.model.register_forward_pre_hook(boom)
    tr.model.train()
    with pytest.raises(RuntimeError, match="a forward pass failed"):
        tr.evaluate(1)
    handle.remove()
    assert seen == [False] and tr.model.training


def test_task_metrics_agree_with_a_plain_computation_on_several_answers_per_sequence():
    """``acc`` = right argmax over scored tokens; ``seq_acc`` = answers (niah's queries) with every
    token right, over answers; streamed in uneven pieces and batches, against one plain pass."""
    task = build_task("niah", haystack="noise", num_needles=3, num_queries=3, value_len=2)
    x, y = task.sample(12, 64, seed=1, split="test")
    y = task.scored(x, y)
    units = task.answer_units(x, y)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 64, task.vocab_size, generator=g, dtype=torch.float64)
    right = (torch.rand(12, 64, generator=g) < 0.8) & (y != IGNORE_INDEX)
    logits[right.nonzero(as_tuple=True) + (y[right],)] = 50.0  # right where `right`
    r = task_metrics(_Logits(logits), x, y, batch_size=5, piece_len=7, units=units)
    sup = y != IGNORE_INDEX
    hit = logits.argmax(-1) == y
    ok = [bool(hit[i][(units[i] == k) & sup[i]].all()) for i in range(12) for k in range(3)]
    loss = torch.nn.functional.cross_entropy(logits[sup], y[sup]).item()
    assert r["n"] == int(sup.sum()) == 12 * 3 * 2 and r["answers"] == 36
    assert r["acc"] == pytest.approx(hit[sup].double().mean().item(), abs=0)
    assert r["seq_acc"] == pytest.approx(sum(ok) / 36, abs=0)
    assert r["loss"] == pytest.approx(loss, rel=1e-12)
