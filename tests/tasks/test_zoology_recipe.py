"""What Zoology's MQAR recipe needs from the trainer (docs/results/zoology_mqar.md): a fixed training
set read epoch after epoch, early stopping at an accuracy, and a head applied only at the supervised
positions (same loss and gradients, without the ``[B, T, vocab]`` logits of a vocabulary of 8192)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task, make_generator
from mnemo.models import LanguageModel, build_config
from mnemo.train import Trainer
from mnemo.train.trainer import fixed_batch, fixed_train_set
from tests.tasks.test_task_training import EASY, _quiet
from tests.tasks.test_task_training import _cfg as _task_cfg


def _cfg(**kw):
    """test_task_training's small MQAR run, shortened (6 steps of 8) and with the default weight decay."""
    short = dict(batch_size=8, steps=6, eval_interval=3, eval_batches=2, warmup_steps=0, weight_decay=0.1)
    return _task_cfg(**{**short, **kw})


# -- the head at the supervised positions only ------------------------------------------------
@pytest.mark.parametrize("model", ["transformer", "transformer_abs", "gated_deltanet"])
def test_logits_at_equals_the_full_head_at_those_positions(model):
    torch.manual_seed(0)
    m = LanguageModel(build_config(model, vocab_size=16, d_model=32, n_layers=2)).double()
    x, y = build_task("mqar", EASY).sample(3, 16, seed=0)
    at = y != IGNORE_INDEX
    full, _ = m(x)
    sparse, _ = m(x, logits_at=at)
    assert sparse.shape == (int(at.sum()), 16)
    torch.testing.assert_close(sparse, full[at], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="logits_at must be a bool tensor shaped like input_ids"):
        m(x, logits_at=at.long())
    with pytest.raises(ValueError, match="logits_at must be a bool tensor shaped like input_ids"):
        m(x, logits_at=at[:, :-1])


def test_task_training_step_loss_and_gradients_equal_the_full_head(tmp_path):
    tr = Trainer(_cfg(grad_clip=0.0), tmp_path, progress=False)
    g = make_generator(0, "train")
    g.set_state(tr.generator.get_state())
    x, y = tr.task.generate(8, 16, g)  # the batch the step will draw
    ref = LanguageModel(tr.model.config)
    ref.load_state_dict(tr.model.state_dict())
    logits, _ = ref(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    got = tr.train_step()
    assert got == pytest.approx(loss.item(), rel=1e-6)
    # the optimizer has stepped: compare the gradients it used
    for (name, p), q in zip(tr.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


# -- a fixed training set ------------------------------------------------------------------------
def test_fixed_train_set_comes_from_the_train_stream_and_is_read_in_order():
    task = build_task("mqar", EASY)
    x, y = fixed_train_set(task, 20, 16, seed=2, chunk=7)  # chunks continue one stream
    g = make_generator(2, "train")
    parts = [task.generate(n, 16, g) for n in (7, 7, 6)]
    rx, ry = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    assert x.dtype == torch.int32 and torch.equal(x.long(), rx) and torch.equal(y.long(), ry)
    # 20 rows, batches of 8: two batches per epoch (the last 4 rows are skipped), then again
    rows = [fixed_batch((x, y), s, 8)[0] for s in range(5)]
    assert torch.equal(rows[0], rx[:8]) and torch.equal(rows[1], rx[8:16])
    assert torch.equal(rows[2], rows[0]) and torch.equal(rows[3], rows[1]) and torch.equal(rows[4], rows[0])
    assert rows[0].dtype == torch.long


def test_training_on_a_fixed_set_uses_only_its_rows_and_resumes_exactly(tmp_path):
    cfg = _cfg(train_examples=16, steps=6)
    tr = Trainer(cfg, tmp_path / "a", progress=False)
    seen = []
    real = tr.task.generate
    tr.task.generate = lambda *a, **k: seen.append(a) or real(*a, **k)  # noqa: E731
    losses = [tr.train_step() for _ in range(6)]
    assert seen == [], "no fresh batch is drawn"
    assert losses[0] != losses[1]
    b = Trainer(cfg, tmp_path / "b", progress=False)
    _quiet(b.fit, until=3)
    again = Trainer(cfg, tmp_path / "b", resume=True, progress=False)
    assert [again.train_step() for _ in range(3)] == losses[3:]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(train_examples=0), "TrainConfig.train_examples: expected None or a positive int"),
        (dict(train_examples=4), r"TrainConfig.train_examples: expected None or at least batch_size \(8\)"),
        (dict(early_stop_acc=1.5), r"TrainConfig.early_stop_acc: expected None or a number in \(0, 1\]"),
        (
            dict(task=None, task_options={}, train_examples=16),
            "TrainConfig.train_examples: expected None when no task",
        ),
        (
            dict(task=None, task_options={}, early_stop_acc=0.9),
            "TrainConfig.early_stop_acc: expected None when no task",
        ),
    ],
)
def test_bad_recipe_options_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw).validate()


# -- early stopping ------------------------------------------------------------------------------
def test_early_stop_ends_the_run_at_the_first_evaluation_over_the_threshold(tmp_path):
    cfg = _cfg(steps=12, eval_interval=3, early_stop_acc=1e-9)  # reached at the first evaluation
    tr = Trainer(cfg, tmp_path, progress=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rec = tr.fit()
    assert rec["step"] == 3 and tr.step == 3 and tr.early_stopped
    assert "early stop at step 3" in out.getvalue()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [3]
    assert (tmp_path / "ckpt-000003").is_dir()
    # a resumed early-stopped run stays stopped
    again = Trainer(cfg, tmp_path, resume=True, progress=False)
    assert again.step == 3 and again.early_stopped
    assert _quiet(again.fit) == {} and again.step == 3
    # an unreachable threshold runs every step
    full = Trainer(
        _cfg(steps=6, eval_interval=3, early_stop_acc=1.0 - 1e-12), tmp_path / "full", progress=False
    )
    rec = _quiet(full.fit)
    assert rec["step"] == 6 and not full.early_stopped


def test_resuming_an_early_stopped_run_says_there_is_nothing_to_do(tmp_path, capsys):
    """``mnemo train --resume`` on a run that stopped early trains nothing, and says why (it
    printed the training header and a checkpoint line as if it had trained)."""
    from mnemo.cli import main

    out = tmp_path / "r"
    flags = ["--task", "mqar", "--task-option", "num_pairs=2", "--task-option", "vocab_size=16"]
    flags += ["--model", "gla", "--d-model", "16", "--n-layers", "1", "--seq-len", "16"]
    flags += ["--batch-size", "4", "--steps", "8", "--eval-interval", "2", "--eval-batches", "16"]
    flags += ["--early-stop-acc", "1e-9", "--warmup-steps", "0", "--no-progress", "--out", str(out)]
    assert main(["train", *flags]) == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] < 8  # it stopped early
    capsys.readouterr()
    assert main(["train", *flags, "--resume"]) == 0
    said = capsys.readouterr().out
    assert (
        f"already stopped early at step {steps[-1]} (val_acc reached --early-stop-acc 1e-09): nothing to do"
        in said
    )
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == steps


def test_the_evaluation_that_stops_the_run_is_the_final_one_with_eval_lengths(tmp_path):
    cfg = _cfg(steps=12, eval_interval=3, early_stop_acc=1e-9, eval_lengths=[32])
    tr = Trainer(cfg, tmp_path, progress=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rec = tr.fit()
    assert rec["step"] == 3 and tr.early_stopped
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] == 3 and "val_acc@32" in logged and "val_loss@32" in logged
    # the same numbers as evaluating the stopped model at 32 tokens afterwards (same test set)
    again = tr.evaluate(cfg.eval_batches, lengths=[32])
    assert logged["val_acc@32"] == again["val_acc@32"]
    assert logged["val_loss@32"] == pytest.approx(again["val_loss@32"], rel=1e-6)
    assert logged["val_acc"] == again["val_acc"]
