"""The memory check before training: a hand-computed lower bound, and a clear refusal that
leaves nothing behind."""

from __future__ import annotations

import os

import pytest
import torch

from mnemo.cli import main
from mnemo.train import memory_estimate as me


def test_the_estimate_counts_what_certainly_exists():
    est = me.estimate_memory(
        n_params=1000, vocab_size=65, d_model=32, n_layers=2, batch_size=8, micro_rows=4, seq_len=16
    )
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
