"""Test-session settings shared by every test module.

Under pytest-xdist (the default run: ``addopts`` in pyproject.toml, one worker per core) each worker
computes with one intra-op thread, and so do the processes the tests start: two workers with two
threads each on a 2-core machine spend their time in OpenMP's spin-waits (measured: the same file
took 4x the wall time with 2 threads beside another job as with 1)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _small_matmul_yardstick(monkeypatch):
    """The ops suite's matmul peak (a yardstick printed beside each row, 2048² by default) timed at
    256² in tests: the suite's commands run here for their rows, columns and exit codes, and the
    2048² products took most of their time (12 of 19 s for ``mnemo bench`` at T 64)."""
    import mnemo.bench.ops as ops

    monkeypatch.setattr(ops, "PEAK_N", 256)


#: modules whose module-scoped fixtures start processes (the Triton interpreter's child; the ranks'
#: forkserver, which imports torch and mnemo once per pytest worker): each runs on one xdist worker
#: (``--dist loadgroup`` in addopts), so a fixture is not set up once per worker (the interpreter
#: module's child, 23-33 s, ran twice when its tests were split); the interpreter modules share one
#: group, so one child runs all their cases (``interpret_worker.shared_child``), and so do the
#: multi-process modules, so one forkserver serves them all
_ONE_WORKER = {
    "tests/ops/test_backends_interpret.py": "interpret",
    "tests/ops/test_review2_backends.py": "interpret",
    "tests/ops/test_review5_backends.py": "interpret",
    "tests/ops/test_review6_backends.py": "interpret",
    "tests/ops/test_review7_backends.py": "interpret_review7",
    **{
        f"tests/train/{name}.py": "ranks"
        for name in (
            "test_ddp",
            "test_distributed",
            "test_context_parallel_train",
            "test_fsdp",
            "test_review5_distributed",
            "test_ddp_no_sync",
            "test_ring_attention_cp",
            "test_review_regressions_40c",
            "test_review_distributed",
        )
    },
    "tests/test_review_regressions_37e.py": "ranks",
}


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (first result wins)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` grouped by :data:`_ONE_WORKER` as read from each node id's module path:
    xdist's own scheduler reads the group from a ``@group`` suffix its worker writes into the node id
    for an ``xdist_group`` mark, which pytest 9.2's structured node ids no longer take (pytest-xdist
    #1386: such marks grouped nothing and every module's tests went to both workers)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = _ONE_WORKER.get(nodeid.split("::")[0])
            return group if group is not None else super()._split_scope(nodeid)

    return OneWorkerGroups(config, log)
