"""The memory check before training: a hand-computed lower bound, and a clear refusal that
leaves nothing behind."""

from __future__ import annotations

import os

import pytest
import torch

from mnemo.cli import main
from mnemo.train import memory_estimate as me


def test_the_estimate_counts_what_certainly_exists():
    shape = dict(n_params=1000, vocab_size=65, d_model=32, n_layers=2, batch_size=8, micro_rows=4, seq_len=16)
    # the chunked head and a task's head hold no [rows, T, vocab] logits: by default none are counted
    lean = me.estimate_memory(**shape)
    assert lean.logits == 0 and lean.eval_logits == 8 * 16 * 65 * 4  # the evaluation batch's fp32 logits
    est = me.estimate_memory(**shape, full_logits=True, eval_log_softmax=True)
    assert est.parameters == 4 * 1000 * 4  # weights, grads, two AdamW moments, fp32
    assert est.batch == 2 * 8 * 17 * 8  # int64 windows of seq_len + 1 and their index
    assert est.logits == 3 * 4 * 16 * 65 * 4  # a micro-batch's logits, log-softmax and gradient
    assert est.activations == 2 * 5 * 4 * 16 * 32 * 4
    assert est.eval_logits == 2 * 8 * 16 * 65 * 4  # evaluation runs the whole batch
    assert est.step == est.parameters + est.batch + est.logits + est.activations
    assert est.peak == max(est.step, est.parameters + est.batch + est.eval_logits)
    ckpt = me.estimate_memory(
        n_params=1000,
        vocab_size=65,
        d_model=32,
        n_layers=2,
        batch_size=8,
        micro_rows=4,
        seq_len=16,
        activation_checkpointing=True,
        full_logits=True,
        eval_log_softmax=True,
    )
    assert ckpt.activations == est.activations // 5  # one tensor per block is kept


def test_a_step_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--batch-size", "100000000", "--steps", "1", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.batch_size: a step of 100,000,000 x 128 tokens needs at least" in err
    assert "GiB are available" in err and "lower --batch-size" in err
    assert not out.exists()  # no empty run folder left behind
    # the threshold is the machine's memory: pretend 1 MiB is free and a small step is refused too
    monkeypatch.setattr(me, "available_memory", lambda device: (2**20, "a test"))
    argv = [
        "train",
        "--out",
        str(out),
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 2
    assert "but only 0.0 GiB are available (a test)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc/meminfo")
def test_available_memory_reads_the_machine():
    have, source = me.available_memory(torch.device("cpu"))
    assert have is not None and have > 2**26 and source
    with open("/proc/meminfo") as f:
        total = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemTotal:"))
    assert have <= total


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_step_that_fits_is_not_refused(checkpointing):
    est = me.estimate_memory(
        n_params=10**6,
        vocab_size=65,
        d_model=128,
        n_layers=4,
        batch_size=32,
        micro_rows=32,
        seq_len=128,
        activation_checkpointing=checkpointing,
    )
    me.check_memory(est, torch.device("cpu"), what="a default step")  # about 0.1 GiB: no error


def test_longer_evaluation_lengths_are_checked_as_they_are_streamed(tmp_path, monkeypatch):
    """``--eval-lengths`` is evaluated in pieces of ``seq_len`` with ``eval_batch_size`` rows and the
    state carried (:func:`mnemo.train.task_eval.evaluate_task`): an L of 32,768 at batch 64 streams 1
    row of 256-token pieces (8 MiB of logits at vocab 8,192), which the check counted as 64 whole
    sequences (64 GiB) and refused with 2 GiB free."""
    from mnemo.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model="gated_deltanet", model_overrides={"d_model": 32, "n_layers": 1}, task="mqar",
        task_options={"num_pairs": 4, "vocab_size": 8192}, seq_len=256, batch_size=64, steps=1,
        eval_batches=1, warmup_steps=0, eval_lengths=[32768], sample_tokens=0,
    )  # fmt: skip
    monkeypatch.setattr(me, "available_memory", lambda device: (2 * 2**30, "a test"))
    Trainer(cfg, tmp_path / "fits", progress=False)  # not refused


def test_a_model_learning_from_the_task_signal_is_checked_with_its_full_logits(tmp_path, monkeypatch):
    """CMS levels that learn from the next-token loss hold a micro-batch's full ``[rows, T, vocab]``
    logits (the chunked head does not apply): with memory for the lean bound but not for those,
    ``hope`` is refused and ``hope_reconstruction`` (the same model, reconstruction levels) is not."""
    from mnemo.train import TrainConfig, Trainer

    def cfg(model):
        return TrainConfig(
            model=model, model_overrides={"d_model": 16, "n_layers": 1}, seq_len=64, batch_size=16,
            steps=1, eval_batches=1, warmup_steps=0, sample_tokens=0,
        )  # fmt: skip

    lean = Trainer(cfg("hope_reconstruction"), tmp_path / "probe", progress=False)
    sizes = dict(
        n_params=lean.model.num_parameters(), vocab_size=lean.model.config.vocab_size, d_model=16, n_layers=1,
        batch_size=16, micro_rows=16, seq_len=64, eval_log_softmax=True,
    )  # fmt: skip
    low, high = me.estimate_memory(**sizes).peak, me.estimate_memory(**sizes, full_logits=True).peak
    assert high > 1.5 * low
    monkeypatch.setattr(me, "available_memory", lambda device: ((low + high) // 2, "a test"))
    Trainer(cfg("hope_reconstruction"), tmp_path / "recon", progress=False)
    with pytest.raises(ValueError, match="a step of 16 x 64 tokens needs at least"):
        Trainer(cfg("hope"), tmp_path / "task", progress=False)
