"""Regression review 37e of f2105d7 (a step that raises before its update leaves no trace).

Under FSDP2 with ``grad_accum > 1`` the micro-batches before the last run their backward with
gradient sync off, and FSDP2 keeps those gradients *unsharded*, on its own parameters, not in the
sharded ``.grad`` the optimizer sees: ``optimizer.zero_grad`` in the failed step's clean-up did
not drop them, so a second ``fit`` added the failed step's first micro-batch to the rerun step's
gradient (the loss after that update differed from the uninterrupted run's)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mnemo.train import TrainConfig, Trainer
from tests.helpers import free_port, join_as_torchrun, spawn
from tests.train.test_fsdp import _cfg as fsdp_cfg


def _cfg() -> TrainConfig:
    """test_fsdp's hybrid (gated DeltaNet + attention, ``grad_accum=2``, FSDP), evaluated every step."""
    return fsdp_cfg(eval_interval=1)


def _records(run: Path) -> list[tuple]:
    return [
        (r["step"], r["train_loss"], r["val_loss"])
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    ]


def _fsdp_worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    from mnemo.train.distributed import cleanup

    out = Path(out)
    try:
        Trainer(_cfg(), out / "ref", progress=False, log=lambda *a: None).fit()
        t = Trainer(_cfg(), out / "run", progress=False, log=lambda *a: None)
        forward, calls = t.model.forward, [0]

        def failing_forward(*args, **kwargs):
            if torch.is_grad_enabled():  # training forwards only (every rank evaluates under FSDP)
                calls[0] += 1
                if calls[0] == 6:  # step 3, micro-batch 2: after micro-batch 1's backward (no sync)
                    raise RuntimeError("injected")
            return forward(*args, **kwargs)

        t.model.forward = failing_forward
        try:
            t.fit()
        except RuntimeError as e:
            assert "injected" in str(e) and t.step == 2
        else:
            raise AssertionError("the injected failure did not happen")
        t.fit()
    finally:
        cleanup()


def test_fsdp_a_failed_step_leaves_no_unsharded_gradient_behind(tmp_path):
    spawn(_fsdp_worker, (2, free_port(), str(tmp_path)), 2, start_method="forkserver")
    ref, run = _records(tmp_path / "ref"), _records(tmp_path / "run")
    assert [r[0] for r in run] == [1, 2, 3, 4]
    assert run == ref  # exact: the same batches and gradients on the same two processes
