"""Session 44's review of the test-suite trims (commits 99bc75c, b894f98, 65a41ab, d43590e, fab5781)."""

from __future__ import annotations

import types


def _schedule(make_scheduler, collection: list[str]) -> dict[str, list[str]]:
    """Run xdist's scheduler as ``make_scheduler`` returns it over two stand-in workers that finish
    each test as soon as they are sent it; returns the node ids each worker was sent."""
    from xdist.remote import Producer

    option = types.SimpleNamespace(numprocesses=2, tx=["2*popen"], dist="loadgroup", loadscopereorder=True)
    config = types.SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    sched = make_scheduler(config=config, log=Producer("test", enabled=False))
    assert sched is not None
    sent: dict[str, list[str]] = {}

    class Worker:
        def __init__(self, name):
            self.gateway = types.SimpleNamespace(id=name)
            self.shutting_down = False
            self.queue: list[int] = []
            sent[name] = []

        def send_runtest_some(self, indices):
            self.queue += indices
            sent[self.gateway.id] += [collection[i] for i in indices]

        def shutdown(self):
            self.shutting_down = True

    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, list(collection))
    sched.schedule()
    while any(w.queue for w in workers):  # each worker finishes one test at a time, in turn
        for w in workers:
            if w.queue:
                sched.mark_test_complete(w, w.queue.pop(0))
    return sent


def test_loadgroup_runs_each_grouped_module_on_one_worker():
    """fab5781: ``--dist loadgroup`` with ``xdist_group`` marks added by tests/conftest.py did not
    group under pytest 9.2 (the worker's ``@group`` suffix no longer reaches the node id): the
    Triton-interpreter module's tests ran on both workers (its 23-33 s child started twice), and the
    multi-process modules on both (two forkservers). Each group is now one worker's, whole."""
    from xdist.scheduler import LoadGroupScheduling

    from tests import conftest

    # (xdist's own scheduler where the conftest makes none: it reads the group from node ids)
    make = getattr(conftest, "pytest_xdist_make_scheduler", None) or LoadGroupScheduling
    interp = [f"tests/ops/test_review5_backends.py::test_x[{i}]" for i in range(6)]
    ranks = [f"tests/train/{m}.py::test_y" for m in ("test_ddp", "test_fsdp", "test_ring_attention_cp")]
    free = [f"tests/test_cli.py::test_z{i}" for i in range(12)]
    sent = _schedule(make, [*interp, *free, *ranks])
    for group in (interp, ranks):
        holders = [w for w, ids in sent.items() if set(group) & set(ids)]
        assert len(holders) == 1, (group[0], {w: [i for i in ids if i in group] for w, ids in sent.items()})
    assert sorted(sum(sent.values(), [])) == sorted([*interp, *free, *ranks])  # each test once
    assert all(set(free) & set(ids) for ids in sent.values())  # the rest still shared
