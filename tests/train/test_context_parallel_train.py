"""``Trainer`` with ``context_parallel=True`` on 2 gloo processes equals the single-process run
(per-step losses, final weights, with and without gradient accumulation) for recurrent models,
a transformer and a hybrid (ring attention); attention sinks and sequence lengths that do not split
are rejected naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mnemo.train import TrainConfig, Trainer
from tests.helpers import free_port, join_as_torchrun, nan_step_on_rank0, spawn

RTOL = 1e-5
MODELS = ["gated_deltanet", "mamba", "transformer", "hybrid"]  # the last two run ring attention
STEPS = 4
#: a hybrid: its recurrent layer relays its state, its attention layer runs the ring
HYBRID = {"layers": ["gla", "attention"], "n_layers": 2}


def _cfg(model="gated_deltanet", **kw) -> TrainConfig:
    overrides = {"d_model": 16, "n_layers": 1}
    if model == "hybrid":
        model, overrides = "transformer", {**overrides, **HYBRID}
    base = dict(
        model=model,
        model_overrides=overrides,
        seq_len=16,
        batch_size=4,
        steps=STEPS,
        eval_interval=2,
        eval_batches=1,
        warmup_steps=2,
        sample_tokens=0,
        context_parallel=True,
    )
    base.update(kw)
    return TrainConfig(**base)


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    from mnemo.train.distributed import cleanup

    out = Path(out)
    try:
        for name in MODELS:
            tr = Trainer(_cfg(name), out / name, progress=False)
            assert tr.context_parallel and tr.ddp is None
            losses = [tr.train_step() for _ in range(STEPS)]
            torch.save({"losses": losses, "weights": _weights(tr.model)}, out / f"{name}-rank{rank}.pt")
        # the whole loop (rank-0 evaluation and checkpoints) with 2 micro-batches of 2 sequences
        Trainer(_cfg(grad_accum=2), out / "fit", progress=False).fit()
        # bad weights on rank 0 only: its forward fails, rank 1 (waiting for its state) fails too
        nan_step_on_rank0(Trainer(_cfg(), out / "nan", progress=False), rank, out)
    finally:
        cleanup()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cp")
    spawn(_worker, (2, free_port(), str(out)), 2, start_method="forkserver")
    return out


@pytest.mark.parametrize("name", MODELS)
def test_two_processes_equal_one(spawned, name, tmp_path):
    tr = Trainer(_cfg(name, context_parallel=False), tmp_path, progress=False)
    want = [tr.train_step() for _ in range(STEPS)]
    parts = [torch.load(spawned / f"{name}-rank{r}.pt") for r in range(2)]
    for part in parts:  # the logged loss is the global mean on every rank
        assert part["losses"] == pytest.approx(want, rel=RTOL)
    ref = _weights(tr.model)
    for n, w in ref.items():
        for part in parts:
            torch.testing.assert_close(part["weights"][n], w, rtol=RTOL, atol=RTOL, msg=f"weights {n}")


def test_two_processes_with_grad_accum_fit_equal_one(spawned, tmp_path):
    Trainer(_cfg(context_parallel=False), tmp_path, progress=False).fit()

    def metrics(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    got, want = metrics(spawned / "fit"), metrics(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 4]
    for g, w in zip(got, want):
        for k in ("train_loss", "val_loss"):
            assert g[k] == pytest.approx(w[k], rel=RTOL), (g["step"], k)
    a = load_file(str(spawned / "fit" / "ckpt-000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "ckpt-000004" / "model.safetensors"))
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=RTOL, atol=RTOL, msg=f"weights {n}")


def test_a_failed_forward_on_one_rank_stops_every_rank(spawned):
    for rank in range(2):
        text = (spawned / f"diverged{rank}.txt").read_text()
        assert "training stopped at step 2: the loss became nan" in text, text


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------


def _fake_world(monkeypatch, world):
    import mnemo.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "init_from_env", lambda backend=None: (0, world))


@pytest.mark.parametrize("world", [1, 2])
def test_attention_sinks_are_rejected(world, tmp_path, monkeypatch):
    _fake_world(monkeypatch, world)  # rejected before any collective
    cfg = _cfg(
        "gated_deltanet_hybrid",
        model_overrides={
            "d_model": 16,
            "n_layers": 4,
            "mixer_options": {"attention": {"window": 4, "n_sink": 1}},
        },
    )
    with pytest.raises(
        ValueError,
        match=r"TrainConfig.context_parallel: model 'gated_deltanet_hybrid': layer 3: attention sinks "
        r"\(n_sink = 1\) are not supported by ring attention",
    ):
        Trainer(cfg, tmp_path, progress=False)


def test_seq_len_not_divisible_by_processes_names_the_field(tmp_path, monkeypatch):
    _fake_world(monkeypatch, 3)
    with pytest.raises(
        ValueError, match=r"TrainConfig.seq_len: context parallelism over 3 processes needs a multiple of 3"
    ):
        Trainer(_cfg(), tmp_path, progress=False)


def test_bad_flag_value_names_the_field():
    with pytest.raises(ValueError, match="TrainConfig.context_parallel: expected true or false"):
        _cfg(context_parallel="yes").validate()


def test_one_process_is_a_no_op_and_the_cli_flag_without_torchrun_is_refused(tmp_path, capsys):
    """The library's Trainer runs a context-parallel config in one process as a plain run; the
    command refuses the flag without torchrun (it would train without it while train_config.json
    recorded it as on) and writes nothing."""
    from mnemo.cli import main

    a = Trainer(_cfg(), tmp_path / "a", progress=False)
    b = Trainer(_cfg(context_parallel=False), tmp_path / "b", progress=False)
    assert not a.context_parallel
    for _ in range(2):
        assert a.train_step() == b.train_step()
    argv = ["train", "--model", "gated_deltanet", "--d-model", "16", "--n-layers", "1", "--seq-len", "16"]
    argv += ["--batch-size", "4", "--steps", "1", "--eval-interval", "1", "--eval-batches", "1"]
    for flag in ("--context-parallel", "--fsdp"):
        out = tmp_path / flag.strip("-")
        assert main([*argv, "--sample-tokens", "0", "--no-progress", flag, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{flag}: needs several processes (launch with torchrun" in err
        assert not out.exists()
