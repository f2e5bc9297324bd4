"""Gradient accumulation under DDP (2 gloo processes, one short run): the micro-batches before the
last run under ``no_sync``, so the gradients are all-reduced once per optimizer step, in the last
micro-batch's backward, and the step equals the single-process step on the whole batch.

A small, fast companion of ``test_ddp.py`` (which covers more, in about 40 s): this one is in the
trainer's group of ``scripts/mutation.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mnemo.train import TrainConfig, Trainer
from tests.helpers import free_port, join_as_torchrun, spawn

ACCUM, STEPS = 2, 2


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model="transformer",
        model_overrides={"d_model": 16, "n_layers": 1},
        seq_len=16,
        batch_size=4,  # 2 rows per rank, micro-batches of 1 row
        steps=STEPS,
        eval_batches=1,
        warmup_steps=0,
        sample_tokens=0,
        seed=5,
    )
    base.update(kw)
    return TrainConfig(**base)


def _worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from mnemo.train.distributed import cleanup

    try:
        tr = Trainer(_cfg(grad_accum=ACCUM), Path(out) / "run", progress=False)
        forwards, syncs = [0], []
        tr.model.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))

        def counting_allreduce(state, bucket):  # DDP calls it for each bucket it all-reduces
            syncs.append(forwards[0])  # the micro-batch (1, 2, …) whose backward syncs
            return allreduce_hook(None, bucket)

        tr.ddp.register_comm_hook(None, counting_allreduce)
        losses = [tr.train_step() for _ in range(STEPS)]
        params = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        torch.save(
            {"losses": losses, "params": params, "forwards": forwards[0], "syncs": syncs},
            Path(out) / f"rank{rank}.pt",
        )
    finally:
        cleanup()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_no_sync")
    spawn(_worker, (2, free_port(), str(out)), 2, start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_gradients_are_all_reduced_once_per_step_in_the_last_micro_batch(ranks):
    for r in ranks:
        assert r["forwards"] == STEPS * ACCUM
        # every all-reduce happens in the backward of micro-batch ACCUM, 2·ACCUM, …: none in the
        # deferred micro-batches, at least one bucket in every step's last one
        assert r["syncs"] and all(f % ACCUM == 0 for f in r["syncs"]), r["syncs"]
        assert sorted(set(r["syncs"])) == [ACCUM * (s + 1) for s in range(STEPS)], r["syncs"]


def test_accumulated_ddp_steps_equal_the_single_process_steps(ranks, tmp_path):
    single = Trainer(_cfg(), tmp_path / "single", progress=False)  # whole batch, no accumulation
    losses = [single.train_step() for _ in range(STEPS)]
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        for n, p in single.model.named_parameters():
            torch.testing.assert_close(r["params"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"weights {n}")
