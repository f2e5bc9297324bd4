"""Two gloo processes on CPU: context parallelism equals the single-process pass (outputs, grads)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mnemo.models import LanguageModel, build_config
from tests.helpers import free_port, spawn

MODELS = ["gated_deltanet", "titans_lmm"]  # a matrix-state mixer and a test-time-trained memory


def _model(name):
    torch.manual_seed(0)
    cfg = build_config(
        name,
        vocab_size=32,
        d_model=16,
        n_layers=2,
        **({"mixer_options": {"neural_memory": {"chunk_size": 4}}} if name == "titans_lmm" else {}),
    )
    return LanguageModel(cfg).double()


def _ids():
    return torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))


def _cp_worker(rank, world, port, names, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from mnemo.train.distributed import context_parallel_forward

        torch.set_num_threads(1)
        for name in names:
            model = _model(name)
            logits, handle = context_parallel_forward(model, _ids(), rank, world)
            handle.backward(logits.square().sum())
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            result = {"logits": logits.detach(), "grads": grads}
            torch.save(result, os.path.join(out, f"{name}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_parts(tmp_path_factory):
    """One pair of processes runs every model of ``MODELS`` in turn (starting the processes is most
    of the cost); each model's pass writes its own files."""
    out = tmp_path_factory.mktemp("cp")
    spawn(_cp_worker, (2, free_port(), MODELS, str(out)), 2, start_method="forkserver")
    return out


@pytest.mark.parametrize("name", MODELS)
def test_context_parallel_equals_single_process(name, cp_parts):
    world = 2
    parts = [torch.load(cp_parts / f"{name}-rank{r}.pt") for r in range(world)]
    model = _model(name)
    logits, _ = model(_ids())
    logits.square().sum().backward()
    torch.testing.assert_close(
        torch.cat([p["logits"] for p in parts], 1), logits.detach(), rtol=1e-10, atol=1e-10
    )
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = sum(part["grads"].get(n, torch.zeros_like(p.grad)) for part in parts)
        torch.testing.assert_close(g, p.grad, rtol=1e-8, atol=1e-10, msg=f"gradient of {n}")


def test_context_parallel_runs_attention_on_the_ring_and_refuses_what_it_cannot_carry():
    from mnemo.train.distributed import check_context_parallel

    assert check_context_parallel(_model("transformer")) == [0, 1]  # ring attention in both layers
    assert check_context_parallel(_model("gated_deltanet")) == []  # relays only
    torch.manual_seed(0)
    sinks = LanguageModel(
        build_config(
            "transformer",
            vocab_size=32,
            d_model=16,
            n_layers=2,
            mixer_options={"attention": {"window": 4, "n_sink": 2}},
        )
    )
    with pytest.raises(
        ValueError, match=r"layer 0: attention sinks \(n_sink = 2\) are not supported by ring"
    ):
        check_context_parallel(sinks)
    cms = LanguageModel(build_config("transformer", vocab_size=32, d_model=16, n_layers=1, mlp="cms"))
    with pytest.raises(ValueError, match=r"layer 0: softmax attention followed by a stateful MLP \(CMS\)"):
        check_context_parallel(cms)


def _leave_worker(rank, world, port, out):
    import time

    from mnemo.train.distributed import cleanup, init_from_env
    from tests.helpers import join_as_torchrun

    join_as_torchrun(rank, world, port)
    init_from_env()
    if rank == 1:
        # the peer's teardown is slow: rank 0 (the store's host) must still wait for it
        real = dist.destroy_process_group

        def slow_destroy(*a, **k):
            time.sleep(1.0)
            real(*a, **k)
            (out / "peer_done").write_text(repr(time.time()))

        dist.destroy_process_group = slow_destroy
    cleanup()
    if rank == 0:
        (out / "host_left").write_text(repr(time.time()))


def test_cleanup_lets_the_store_host_leave_last(tmp_path):
    spawn(_leave_worker, (2, free_port(), tmp_path), 2, start_method="forkserver")
    peer_done = float((tmp_path / "peer_done").read_text())
    host_left = float((tmp_path / "host_left").read_text())
    assert host_left >= peer_done, (host_left, peer_done)


def _absent_peer_worker(rank, world, port, out):
    import warnings

    from mnemo.train.distributed import cleanup, init_from_env
    from tests.helpers import join_as_torchrun

    join_as_torchrun(rank, world, port)
    init_from_env()
    if rank == 1:  # leaves without counting itself out (as a peer killed after the barrier would)
        dist.barrier()
        dist.destroy_process_group()
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cleanup(timeout_s=0.5)
    (out / "warned").write_text("\n".join(str(w.message) for w in caught))


def test_cleanup_warns_when_a_peer_never_counts_itself_out(tmp_path):
    spawn(_absent_peer_worker, (2, free_port(), tmp_path), 2, start_method="forkserver")
    assert "0 of 1 other ranks left the process group within 0.5 s" in (tmp_path / "warned").read_text()


def _sleeper(rank, seconds):
    import time

    time.sleep(seconds)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_spawn_fails_and_kills_ranks_that_outlive_the_deadline(start_method):
    import time

    if start_method == "forkserver":  # the server's own start (its imports) is not what is timed
        spawn(_sleeper, (0,), 2, start_method=start_method)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] of 2 still running after 1 s: killed"):
        spawn(_sleeper, (60,), 2, timeout_s=1.0, start_method=start_method)
    assert time.monotonic() - t0 < 30  # killed, not waited for
