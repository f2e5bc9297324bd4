"""Trainer: the loss goes down on tinyshakespeare, resume is exact, failures are loud and safe."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from mnemo.train import (
    CorruptCheckpointError,
    TrainConfig,
    Trainer,
    TrainingDiverged,
    resolve_checkpoint,
    resume_config,
)
from mnemo.train import checkpoint as ckpt_mod

TINY = {"d_model": 32, "n_layers": 1}


def _cfg(**kw):
    base = dict(
        model="gla",
        model_overrides=TINY,
        seq_len=32,
        batch_size=8,
        steps=12,
        eval_interval=6,
        eval_batches=2,
        lr=3e-3,
        warmup_steps=2,
        sample_tokens=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_training_lowers_the_loss_on_tinyshakespeare(tmp_path):
    tr = Trainer(
        _cfg(
            model="transformer",
            steps=80,
            eval_interval=40,
            lr=1e-2,
            model_overrides={"d_model": 64, "n_layers": 2},
        ),
        tmp_path,
        progress=False,
    )
    before = tr.evaluate(4)["val_loss"]
    rec = tr.fit()
    assert rec["step"] == 80
    assert rec["val_loss"] < before - 1.0, (before, rec)  # ln(66) = 4.19 -> below ~3.2 nats/char
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [40, 80]
    assert {"step", "train_loss", "val_loss", "val_bpc", "tokens_per_s"} <= set(lines[0])
    assert abs(lines[-1]["val_bpc"] - lines[-1]["val_loss"] / math.log(2)) < 1e-9


def _losses(trainer, n):
    return [trainer.train_step() for _ in range(n)]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = Trainer(_cfg(), tmp_path / "a", progress=False)
    ref = _losses(full, 12)

    first = Trainer(_cfg(), tmp_path / "b", progress=False)
    first.fit(until=5)  # interrupted after step 5 (between checkpoint intervals)
    assert resolve_checkpoint(tmp_path / "b").name == "ckpt-000005"
    again = Trainer(_cfg(), tmp_path / "b", resume=True, progress=False)
    assert again.step == 5
    again.fit(until=9)  # through the step-6 eval and checkpoint
    last = Trainer(_cfg(), tmp_path / "b", resume=True, progress=False)
    assert last.step == 9
    assert _losses(last, 3) == ref[9:]  # bit-for-bit


def test_resume_keeps_metrics_consistent(tmp_path):
    Trainer(_cfg(steps=12, checkpoint_interval=6, eval_interval=3), tmp_path, progress=False).fit()
    # pretend the run died after the step-12 eval but resume from step 6
    (tmp_path / "latest").write_text("ckpt-000006\n")
    Trainer(
        _cfg(steps=12, checkpoint_interval=6, eval_interval=3), tmp_path, resume=True, progress=False
    ).fit()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 6, 9, 12]


def test_nan_loss_stops_with_the_step_number(tmp_path):
    tr = Trainer(_cfg(steps=10, eval_interval=2), tmp_path, progress=False)
    for _ in range(3):
        tr.train_step()
    with torch.no_grad():
        next(tr.model.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="training stopped at step 4: the loss became nan") as e:
        tr.train_step()
    assert e.value.step == 4


def test_nan_during_fit_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    tr = Trainer(_cfg(steps=10, eval_interval=2), tmp_path, progress=False)
    orig = tr.train_step

    def poisoned():
        if tr.step == 5:
            with torch.no_grad():
                tr.model.embed.weight.fill_(float("inf"))
        return orig()

    monkeypatch.setattr(tr, "train_step", poisoned)
    with pytest.raises(TrainingDiverged, match="step 6.*ckpt-000004"):
        tr.fit()
    assert resolve_checkpoint(tmp_path).name == "ckpt-000004"


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, monkeypatch):
    tr = Trainer(_cfg(steps=4, eval_interval=2), tmp_path, progress=False)
    tr.fit()
    good = resolve_checkpoint(tmp_path)
    weights = (good / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_torch", boom)
    import mnemo.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "save_torch", boom)
    tr2 = Trainer(_cfg(steps=6, eval_interval=2), tmp_path, resume=True, reschedule="hold", progress=False)
    with pytest.raises(OSError, match="disk full"):
        tr2.fit()
    assert resolve_checkpoint(tmp_path) == good
    assert (good / "model.safetensors").read_bytes() == weights
    assert not list(tmp_path.glob(".tmp-*")), "the partial checkpoint was not cleaned up"
    Trainer(_cfg(steps=6, eval_interval=2), tmp_path, resume=True, reschedule="hold", progress=False)


def test_corrupt_trainer_state_is_reported(tmp_path):
    Trainer(_cfg(steps=2, eval_interval=2), tmp_path, progress=False).fit()
    state = resolve_checkpoint(tmp_path) / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: len(state.read_bytes()) // 2])
    # the manifest catches it first, naming the file (no older checkpoint to fall back to)
    with pytest.raises(CorruptCheckpointError, match=r"trainer_state.pt has [\d,]+ bytes, its manifest says"):
        Trainer(_cfg(steps=2), tmp_path, resume=True, progress=False)
    # a checkpoint without a manifest (older mnemo): the loader still names the file
    (state.parent / "manifest.json").unlink()
    with pytest.raises(ValueError, match="corrupt trainer state"):
        Trainer(_cfg(steps=2), tmp_path, resume=True, progress=False)


@pytest.mark.parametrize(
    "content, error, match",
    [
        (None, FileNotFoundError, "data file not found"),
        (b"", ValueError, "is empty"),
        (b"\xff\xfe\xfa", ValueError, "not valid UTF-8"),
        (b"too short", ValueError, "the text is too short"),
    ],
)
def test_bad_data_files(tmp_path, content, error, match):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=match):
        Trainer(_cfg(data=str(path)), tmp_path / "run", progress=False)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", 0, "TrainConfig.steps: expected a positive int"),
        ("lr", -1.0, "TrainConfig.lr: expected a positive number"),
        ("tokenizer", "bpe", "TrainConfig.tokenizer"),
        ("precision", "fp8", "TrainConfig.precision"),
        ("min_lr_ratio", 2.0, "TrainConfig.min_lr_ratio"),
        # wrong types (a config file can hold anything) are ValueErrors naming the field too
        ("lr", "x", "TrainConfig.lr: expected a finite number, got 'x'"),
        ("beta1", None, "TrainConfig.beta1: expected a finite number, got None"),
        ("weight_decay", [0.1], "TrainConfig.weight_decay: expected a finite number"),
        ("device", 0, "TrainConfig.device: expected a string, got 0"),
        ("seed", "1", "TrainConfig.seed: expected an int"),
        ("task", 3, "TrainConfig.task: expected None or a string"),
    ],
)
def test_invalid_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**{field: value}).validate()


def test_unknown_config_field():
    with pytest.raises(ValueError, match=r"unknown TrainConfig field\(s\) \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})


def test_byte_tokenizer_bpc_counts_characters(tmp_path):
    text = "héllo wörld, ünïcode text. " * 400
    p = tmp_path / "u.txt"
    p.write_text(text, encoding="utf-8")
    tr = Trainer(_cfg(data=str(p), tokenizer="byte", steps=2), tmp_path / "run", progress=False)
    ev = tr.evaluate(2)
    ratio = tr.val_data.ids.numel() / tr.val_chars
    assert ratio > 1.0
    assert abs(ev["val_bpc"] - ev["val_loss"] * ratio / math.log(2)) < 1e-9


def test_lr_schedule_warmup_then_cosine():
    from mnemo.train.trainer import lr_factor

    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.55)


def test_callbacks_add_to_the_metrics_record(tmp_path):
    seen = []

    def probe(trainer, record):
        seen.append(record["step"])
        return {"probe_score": float(trainer.step)}

    Trainer(_cfg(steps=4, eval_interval=2), tmp_path, progress=False, callbacks=[probe]).fit()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert seen == [2, 4] and [r["probe_score"] for r in lines] == [2.0, 4.0]


def test_init_from_starts_from_another_runs_weights(tmp_path):
    first = Trainer(_cfg(steps=4, eval_interval=2), tmp_path / "a", progress=False)
    first.fit()
    second = Trainer(
        _cfg(steps=2, eval_interval=2, init_from=str(tmp_path / "a"), seq_len=16), tmp_path / "b"
    )
    for (name, p), q in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(p, q), name
    assert second.step == 0, "optimizer, schedule and step start fresh"
    fresh = Trainer(_cfg(steps=2, eval_interval=2, seq_len=16), tmp_path / "c")
    assert not torch.equal(fresh.model.embed.weight, second.model.embed.weight)
    with pytest.raises(ValueError, match="TrainConfig.init_from: the weights in .* do not fit model 'gla'"):
        Trainer(_cfg(init_from=str(tmp_path / "a"), model_overrides={**TINY, "d_model": 48}), tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        Trainer(_cfg(init_from=str(tmp_path / "missing")), tmp_path / "e")


class _Scaled(torch.nn.Module):
    """A toy sub-module that asks for a smaller outer learning rate (as CMS levels do)."""

    outer_lr_scale = 0.1

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, 3))
        self.b = torch.nn.Parameter(torch.zeros(3))


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.slow = _Scaled()

    def forward(self, x):
        return self.lin(x) @ self.slow.w + self.slow.b


@pytest.mark.parametrize("optimizer", ["adamw", "m3"])
def test_outer_lr_scale_gets_its_own_param_groups(optimizer):
    from mnemo.train.trainer import lr_factor, make_optimizer

    model = _Toy()
    cfg = _cfg(optimizer=optimizer, lr=2e-3, warmup_steps=3, steps=10)
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 3, 10, cfg.min_lr_ratio))
    ids = [[id(p) for p in g["params"]] for g in opt.param_groups]
    assert ids[:2] == [[id(model.lin.weight)], [id(model.lin.bias)]]
    assert ids[2:] == [[id(model.slow.w)], [id(model.slow.b)]]
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.weight_decay, 0.0, cfg.weight_decay, 0.0]
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    sched.step()
    base = opt.param_groups[0]["lr"]
    assert base == pytest.approx(2e-3 * 2 / 3)
    for g in opt.param_groups[2:]:
        assert g["lr"] == pytest.approx(0.1 * base)


def test_outer_lr_scale_absent_or_one_keeps_two_groups_and_bad_scale_is_named():
    from mnemo.train.trainer import make_optimizer

    model = _Toy()
    model.slow.outer_lr_scale = 1.0
    assert len(make_optimizer(model, _cfg()).param_groups) == 2
    model.slow.outer_lr_scale = -0.5
    with pytest.raises(ValueError, match=r"_Scaled 'slow': outer_lr_scale: expected a finite number > 0"):
        make_optimizer(model, _cfg())


def test_m3_config_builds_algorithm_1_and_validates_its_fields(tmp_path):
    from mnemo.train.m3 import M3
    from mnemo.train.trainer import make_optimizer

    cfg = _cfg(optimizer="m3", m3_slow_every=4, m3_beta3=0.5, m3_alpha=0.25, m3_ns_steps=3, m3_eps=1e-4)
    opt = make_optimizer(_Toy(), cfg.validate())
    assert isinstance(opt, M3)
    g = opt.param_groups[0]
    assert (g["slow_every"], g["betas"], g["alpha"], g["ns_steps"], g["eps"], g["ema"]) == (
        4,
        (cfg.beta1, cfg.beta2, 0.5),
        0.25,
        3,
        1e-4,
        False,
    )
    for field, value in [
        ("m3_slow_every", 0),
        ("m3_beta3", 1.0),
        ("m3_alpha", -1.0),
        ("m3_ns_steps", -1),
        ("m3_eps", 0.0),
        ("m3_ema", "yes"),
    ]:
        with pytest.raises(ValueError, match=f"TrainConfig.{field}: expected"):
            _cfg(optimizer="m3", **{field: value}).validate()
    rec = Trainer(
        _cfg(optimizer="m3", lr=1e-3, m3_eps=1e-3, m3_slow_every=3, steps=6, eval_interval=6),
        tmp_path,
        progress=False,
    ).fit()
    assert rec["step"] == 6 and math.isfinite(rec["val_loss"])


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    """A truncated model.safetensors in the newest checkpoint: resume names the file, continues
    from the previous intact checkpoint, and still reproduces the uninterrupted run."""
    ref = _losses(Trainer(_cfg(), tmp_path / "a", progress=False), 12)
    Trainer(_cfg(), tmp_path / "b", progress=False).fit(until=9)  # checkpoints at 6 and 9
    w = tmp_path / "b" / "ckpt-000009" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-64])
    said = []
    again = Trainer(None, tmp_path / "b", resume=True, progress=False, log=said.append)
    assert again.step == 6 and again.last_checkpoint.name == "ckpt-000006"
    shorter = "(shorter: truncated or edited)"
    assert any(f"{w} has" in m and shorter in m and "ckpt-000006 instead" in m for m in said), said
    # the damaged later checkpoint is set aside (kept/superseded-1/), not replaced by the new step 9
    aside = tmp_path / "b" / "kept" / "superseded-1" / "ckpt-000009" / "model.safetensors"
    assert aside.is_file() and not w.exists()
    assert (tmp_path / "b" / "latest").read_text() == "ckpt-000006\n"  # not the checkpoint set aside
    assert _losses(again, 6) == ref[6:]
    # every checkpoint damaged: an error naming each bad file
    shutil.move(aside.parent, w.parent)  # (the damaged one back in the run, and latest naming it)
    (tmp_path / "b" / "latest").write_text("ckpt-000009\n")
    c = tmp_path / "b" / "ckpt-000006" / "config.json"
    c.write_text(c.read_text().replace(":", ";", 1))  # same size, other bytes
    with pytest.raises(CorruptCheckpointError) as e:
        resolve_checkpoint(tmp_path / "b")
    assert f"{w} has" in str(e.value) and f"{c} has a different SHA-256 than its manifest" in str(e.value)


def test_resume_config_keeps_saved_settings_and_reports_each_change():
    saved = _cfg(steps=10, eval_interval=5, checkpoint_interval=10, warmup_steps=2)
    same, notes = resume_config(saved, None)
    assert same == saved and notes == []
    cfg, notes = resume_config(saved, {"eval_batches": 3, "model_overrides": {"d_model": 32}})
    assert cfg.eval_batches == 3 and cfg.eval_interval == 5 and cfg.model_overrides == saved.model_overrides
    assert notes == [f"eval_batches {saved.eval_batches!r} -> 3"]
    with pytest.raises(ValueError, match=r"TrainConfig.seed: a resumed run keeps seed = 0 \(got 1\)"):
        resume_config(saved, {"seed": 1})
    with pytest.raises(ValueError, match="TrainConfig.lr: a resumed run keeps lr"):
        resume_config(saved, TrainConfig(**{**saved.to_dict(), "lr": 1.0}))
    with pytest.raises(ValueError, match="reschedule: expected one of"):
        resume_config(saved, {"steps": 20}, "longer")
    with pytest.raises(ValueError, match="TrainConfig.steps: 10 -> 20 moves the end of the cosine"):
        resume_config(saved, {"steps": 20})
    held, notes = resume_config(saved, {"steps": 20}, "hold", step=10)
    assert held.schedule_steps == 10 and held.cosine_steps == 10 and held.steps == 20
    lr_min = saved.lr * saved.min_lr_ratio
    assert notes[-1] == f"lr at step 10: {lr_min:.3g} on the saved schedule, {lr_min:.3g} now"
    stretched, notes = resume_config(saved, {"steps": 20}, "stretch", step=10)
    assert stretched.schedule_steps is None and stretched.cosine_steps == 20
    # on the stretched cosine step 10 sits 8/18 of the way through the decay
    mid = saved.min_lr_ratio + (1 - saved.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * 8 / 18))
    assert notes[-1] == f"lr at step 10: {lr_min:.3g} on the saved schedule, {saved.lr * mid:.3g} now"
    # a held run can later get more steps without moving its cosine again
    more, _ = resume_config(held, {"steps": 30})
    assert more.cosine_steps == 10


def test_track_circuits_needs_a_tracker_callback(tmp_path):
    """mnemo.train does not import mnemo.interp: a run with track_circuits gets its tracker from the
    caller, as a callback or through a factory called with the run's (resolved) config."""
    from mnemo.interp import CircuitTracker, circuit_callbacks

    cfg = _cfg(model="transformer", steps=2, eval_interval=2, track_circuits=True, circuit_length=4)
    with pytest.raises(
        ValueError, match=r"callbacks=\[mnemo.interp.CircuitTracker\(length=cfg.circuit_length\)\]"
    ):
        Trainer(cfg, tmp_path / "none", progress=False)
    Trainer(cfg, tmp_path / "list", progress=False, callbacks=[CircuitTracker(length=4, batch=2)]).fit()
    seen = []

    def factory(c):
        seen.append((c.track_circuits, c.steps))
        return circuit_callbacks(c)

    Trainer(cfg, tmp_path / "factory", progress=False, callbacks=factory).fit()
    # a resume is given no config: the factory sees the saved one (with its changes)
    Trainer(
        {"steps": 4},
        tmp_path / "factory",
        resume=True,
        reschedule="stretch",
        progress=False,
        callbacks=factory,
    ).fit()
    assert seen == [(True, 2), (True, 4)]
    for run in ("list", "factory"):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert all(0 <= r["induction_max"] <= 1 for r in rows) and len(rows[0]["induction_by_layer"]) == 1


def test_train_does_not_import_interp():
    """DESIGN.md §2: ``interp`` depends on models, never the reverse, and ``train`` not on ``interp``."""
    import subprocess
    import sys

    code = (
        "import sys, mnemo.train, mnemo.train.trainer; "
        "print(sorted(m for m in sys.modules if m.startswith('mnemo.interp')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
