"""Training and evaluating on tasks: accuracy rises, long-length evaluation streams through the
recurrent state, resume stays exact, the test set is fixed and comes from the test seed."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task, make_generator
from mnemo.models import LanguageModel, build_config
from mnemo.train import TrainConfig, Trainer
from mnemo.train.task_eval import eval_batch_size, task_metrics

EASY = {"num_pairs": 2, "vocab_size": 16}


def _cfg(**kw):
    base = dict(
        model="transformer",
        model_overrides={"d_model": 32, "n_layers": 2},
        task="mqar",
        task_options=EASY,
        seq_len=16,
        batch_size=32,
        steps=150,
        eval_interval=75,
        eval_batches=4,
        lr=1e-2,
        warmup_steps=10,
        weight_decay=0.0,
    )
    base.update(kw)
    return TrainConfig(**base)


def _quiet(fn, *a, **k):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **k)


def test_accuracy_rises_on_easy_mqar(tmp_path):
    tr = Trainer(_cfg(), tmp_path, progress=False)
    before = tr.evaluate()
    rec = _quiet(tr.fit)
    # 2 pairs, 8 values: chance is 1/8; 150 steps reach ~0.5 (full recall takes ~1000 steps)
    assert before["val_acc"] < 0.2, before
    assert rec["val_acc"] > 0.4, rec
    assert rec["val_loss"] < before["val_loss"] - 1.0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [75, 150]
    assert {"val_loss", "val_acc", "val_seq_acc", "train_loss", "tokens_per_s"} <= set(lines[0])
    assert "val_bpc" not in lines[0]
    assert not (tmp_path / "ckpt-000150" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="no text to sample: this run trains on the task 'mqar'"):
        tr.sample()


def test_eval_at_a_longer_length_for_a_recurrent_model(tmp_path):
    cfg = _cfg(model="gated_deltanet", steps=6, eval_interval=3, eval_lengths=[64, 128])
    tr = Trainer(cfg, tmp_path, progress=False)
    rec = _quiet(tr.fit)
    n = cfg.eval_batches * cfg.batch_size
    tr.model.eval()
    for L in (64, 128):
        # the metrics at L, recomputed here in one plain forward pass over the same test set
        x, y, _ = tr._test_sets[(L, n)]  # (ids, scored targets, answer units)
        with torch.no_grad():
            logits = tr.model(x)[0].float()
        sup = y != IGNORE_INDEX
        loss = torch.nn.functional.cross_entropy(logits[sup], y[sup]).item()
        acc = (logits.argmax(-1)[sup] == y[sup]).double().mean().item()
        assert rec[f"val_loss@{L}"] == pytest.approx(loss, rel=1e-4)
        assert rec[f"val_acc@{L}"] == pytest.approx(acc, abs=1.5 / int(sup.sum()))  # at most one tie apart
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "val_acc@128" not in lines[0] and "val_acc@128" in lines[1], "extra lengths at the end only"
    # the test sets come from the test seed at each length
    x, y, _ = tr._test_sets[(128, cfg.eval_batches * cfg.batch_size)]
    ref = build_task("mqar", EASY).sample(cfg.eval_batches * cfg.batch_size, 128, seed=cfg.seed, split="test")
    assert torch.equal(x, ref[0]) and torch.equal(y, ref[1])


@pytest.mark.parametrize("model", ["gated_deltanet", "mamba", "transformer"])
def test_streamed_evaluation_equals_one_pass(model):
    torch.manual_seed(0)
    task = build_task("mqar", EASY)
    m = LanguageModel(build_config(model, vocab_size=task.vocab_size, d_model=32, n_layers=2)).double()
    x, y = task.sample(6, 96, seed=0, split="test")
    whole = task_metrics(m, x, y, batch_size=4)
    pieces = task_metrics(m, x, y, batch_size=4, piece_len=16)
    odd = task_metrics(m, x, y, batch_size=6, piece_len=40)
    assert whole["n"] == pieces["n"] == 6 * 2
    for other in (pieces, odd):
        assert abs(whole["loss"] - other["loss"]) < 1e-9 and whole["acc"] == other["acc"]
        assert whole["seq_acc"] == other["seq_acc"]


def test_task_metrics_counts_tokens_and_sequences():
    class Oracle(torch.nn.Module):  # predicts the targets of the first 3 rows, garbage for the rest
        def __init__(self, y, V):
            super().__init__()
            self.y, self.V = y, V

        def forward(self, ids, state=None):
            a = 0 if state is None else state
            tgt = self.y[: ids.shape[0], a : a + ids.shape[1]].clamp_min(0).clone()
            tgt[3:] = (tgt[3:] + 1) % self.V
            return torch.nn.functional.one_hot(tgt, self.V).float() * 10, a + ids.shape[1]

    task = build_task("mqar", EASY)
    x, y = task.sample(5, 32, seed=0)
    r = task_metrics(Oracle(y, 16), x, y, batch_size=5, piece_len=8)
    assert r["acc"] == pytest.approx(3 / 5) and r["seq_acc"] == pytest.approx(3 / 5) and r["n"] == 10
    with pytest.raises(ValueError, match="no supervised positions"):
        task_metrics(Oracle(y, 16), x, torch.full_like(y, IGNORE_INDEX), batch_size=5)
    assert eval_batch_size(32, 256, 4096) == 2 and eval_batch_size(4, 256, 4096) == 1


def test_task_resume_is_exact(tmp_path):
    cfg = _cfg(steps=8, eval_interval=4)
    ref = Trainer(cfg, tmp_path / "a", progress=False)
    losses = [ref.train_step() for _ in range(8)]
    first = Trainer(cfg, tmp_path / "b", progress=False)
    _quiet(first.fit, until=3)
    again = Trainer(cfg, tmp_path / "b", resume=True, progress=False)
    assert again.step == 3
    assert [again.train_step() for _ in range(5)] == losses[3:]


def test_training_batches_come_from_the_train_seed(tmp_path):
    cfg = _cfg(seed=3)
    tr = Trainer(cfg, tmp_path, progress=False)
    task = build_task("mqar", EASY)
    g = make_generator(3, "train")
    assert torch.equal(tr.generator.get_state(), g.get_state())
    train_x, _ = task.generate(cfg.batch_size, cfg.seq_len, g)
    test_x, _ = task.sample(cfg.batch_size, cfg.seq_len, seed=3, split="test")
    assert not torch.equal(train_x, test_x)
    assert tr.model.config.vocab_size == task.vocab_size


def test_learned_positions_must_cover_the_eval_lengths(tmp_path):
    cfg = _cfg(
        model="transformer_abs", eval_lengths=[64], model_overrides={"d_model": 32, "max_position": 32}
    )
    with pytest.raises(
        ValueError, match=r"TrainConfig.eval_lengths: 64 tokens exceed .* \(max_position = 32\)"
    ):
        Trainer(cfg, tmp_path, progress=False)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("task", "mqr", r"TrainConfig.task: expected None or one of \['copying'"),
        ("task_options", {"pairs": 2}, r"TrainConfig.task_options: unknown mqar option\(s\) \['pairs'\]"),
        ("task_options", {"num_pairs": 0}, "TrainConfig.task_options: mqar option 'num_pairs'"),
        ("task_options", [1], "TrainConfig.task_options: expected a mapping"),
        ("seq_len", 4, "TrainConfig.seq_len: mqar .* needs sequences of at least 8 tokens, got 4"),
        ("eval_lengths", [0], "TrainConfig.eval_lengths: expected a list of positive ints"),
        ("eval_lengths", [4], "TrainConfig.eval_lengths: mqar .* needs sequences of at least 8"),
    ],
)
def test_task_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**{field: value}).validate()


def test_task_fields_need_a_task():
    with pytest.raises(ValueError, match="TrainConfig.eval_lengths: expected an empty list when no task"):
        TrainConfig(eval_lengths=[512]).validate()
    with pytest.raises(ValueError, match="TrainConfig.task_options: expected no options when no task"):
        TrainConfig(task_options={"num_pairs": 2}).validate()
