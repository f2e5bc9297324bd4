"""Comparison helpers shared by the tests (relative RMS error with an absolute floor)."""

from __future__ import annotations

import contextlib

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``rms(a − b) / max(rms(b), floor)`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).pow(2).mean().sqrt().item() if a.numel() else 0.0
    ref = b.pow(2).mean().sqrt().item() if b.numel() else 0.0
    return err / max(ref, floor, 1e-300)


def assert_close(actual, expected, tol: float, floor: float = 1e-6, what: str = "") -> None:
    """Assert ``rel_rms(actual, expected) <= tol`` (``floor`` keeps all-zero references meaningful)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    e = rel_rms(actual, expected, floor)
    assert e <= tol, f"{what}: relative RMS error {e:.3e} > {tol:.1e}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a test's process group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_as_torchrun(rank: int, world: int, port: int) -> None:
    """Set what ``torchrun`` sets for rank ``rank`` of ``world`` processes (the trainer joins the
    group through ``init_from_env``); one intra-op thread per process."""
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)


def assert_directional_derivatives(m, x, name, loss_of=lambda y: y.square().sum()):
    """Each parameter's ``.grad`` (of ``loss_of(m(x)[0])``, already computed) against a central
    difference of the loss along a random direction (float64, step 1e-5: measured agreement
    2e-6 or better; tolerance 1e-4 of the larger of the derivative and 0.001 × the loss)."""
    with torch.no_grad():
        base = loss_of(m(x)[0]).item()
    gen = torch.Generator().manual_seed(5)
    h = 1e-5
    for pname, p in m.named_parameters():
        d = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        analytic = (p.grad * d).sum().item()
        orig = p.detach().clone()
        with torch.no_grad():
            p.add_(h * d)
            up = loss_of(m(x)[0]).item()
            p.copy_(orig).sub_(h * d)
            down = loss_of(m(x)[0]).item()
            p.copy_(orig)
        fd = (up - down) / (2 * h)
        scale = max(abs(analytic), 1e-3 * abs(base))
        assert abs(fd - analytic) <= 1e-4 * scale, f"{name}: d/d{pname} {analytic} vs finite difference {fd}"


#: what the forkserver imports once, before it forks any rank (``spawn(..., start_method="forkserver")``)
FORKSERVER_PRELOAD = ["torch.distributed", "mnemo.train", "tests.helpers"]


def spawn(fn, args: tuple, nprocs: int, timeout_s: float = 300.0, start_method: str = "spawn") -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, start_method=start_method)``, joined
    with a deadline: a rank that hangs (a lost peer, a teardown race) fails the test after
    ``timeout_s`` seconds, with the hung ranks killed, instead of stalling the whole suite.
    A rank's exception is re-raised as ``start_processes`` does.

    ``start_method="forkserver"``: each rank is forked from one server process of this test process
    that has imported torch and mnemo (:data:`FORKSERVER_PRELOAD`) and run nothing else (no threads
    to inherit), so a rank starts in a fraction of a second instead of re-importing them (~5 CPU
    seconds per rank); the ranks are still fresh processes with their own state, but with the environment
    the server started with: set what a rank needs inside the rank (as :func:`join_as_torchrun` does)."""
    import multiprocessing
    import time

    import pytest
    import torch.multiprocessing as mp

    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, start_method=start_method, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            pytest.fail(f"ranks {alive} of {nprocs} still running after {timeout_s:.0f} s: killed")


def spy_native_calls(monkeypatch) -> list[str]:
    """Record the name of every :func:`mnemo.ops._native.call` from now on (the kernel still
    runs); returns the list the names go to. Undone with ``monkeypatch``."""
    from mnemo.ops import _native

    names: list[str] = []
    real = _native.call

    def spy(name, *args, **kwargs):
        names.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_native, "call", spy)
    return names


def tiny_titans_mac(vocab_size: int, segment: int = 4, seed: int = 0, **options):
    """A one-layer ``titans_mac`` of ``d_model`` 16 with 2 heads and MAC segments of ``segment``
    tokens (seeded; ``options``: more ``build_config`` overrides, e.g. task-signal CMS levels), in
    eval mode: what the tests of a call read in pieces use."""
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(seed)
    mixer = {"titans_mac": {"n_heads": 2, "segment": segment}}
    cfg = build_config(
        "titans_mac", vocab_size=vocab_size, d_model=16, n_layers=1, mixer_options=mixer, **options
    )
    return LanguageModel(cfg).eval()


def prefill_then_tokens(m, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """``m``'s output over ``x [B, T, ...]`` read as a decoder does: the first ``prefill`` tokens in
    one call, then one token a call with the state carried, concatenated over time."""
    y, s = m(x[:, :prefill])
    outs = [y]
    for t in range(prefill, x.shape[1]):
        y, s = m(x[:, t : t + 1], s)
        outs.append(y)
    return torch.cat(outs, 1)


def fast_train_flags(seq_len: int = 32, batch_size: int = 4, sample_tokens: int | None = 0) -> list[str]:
    """``mnemo train`` flags for a run of seconds: 2 steps of a 1-layer, d_model-16 model, one eval
    batch, no progress bar (``sample_tokens=None``: the default end-of-training sample)."""
    flags = ["--seq-len", str(seq_len), "--steps", "2", "--batch-size", str(batch_size)]
    flags += ["--eval-interval", "2", "--eval-batches", "1", "--warmup-steps", "1"]
    flags += ["--d-model", "16", "--n-layers", "1"]
    if sample_tokens is not None:
        flags += ["--sample-tokens", str(sample_tokens)]
    return flags + ["--no-progress"]


def memory_gates(spec, B: int, T: int, H: int, gen: torch.Generator) -> dict:
    """Per-token float64 inputs a ``neural_memory`` call of ``spec`` needs: ``theta`` in [0, 0.5),
    and ``g`` in (−0.2, 0] where it decays, ``eta`` in [0, 0.9) with momentum."""
    kw = {"theta": torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5}
    if spec.decays:
        kw["g"] = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.2
    if spec.optimizer == "momentum":
        kw["eta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.9
    return kw


@contextlib.contextmanager
def locked_sweep_db(path, monkeypatch):
    """Within ``with``: the sweep database ``path`` (created) held under an exclusive lock by another
    connection, and ``mnemo.sweep.db.BUSY_TIMEOUT_S`` at 0.05 s (set before the caller connects)."""
    import sqlite3

    import mnemo.sweep.db as dbmod

    dbmod.SweepDB(path).close()
    monkeypatch.setattr(dbmod, "BUSY_TIMEOUT_S", 0.05)
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("COMMIT")
        holder.close()


def tiny_mqar_trainer(tmp_path, **kw):
    """A :class:`mnemo.train.Trainer` of a one-layer d_model-16 transformer on a 2-pair MQAR
    (seq_len 16, batch 4, 2 steps, evaluated at step 2 on 1 batch), in ``tmp_path / "run"``;
    ``kw`` overrides any :class:`~mnemo.train.TrainConfig` field."""
    from mnemo.train import TrainConfig, Trainer

    cfg = dict(
        model="transformer",
        model_overrides={"d_model": 16, "n_layers": 1},
        task="mqar",
        task_options={"num_pairs": 2, "vocab_size": 16},
        seq_len=16,
        batch_size=4,
        steps=2,
        eval_interval=2,
        eval_batches=1,
        warmup_steps=0,
    )
    cfg.update(kw)
    return Trainer(TrainConfig(**cfg), tmp_path / "run", progress=False)


def tiny_mnemo_for_causal_lm(mixer: str, seed: int = 0, vocab_size: int = 40, **over):
    """A ``MnemoForCausalLM`` (eval mode) around a 2-layer d_model-16 :class:`LanguageModel` of
    ``mixer`` seeded with ``seed``; ``over``: other :class:`~mnemo.models.ModelConfig` fields."""
    from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM
    from mnemo.models import LanguageModel, ModelConfig

    torch.manual_seed(seed)
    lm = LanguageModel(ModelConfig(vocab_size=vocab_size, d_model=16, n_layers=2, mixer=mixer, **over)).eval()
    return MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm).eval()


def assert_meta_build_equals_eager(name: str, inside: bool = False) -> None:
    """Build preset ``name`` (tiny) eagerly and on the ``meta`` device, materialise the latter with
    ``to_empty`` (inside the ``with torch.device("meta")`` block when ``inside``), load the eager
    weights, and assert both give the same logits bit for bit (non-persistent buffers, which
    ``load_state_dict`` never fills, must be recomputed on materialisation)."""
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=13, d_model=16, n_layers=1)
    ref = LanguageModel(cfg)
    with torch.device("meta"):
        lazy = LanguageModel(cfg)
        if inside:
            lazy.to_empty(device="cpu")
    if not inside:
        lazy.to_empty(device="cpu")
    lazy.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 13, (2, 9))
    with torch.no_grad():
        assert torch.equal(lazy(ids)[0], ref(ids)[0])


def sweep_project(tmp_path) -> tuple:
    """``(proj, away)``: a project folder (``pyproject.toml``) with an empty ``sweeps/`` and a folder
    elsewhere, to run a sweep file from another working directory."""
    proj = tmp_path / "proj"
    (proj / "sweeps").mkdir(parents=True)
    (proj / "pyproject.toml").write_text("")
    away = tmp_path / "away"
    away.mkdir()
    return proj, away


def nan_step_on_rank0(tr, rank: int, out) -> None:
    """One good step of the trainer ``tr``, then NaN embeddings on rank 0 and a second step: each
    rank writes ``diverged{rank}.txt`` (the ``TrainingDiverged`` message) into ``out``, or
    ``other{rank}.txt`` for any other error (for the test to show)."""
    from mnemo.train.diverged import TrainingDiverged

    tr.train_step()
    if rank == 0:
        with torch.no_grad():
            tr.model.embed.weight.fill_(float("nan"))
    try:
        tr.train_step()
    except TrainingDiverged as e:
        (out / f"diverged{rank}.txt").write_text(str(e))
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        (out / f"other{rank}.txt").write_text(f"{type(e).__name__}: {e}")
