"""Failures of one process and models FSDP cannot shard: a rank that leaves on an exception its peers
do not share does not wait for them in ``cleanup`` (they would wait for each other until the
group's timeout), and ``--fsdp`` refuses what FSDP2 cannot run naming the field, before any work."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mnemo.models import LanguageModel, build_config
from mnemo.train import TrainConfig
from mnemo.train.strategy import Sharded
from tests.helpers import free_port, join_as_torchrun, spawn

#: the process group's timeout in the test: a rank stuck longer than this would fail anyway
GROUP_TIMEOUT_S = 30


def _one_rank_fails_worker(rank, world, port, out):
    from mnemo.train.distributed import cleanup

    join_as_torchrun(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    t0 = time.monotonic()
    try:
        try:  # as `mnemo train` runs a command: `finally: cleanup()`
            if rank == 1:
                raise RuntimeError("bad data on rank 1")  # (an out-of-memory error, say)
            dist.all_reduce(torch.ones(1))  # rank 0 is in the step's collective meanwhile
        finally:
            cleanup()
    except RuntimeError as e:
        (Path(out) / f"rank{rank}.txt").write_text(f"{time.monotonic() - t0}\n{e}")


def test_a_rank_leaving_on_an_exception_does_not_wait_for_its_peers(tmp_path):
    spawn(
        _one_rank_fails_worker, (2, free_port(), str(tmp_path)), 2, timeout_s=120, start_method="forkserver"
    )
    for rank in range(2):
        seconds, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        # without the fix both ranks waited for each other until the group's timeout
        assert float(seconds) < GROUP_TIMEOUT_S / 2, (rank, seconds, message)
    assert "bad data on rank 1" in (tmp_path / "rank1.txt").read_text()


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model="transformer",
        model_overrides={"d_model": 16, "n_layers": 1},
        seq_len=16,
        batch_size=4,
        steps=1,
        sample_tokens=0,
        fsdp=True,
    )
    base.update(kw)
    return TrainConfig(**base).validate()


def test_fsdp_refuses_scalar_parameters_naming_the_field():
    """The HOPE models' self-modifying mixers hold 0-d parameters; ``fully_shard`` refused them with
    torch's own advice (change the parameter's shape), which a user of a registered model cannot
    follow."""
    cfg = _cfg(model="hope_reconstruction")
    model = LanguageModel(build_config(cfg.model, vocab_size=32, d_model=16, n_layers=1))
    assert any(p.ndim == 0 for p in model.parameters())
    with pytest.raises(ValueError, match=r"TrainConfig.fsdp: this model has scalar \(0-d\) parameters"):
        Sharded(cfg, torch.device("cpu"), 0, 2).prepare(model)  # refused before any collective


def test_fsdp_refuses_packed_documents_with_cms_levels():
    """A packed document shorter than a CMS level's period leaves the level without a gradient on
    one process only; FSDP2 then reduce-scatters different parameters on the two processes and gloo
    aborts (SIGABRT) in the first step. DDP searches for unused parameters there; FSDP refuses."""
    cfg = _cfg(model="hope_attention_reconstruction", pack_documents=True)
    model = LanguageModel(build_config(cfg.model, vocab_size=32, d_model=16, n_layers=1))
    with pytest.raises(ValueError, match=r"TrainConfig.fsdp: not with pack_documents and a model with CMS"):
        Sharded(cfg, torch.device("cpu"), 0, 2).prepare(model)
