"""Fourth break-it review of the recall tasks, the task metrics, the trainer's evaluation and the
statistics behind claims."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.sweep.recipe import ACC_RISE, judge_claim, left_plateau
from tests.helpers import tiny_mqar_trainer

# --------------------------------------------------------------------------------------------
# the plateau rule
# --------------------------------------------------------------------------------------------


def _curve(values, metric="val_acc"):
    return [{"step": 2 * (i + 1), metric: v} for i, v in enumerate(values)]


def test_a_run_from_scratch_already_high_at_its_first_evaluation_left_its_plateau():
    """0.92, 0.93, 0.95 against a 0.99 threshold: no curve whose level is within ACC_RISE of the
    threshold can rise by ACC_RISE without reaching it, so the rule called a fast learner "still on
    its plateau" and its claim "not testable here"."""
    fast = _curve([0.92, 0.93, 0.95])
    assert left_plateau(fast, "val_acc", 0.99) is True
    assert (
        left_plateau(_curve([0.92, 0.93, 0.95], "val_seq_acc"), "val_seq_acc") is True
    )  # no threshold: the ceiling is 1
    # the edge of the band: 0.99 - 0.1 = 0.89 has no room left; 0.88 has (0.98 < 0.99)
    assert left_plateau(_curve([0.89, 0.89, 0.95]), "val_acc", 0.99) is True
    assert left_plateau(_curve([0.88, 0.88, 0.95]), "val_acc", 0.99) is False
    assert left_plateau(_curve([0.91, 0.92]), "val_acc") is True and 1 - 0.91 < ACC_RISE
    assert left_plateau(_curve([0.89, 0.89, 0.95]), "val_acc") is False  # 0.99 < 1: room to rise
    # MQAR's guessing plateau is still a plateau; a loss has no ceiling, so no such rule
    assert left_plateau(_curve([0.16, 0.24, 0.26, 0.28, 0.27, 0.28]), "val_acc", 0.99) is False
    assert left_plateau(_curve([0.05, 0.05, 0.049], "val_loss"), "val_loss") is False
    fast_cell = {"seeds": [1, 2, 3], "values": [0.95, 0.96, 0.95], "plateau": [True] * 3}
    slow_cell = {"seeds": [1, 2, 3], "values": [0.90, 0.90, 0.91], "plateau": [True] * 3}
    j = judge_claim({"better": "a", "than": "b"}, fast_cell, slow_cell, metric="val_acc", threshold=0.99)
    assert j["verdict"] == "reproduced"


# --------------------------------------------------------------------------------------------
# the trainer's evaluation
# --------------------------------------------------------------------------------------------


def _trainer(tmp_path, **kw):
    return tiny_mqar_trainer(tmp_path, **{"eval_batches": 2, **kw})


def test_the_text_validation_loss_of_a_float64_model_is_computed_in_float64(tmp_path):
    """The validation loss of a float64 model was the cross-entropy of its logits cast to float32
    (a relative error ~1e-7); the task metrics and the training loss keep float64. By hand: the
    float64 cross-entropy of the first ``eval_batches · batch_size`` windows."""
    tr = _trainer(tmp_path, task=None, task_options={}, sample_tokens=0)
    tr.model.double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))  # big logits: a big error
    ids, T = tr.val_data.ids, tr.cfg.seq_len
    total, n = 0.0, 0
    tr.model.eval()
    with torch.no_grad():
        for w in range(2 * 4):
            x, y = ids[w * T : (w + 1) * T][None], ids[w * T + 1 : (w + 1) * T + 1][None]
            logits, _ = tr.model(x)
            assert logits.dtype == torch.float64
            total += torch.nn.functional.cross_entropy(logits[0], y[0], reduction="sum").item()
            n += T
    ev = tr.evaluate(2)
    assert ev["val_tokens"] == n
    assert ev["val_loss"] == pytest.approx(total / n, rel=1e-13, abs=0)
    assert ev["val_bpc"] == pytest.approx(
        total / n * tr.val_data.ids.numel() / tr.val_chars / math.log(2), rel=1e-13
    )


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


def test_the_interval_of_values_whose_squares_overflow_is_computed_not_an_overflow_error():
    """``mean_interval`` scales an overflowing sum for the mean, but the squared deviations of
    values past ~1e154 raised ``OverflowError``. By hand: deviations 2/3·1e200, −4/3·1e200,
    2/3·1e200, so ``s = √((4 + 16 + 4)/9 · 1e400 / 2) = 2/√3 · 1e200``."""
    from mnemo.sweep.stats import mean_interval, t_quantile

    st = mean_interval([1e200, -1e200, 1e200])
    s = 2 / math.sqrt(3) * 1e200
    assert st["mean"] == pytest.approx(1e200 / 3, rel=1e-15)
    assert st["std"] == pytest.approx(s, rel=1e-15)
    half = t_quantile(0.975, 2) * s / math.sqrt(3)
    assert (st["low"], st["high"]) == pytest.approx((1e200 / 3 - half, 1e200 / 3 + half), rel=1e-14)
    # ordinary values: the same numbers as the textbook formula
    st = mean_interval([0.61, 0.64, 0.7, 0.58])
    m = (0.61 + 0.64 + 0.7 + 0.58) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in (0.61, 0.64, 0.7, 0.58)) / 3)
    assert st["std"] == pytest.approx(sd, rel=1e-14, abs=0)


def test_a_repeated_seed_is_not_three_reported_seeds():
    """``recipe_problems`` counted ``[1, 1, 1]`` (and the held-out 0) as three reported seeds."""
    from mnemo.sweep.recipe import recipe_problems

    lrs = [1e-3, 1e-2, 1e-1]
    (problem,) = recipe_problems(lrs, [0, 1, 1, 1], 0)
    assert "'seeds' leaves 1 reported seed(s)" in problem
    assert recipe_problems(lrs, [0, 1, 2, 3], 0) == []
