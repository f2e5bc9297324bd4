"""Hostile review of the run machinery: a new run never clobbers another run's folder, a stretched
schedule takes effect at the resumed step, a write that the file system refuses is named, a damaged
unverified checkpoint is an error (not a traceback), an interrupt during the last step still stops
the command, and a folder with a log but no checkpoint gets advice that works."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal

import pytest

from mnemo.cli import main
from mnemo.train import CorruptCheckpointError, TrainConfig, Trainer
from mnemo.train import checkpoint as ckpt_mod
from mnemo.train.optim import lr_factor

TINY = dict(
    model_overrides={"d_model": 16, "n_layers": 1},
    seq_len=16,
    batch_size=4,
    eval_batches=1,
    sample_tokens=0,
    warmup_steps=1,
    steps=4,
    eval_interval=2,
)
FLAGS = "--d-model 16 --n-layers 1 --seq-len 16 --batch-size 4 --eval-batches 1 --sample-tokens 0"
FLAGS = [*FLAGS.split(), "--eval-interval", "2", "--warmup-steps", "1", "--no-progress"]


def _trainer(out, resume=False, reschedule=None, **kw):
    """A tiny run's Trainer: ``kw`` changes TINY (a new run) or the saved settings (``resume``)."""
    cfg = kw if resume else TrainConfig.from_dict({**TINY, **kw})
    return Trainer(cfg, out, resume=resume, reschedule=reschedule, progress=False, log=lambda *a: None)


def test_a_new_run_from_python_never_replaces_another_runs_checkpoints(tmp_path):
    """``Trainer(cfg, out).fit()`` into a folder that holds a run: it replaced that run's ckpt-000002
    with its own, pointed ``latest`` at it and appended to its metrics.jsonl. Now refused, untouched."""
    _trainer(tmp_path).fit()
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"already holds a run \(ckpt-000002, ckpt-000004, latest\)"):
        _trainer(tmp_path, seed=5, steps=2).fit()
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    t = _trainer(tmp_path, resume=True, reschedule="hold", steps=6)  # resuming it is still fine
    t.fit()
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000006"


def test_stretch_trains_the_first_resumed_step_on_the_new_cosine(tmp_path):
    """``--reschedule stretch``: the optimizer's saved learning rate was the old cosine's, so the
    first resumed step still trained (and logged ``lr``) at the old rate."""
    t = _trainer(tmp_path, eval_interval=1)
    t.fit(until=2)
    old = t.optimizer.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="--reschedule stretch"):
        t = Trainer({"steps": 40}, tmp_path, resume=True, progress=False, log=lambda *a: None)
    t = Trainer(
        {"steps": 40}, tmp_path, resume=True, reschedule="stretch", progress=False, log=lambda *a: None
    )
    new = TINY["warmup_steps"], 40, t.cfg.min_lr_ratio
    want = t.cfg.lr * lr_factor(2, *new)
    assert want != pytest.approx(old)
    assert [g["lr"] for g in t.optimizer.param_groups] == [want] * len(t.optimizer.param_groups)
    t.fit(until=3)
    rec = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec[-1]["step"] == 3 and rec[-1]["lr"] == want


def test_hold_and_an_unchanged_schedule_keep_the_saved_rate_bit_for_bit(tmp_path):
    t = _trainer(tmp_path)
    t.fit(until=3)
    saved = [g["lr"] for g in t.optimizer.param_groups]
    t = _trainer(tmp_path, resume=True, reschedule="hold", steps=8)
    assert [g["lr"] for g in t.optimizer.param_groups] == saved
    t = _trainer(tmp_path, resume=True)
    assert [g["lr"] for g in t.optimizer.param_groups] == saved


def _run_limited(args, limit, capsys) -> tuple[int, str]:
    """``mnemo train ARGS`` (in this process) while its files may not grow past ``limit`` bytes (a
    full disk, as far as the writer can tell: EFBIG): its exit status and stderr. The limit is the
    process's own (RLIMIT_FSIZE), set around the command and given back after it; Python ignores
    SIGXFSZ, so a write past it fails with EFBIG instead of killing the process."""
    assert signal.getsignal(signal.SIGXFSZ) is signal.SIG_IGN
    capsys.readouterr()
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        code = main(args)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    return code, capsys.readouterr().err


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_full_disk_while_writing_is_named_with_the_step_and_what_survives(tmp_path, capsys, monkeypatch):
    """The run's files may not grow past 30 kB: the metrics line fits, the weights do not. It said
    only ``error: File too large``: not which file, which step, nor what is left."""
    monkeypatch.chdir(tmp_path)
    code, err = _run_limited(["train", "--out", "run", "--steps", "4", *FLAGS], 30_000, capsys)
    assert code == 2, err
    assert "File too large while writing the checkpoint of step 2 (run/ckpt-000002)" in err
    assert "no checkpoint was written before it" in err
    assert sorted(x.name for x in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]  # no temporaries
    # a resumed run that cannot write: the previous checkpoint is named as intact
    assert main(["train", "--out", str(tmp_path / "r"), "--steps", "2", *FLAGS]) == 0
    code, err = _run_limited(
        ["train", "--out", "r", "--resume", "--steps", "4", "--reschedule", "hold"], 30_000, capsys
    )
    assert code == 2, err
    assert "while writing the checkpoint of step 4 (r/ckpt-000004); the last checkpoint, r/ckpt-000002," in (
        err
    )
    code, err = _run_limited(["train", "--out", "m", "--steps", "4", *FLAGS], 100, capsys)
    assert "File too large while writing the metrics of step 2 (m/metrics.jsonl)" in err


def test_an_oserror_without_errno_keeps_its_text(tmp_path, monkeypatch):
    import mnemo.train.trainer as trainer_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_torch", boom)
    monkeypatch.setattr(trainer_mod, "save_torch", boom)
    with pytest.raises(OSError, match=r"^disk full while writing the checkpoint of step 2 .*no checkpoint"):
        _trainer(tmp_path).fit()


def test_atomic_write_leaves_no_temporary_when_the_write_fails(tmp_path, monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod.os, "fsync", fsync)
    with pytest.raises(OSError, match="No space left"):
        ckpt_mod.atomic_write_text(tmp_path / "metrics.jsonl", "x\n")
    assert list(tmp_path.iterdir()) == []


def test_an_unverified_damaged_or_foreign_checkpoint_is_an_error_not_a_traceback(tmp_path):
    """A checkpoint without manifest.json loads unverified (said); its truncated weights raised
    safetensors' own error, another model's weights torch's RuntimeError: both now a
    CorruptCheckpointError naming the checkpoint (``mnemo train``: one line, status 2)."""
    _trainer(tmp_path / "a", steps=2).fit()
    _trainer(tmp_path / "b", steps=2, model_overrides={"d_model": 32, "n_layers": 1}).fit()
    ckpt = tmp_path / "a" / "ckpt-000002"
    (ckpt / "manifest.json").unlink()
    weights = ckpt / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:1000])
    with pytest.raises(CorruptCheckpointError, match=r"ckpt-000002 is damaged: .*no manifest.json.*header"):
        _trainer(tmp_path / "a", resume=True)
    weights.write_bytes((tmp_path / "b" / "ckpt-000002" / "model.safetensors").read_bytes())
    with pytest.raises(CorruptCheckpointError, match=r"do not load into model 'transformer'.*size mismatch"):
        _trainer(tmp_path / "a", resume=True)
    # verified files that do not fit the model (another mnemo's parameters): not called damaged
    from mnemo.train.checkpoint import write_manifest

    write_manifest(ckpt)
    with pytest.raises(ValueError, match=r"\(verified\) weights do not fit model 'transformer'") as info:
        _trainer(tmp_path / "a", resume=True)
    assert not isinstance(info.value, CorruptCheckpointError) and "size mismatch" in str(info.value)


def test_a_saved_config_this_mnemo_refuses_names_its_file(tmp_path, capsys):
    _trainer(tmp_path, steps=2).fit()
    ckpt = tmp_path / "ckpt-000002"
    saved = json.loads((ckpt / "train_config.json").read_text())
    (ckpt / "train_config.json").write_text(json.dumps({**saved, "a_newer_field": 1}))
    ckpt_mod.write_manifest(ckpt)  # (as a newer mnemo would have written it)
    assert main(["train", "--out", str(tmp_path), "--resume", "--steps", "4", "--reschedule", "hold"]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt / 'train_config.json'}: the run's saved settings do not load" in err
    assert "a_newer_field" in err


def test_an_interrupt_during_the_last_step_still_stops_the_command(tmp_path, capsys, monkeypatch, request):
    """SIGINT while the last step is evaluated: the run is saved, and the command exits 130 (it went
    on to sample text and exited 0, the interrupt dropped)."""
    olds = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    }
    request.addfinalizer(lambda: [signal.signal(s, h) for s, h in olds.items()])
    real = Trainer._eval_record

    def eval_and_signal(self, *a, **k):
        record = real(self, *a, **k)
        if self.step == self.cfg.steps:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(Trainer, "_eval_record", eval_and_signal)
    out = tmp_path / "run"
    args = [a if a != "0" else "50" for a in FLAGS]  # a sample after training, which is skipped
    assert main(["train", "--out", str(out), "--steps", "4", *args]) == 130
    err = capsys.readouterr()
    assert "SIGINT at step 4" in err.err and "nothing is left to resume" in err.err
    assert "--- sample ---" not in err.out
    assert (out / "latest").read_text().strip() == "ckpt-000004"
    monkeypatch.setattr(Trainer, "_eval_record", real)
    t = _trainer(out, eval_interval=1)  # fit(until): stopped short of the end, the advice is to resume
    with pytest.raises(ValueError, match="already holds a run"):
        t.fit()


def test_an_interrupt_in_the_last_step_of_fit_until_is_raised(tmp_path, monkeypatch, request):
    olds = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    request.addfinalizer(lambda: [signal.signal(s, h) for s, h in olds.items()])
    t = _trainer(tmp_path)
    real = t.train_step

    def step_and_signal():
        loss = real()
        if t.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(t, "train_step", step_and_signal)
    with pytest.raises(KeyboardInterrupt, match="SIGINT at step 2") as e:
        t.fit(until=2)
    assert not hasattr(e.value, "then")  # (the run goes on with --resume)
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000002"


def test_a_log_without_a_checkpoint_gets_advice_that_works(tmp_path, capsys):
    """A run that stopped before its first checkpoint left metrics.jsonl alone: the command advised
    --resume, which then failed with "no checkpoint"."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 2, "train_loss": 4.0}\n')
    assert main(["train", "--out", str(out), "--steps", "2", *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "wrote no checkpoint (nothing to resume); pass --overwrite" in err and "--resume to" not in err
    assert main(["train", "--out", str(out), "--resume"]) == 2
    assert "--overwrite starts over" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--steps", "2", "--overwrite", *FLAGS]) == 0
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [2]


def test_resume_says_when_the_text_changed_since_the_checkpoint(tmp_path):
    """The file at ``data`` was edited after the checkpoint: the resumed run trained on other tokens
    (other batches than the uninterrupted run's) without a word. Now a warning names both sizes."""
    import warnings

    data = tmp_path / "text.txt"
    data.write_text("hello world, this is a tiny corpus. " * 40)
    out = tmp_path / "run"
    _trainer(out, data=str(data), seq_len=32, batch_size=2, steps=2, sample_tokens=0).fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same text: no warning
        _trainer(out, resume=True, reschedule="hold", steps=3).fit()
    text = data.read_text()
    data.write_text(text + "and then a few more words.\n")
    with pytest.warns(UserWarning, match=r"is not the text .*ckpt-000003 was trained on \(1,296 train"):
        _trainer(out, resume=True, reschedule="hold", steps=4)
    data.write_text(text.replace("world", "WORLD"))  # as many tokens, other ones
    with pytest.warns(UserWarning, match="other tokens"):
        _trainer(out, resume=True, reschedule="hold", steps=4)
