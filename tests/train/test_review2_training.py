"""Second hostile review of the training loop and its run folder: a damaged manifest is a damaged
checkpoint (not a traceback), an interrupt never checkpoints overflowed weights, a new run never
appends to the log of a run that wrote no checkpoint, ``reschedule`` is refused for a new run
whatever form its configuration takes, and the warm-up warning says what happens. Beside them,
known answers: the accumulated, clipped gradient equals one large batch's by hand, the logged
learning rate follows the warm-up + cosine formula, the validation loss and bits per character
equal a hand computation, and a run resumed across an epoch of carried streams is exact."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from mnemo.train import CorruptCheckpointError, TrainConfig, Trainer, TrainingDiverged, resolve_checkpoint
from mnemo.train.checkpoint import save_checkpoint, verify_checkpoint
from mnemo.train.optim import make_scheduler

TINY = dict(
    model="gla",
    model_overrides={"d_model": 16, "n_layers": 1},
    seq_len=16,
    batch_size=4,
    eval_batches=1,
    sample_tokens=0,
    warmup_steps=1,
    steps=4,
    eval_interval=2,
    seed=5,
)


def _trainer(out, **kw):
    return Trainer(TrainConfig.from_dict({**TINY, **kw}), out, progress=False, log=lambda *a: None)


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# defects


def _two_checkpoints(tmp_path):
    def write(d):
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"w" * 10)
        (d / "trainer_state.pt").write_bytes(b"s")

    save_checkpoint(tmp_path, 1, write)
    save_checkpoint(tmp_path, 2, write)
    return tmp_path / "ckpt-000002" / "manifest.json"


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00\x93 bits flipped on disk",  # not UTF-8
        b'{"files": ["model.safetensors"]}',  # a list, not a mapping
        b'{"files": {"model.safetensors": 10}}',  # an entry that is not {bytes, sha256}
        b'{"files": {"model.safetensors": {"bytes": 10}}}',  # no sha256
    ],
)
def test_a_damaged_manifest_is_a_damaged_checkpoint_and_resume_falls_back(tmp_path, content):
    """verify_checkpoint read manifest.json as UTF-8 JSON of the right shape and raised
    UnicodeDecodeError / AttributeError / TypeError / KeyError otherwise: a manifest damaged on
    disk stopped the resume with a traceback instead of falling back to the previous checkpoint."""
    manifest = _two_checkpoints(tmp_path)
    manifest.write_bytes(content)
    problems = verify_checkpoint(manifest.parent)
    assert len(problems) == 1 and "manifest.json is unreadable" in problems[0]
    said = []
    assert resolve_checkpoint(tmp_path, warn=said.append).name == "ckpt-000001"
    assert "damaged checkpoint skipped" in said[0] and "manifest.json" in said[0]
    with pytest.raises(CorruptCheckpointError, match="manifest.json is unreadable"):
        resolve_checkpoint(manifest.parent)


def test_an_interrupt_never_checkpoints_weights_that_overflowed(tmp_path):
    """The interrupt's checkpoint (of a step between two scheduled ones) was written without the
    NaN/inf check every scheduled checkpoint gets: NaN weights were saved as the checkpoint that
    "holds every finished step", and a resume trained on from them."""
    tr = _trainer(tmp_path / "run", steps=10, eval_interval=4)
    step = tr.train_step

    def poisoned():
        loss = step()
        if tr.step == 2:  # the optimizer step overflowed; then Ctrl-C
            with torch.no_grad():
                next(tr.model.parameters()).fill_(float("nan"))
            tr.interrupts.requested = "SIGINT"
        return loss

    tr.train_step = poisoned
    with pytest.raises(BaseException) as e:  # (it was the KeyboardInterrupt of the interrupt)
        tr.fit()
    assert isinstance(e.value, TrainingDiverged), repr(e.value)
    assert "training stopped at step 2: the weights became nan" in str(e.value)
    assert e.value.step == 2
    assert "no checkpoint was written yet" in str(e.value)
    assert not list((tmp_path / "run").glob("ckpt-*"))


def test_a_new_run_never_appends_to_the_log_of_a_run_without_a_checkpoint(tmp_path):
    """A run that failed before its first checkpoint leaves metrics.jsonl (records 2, 4); a new run
    there (``Trainer(cfg, out).fit()``, or the sweep's retry) appended its own records to it: the
    log read 2, 4, 2, 4, 6, 8, 10. Now the old log is set aside in kept/, with a warning."""
    out = tmp_path / "run"
    first = _trainer(out, steps=10, eval_interval=2, checkpoint_interval=10)
    step = first.train_step

    def crash():
        if first.step == 5:
            raise RuntimeError("the machine went away")
        return step()

    first.train_step = crash
    with pytest.raises(RuntimeError, match="went away"):
        first.fit()
    old = (out / "metrics.jsonl").read_text()
    assert _steps(out / "metrics.jsonl") == [2, 4]
    with pytest.warns(UserWarning, match="metrics.jsonl of a run that wrote no checkpoint"):
        _trainer(out, steps=10, eval_interval=2, checkpoint_interval=10).fit()
    assert _steps(out / "metrics.jsonl") == [2, 4, 6, 8, 10]
    kept = list((out / "kept").rglob("metrics.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == old


@pytest.mark.parametrize("cfg", [None, {"steps": 4}])
def test_reschedule_is_refused_for_a_new_run_whatever_form_its_config_takes(tmp_path, cfg):
    """``reschedule`` applies to a resumed run; with a TrainConfig a new run refused it, with ``None``
    or a dict of settings it was silently ignored."""
    with pytest.raises(ValueError, match="reschedule: applies to a resumed run"):
        Trainer(cfg, tmp_path / "run", reschedule="stretch", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_warmup_warning_says_what_happens_when_it_is_as_long_as_the_schedule():
    """warmup_steps == the schedule: the rate reaches lr at the last step (factor (4-1+1)/4 = 1) but
    the warning said it never reaches lr, "at most" lr."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = TrainConfig.from_dict({**TINY, "warmup_steps": 4, "steps": 4, "lr": 1.0})
    with pytest.warns(UserWarning, match="reaches lr=1 only at its last step and never decays"):
        sched = make_scheduler(opt, cfg)
    rates = []
    for _ in range(4):
        rates.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert rates == [0.25, 0.5, 0.75, 1.0]
    cfg = TrainConfig.from_dict({**TINY, "warmup_steps": 8, "steps": 4, "lr": 1.0})
    with pytest.warns(UserWarning, match=r"never reaches lr=1 \(at most 0\.5\)"):
        make_scheduler(torch.optim.SGD(model.parameters(), lr=1.0), cfg)


# ---------------------------------------------------------------------------------------------
# known answers that held


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_accumulated_clipped_gradient_is_one_large_batch_by_hand(tmp_path, accum):
    """The gradient the optimizer steps on: ∇ mean CE over the whole batch (one forward by hand),
    scaled by min(1, clip / (‖g‖ + 1e-6)); the returned loss is that mean."""
    tr = _trainer(tmp_path / str(accum), grad_accum=accum, grad_clip=0.05)
    state = tr.generator.get_state()
    x, y, _ = tr.data.next_batch(0, tr.generator)
    tr.generator.set_state(state)
    m = tr.model
    logits, _ = m(x)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), y.flatten())
    grads = torch.autograd.grad(ce, list(m.parameters()))
    norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
    assert norm > 0.05  # the clip is active
    want = [g.double() * (0.05 / (norm + 1e-6)) for g in grads]
    seen = {}
    real_step = tr.optimizer.step

    def spy(*a, **k):
        seen["grads"] = [p.grad.double().clone() for p in m.parameters()]
        return real_step(*a, **k)

    tr.optimizer.step = spy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: optimizer.step replaced after the scheduler)
        loss = tr.train_step()
    assert loss == pytest.approx(ce.item(), rel=2e-6)
    for got, ref in zip(seen["grads"], want):
        assert (got - ref).abs().max() <= 2e-6 * ref.abs().max() + 1e-12


def test_logged_learning_rate_follows_warmup_then_cosine_and_validation_loss_is_by_hand(tmp_path):
    """lr at record step s is the rate of update s − 1: lr·(s/W) in the warm-up, then
    lr·(r + (1 − r)·½(1 + cos π (s − 1 − W)/(S − W))); val_loss is the mean CE over the first
    eval_batches·B validation windows (non-overlapping, in order) and val_bpc = val_loss·(tokens/
    chars)/ln 2 (1 token per character here)."""
    W, S, lr, r = 3, 9, 3e-3, 0.1
    tr = _trainer(
        tmp_path / "run", steps=S, warmup_steps=W, lr=lr, min_lr_ratio=r, eval_interval=1, eval_batches=2
    )
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        k = row["step"] - 1
        f = (k + 1) / W if k < W else r + (1 - r) * 0.5 * (1 + math.cos(math.pi * (k - W) / (S - W)))
        assert row["lr"] == pytest.approx(lr * f, rel=1e-12)
    ids, T = tr.val_data.ids, 16
    total, n = 0.0, 0
    tr.model.eval()
    with torch.no_grad():
        for w in range(2 * 4):
            x, y = ids[w * T : (w + 1) * T][None], ids[w * T + 1 : (w + 1) * T + 1][None]
            logits, _ = tr.model(x)
            total += torch.nn.functional.cross_entropy(logits[0].double(), y[0], reduction="sum").item()
            n += T
    assert tr.val_data.ids.numel() == tr.val_chars  # char-level: bpc = nats / ln 2
    assert rows[-1]["val_tokens"] == n
    assert rows[-1]["val_loss"] == pytest.approx(total / n, rel=1e-5)
    assert rows[-1]["val_bpc"] == pytest.approx(total / n / math.log(2), rel=1e-5)


def test_carried_streams_resume_exactly_across_an_epoch_restart(tmp_path):
    """carry_state on a text of 3 windows per stream: interrupted at step 3 (the epoch restart,
    state dropped) and at step 4 (a carried state saved), the resumed run's records and weights
    equal the uninterrupted run's bit for bit."""
    text = tmp_path / "t.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text("".join("abcdefgh "[int(i)] for i in torch.randint(0, 9, (250,), generator=g)))
    kw = dict(carry_state=True, data=str(text), steps=8, eval_interval=5, grad_accum=2)
    full = _trainer(tmp_path / "a", **kw)
    full.fit()
    assert full.data.streams.windows == 3
    part = _trainer(tmp_path / "b", **kw)
    part.fit(until=3)
    for until in (4, None):
        part = Trainer(None, tmp_path / "b", resume=True, progress=False, log=lambda *a: None)
        part.fit(until=until)

    def records(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rows]

    assert records("b") == records("a")
    for p, q in zip(full.model.parameters(), part.model.parameters()):
        assert torch.equal(p, q)


def test_a_checkpoint_folder_is_not_a_run_folder(tmp_path):
    """``Trainer(..., out=RUN/ckpt-000004, resume=True)`` resumed from that checkpoint and then wrote
    its own checkpoints, ``latest`` and ``metrics.jsonl`` inside it (RUN/ckpt-000004/ckpt-000006);
    a new run into a checkpoint folder hid its own checkpoints behind the folder's weights. Both are
    refused, naming the run folder, and nothing is written."""
    run = tmp_path / "run"
    _trainer(run).fit()
    ckpt = run / "ckpt-000004"
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(ValueError, match=rf"{ckpt} is a checkpoint, not a run folder.*resume {run}"):
        Trainer({"steps": 6}, ckpt, resume=True, reschedule="hold", progress=False, log=lambda *a: None)
    with pytest.raises(ValueError, match=rf"{ckpt} holds a checkpoint"):
        _trainer(ckpt).fit()
    assert sorted(p.name for p in ckpt.iterdir()) == before
