"""Sixth break-it review of the recall tasks, the task metrics and the statistics behind claims."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task
from mnemo.data.tasks.continual import make_task
from mnemo.sweep.stats import mean_interval, t_quantile
from mnemo.train.task_eval import evaluate_task

# --------------------------------------------------------------------------------------------
# the continual streams' sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "experiment, sizes, option",
    [
        ("forgetting_mqar", {"n": 4.0}, "n"),
        ("forgetting_mqar", {"m": True}, "m"),
        ("forgetting_mqar", {"n_values": 2.5}, "n_values"),
        ("retention", {"offset": 1.5}, "offset"),
        ("retention", {"offset": True}, "offset"),
        ("retention", {"bins": 2.0}, "bins"),
        ("retention", {"n": 8.0, "bins": 2, "per_bin": 1}, "n"),
        ("retention", {"n_values": 3.0}, "n_values"),
        ("class_incremental", {"phases": 2.0}, "phases"),
    ],
)
def test_continual_sizes_that_are_no_ints_are_named(experiment, sizes, option):
    """``forgetting_mqar`` and ``retention`` checked their sizes by value only (and
    ``class_incremental`` its ``phases``): a float size passed and crashed later in ``randperm`` /
    ``randint`` / a slice with a TypeError naming nothing ("slice indices must be integers"), and
    ``offset=True`` was taken as 1."""
    with pytest.raises(ValueError, match=rf"^{option}: expected .*got"):
        make_task(experiment, **sizes).batch(2, torch.Generator().manual_seed(0))


def test_continual_int_sizes_still_build():
    for experiment, sizes in [
        ("forgetting_mqar", {"n": 4, "m": 1, "n_keys": 4, "n_values": 2}),
        ("retention", {"n": 4, "bins": 2, "per_bin": 2, "n_keys": 4, "n_values": 2, "offset": 0}),
        ("class_incremental", {"phases": 2, "classes_per_phase": 1, "n_labels": 2}),
    ]:
        batch = make_task(experiment, **sizes).batch(2, torch.Generator().manual_seed(0))
        assert (batch.targets != IGNORE_INDEX).any()


# --------------------------------------------------------------------------------------------
# evaluate_task's test-set cache
# --------------------------------------------------------------------------------------------


class _ConstantModel(torch.nn.Module):
    """Always predicts token ``c`` (logits 1 on it, 0 elsewhere)."""

    def __init__(self, V: int, c: int):
        super().__init__()
        self.V, self.c = V, c

    def forward(self, x, state=None):
        logits = torch.nn.functional.one_hot(torch.full_like(x, self.c), self.V).double()
        return logits, state


def _hand(task, L, n, seed, c):
    x, y = task.sample(n, L, seed=seed, split="test")
    y = task.scored(x, y)
    mask = y != IGNORE_INDEX
    return int(((y == c) & mask).sum()) / int(mask.sum())


def test_a_shared_test_set_cache_never_hands_one_seed_or_task_another_ones_test_set():
    """The cache was keyed ``(length, rows)`` only: evaluating seed 1 (or another task) with the
    cache filled by seed 0 silently scored seed 0's test set. A trainer's cache (one seed, one
    task) keeps its documented ``(length, rows)`` keys."""
    V, L, n = 16, 16, 64
    c = V // 2 + 1  # one of the values
    model = _ConstantModel(V, c)
    a = build_task("mqar", vocab_size=V, num_pairs=2)
    b = build_task("mqar", vocab_size=V, num_pairs=3)
    cache: dict = {}
    kw = dict(num_samples=n, batch_size=8, train_len=L)
    runs = [(a, 0), (a, 1), (b, 1), (a, 0)]
    got = [evaluate_task(model, t, [L], seed=s, cache=cache, **kw)[L]["acc"] for t, s in runs]
    want = [_hand(t, L, n, s, c) for t, s in runs]
    assert got == want
    assert len(set(want[:3])) == 3  # the three test sets differ in what this model scores
    # the cache holds one seed's and task's test sets, by (length, rows)
    assert sorted(k for k in cache if k != "for") == [(L, n)]


# --------------------------------------------------------------------------------------------
# Student-t with two degrees of freedom (three seeds)
# --------------------------------------------------------------------------------------------


def _exact_df2(p: float) -> float:
    """``(2p − 1) / √(2p(1 − p))`` at the float ``p``, correctly rounded (exact rationals)."""
    P = Fraction(p)
    num, den2 = 2 * P - 1, 2 * P * (1 - P)  # t = num / √den2, t² = num² / den2
    t2 = num * num / den2
    t = math.sqrt(float(t2))
    for cand in (math.nextafter(t, 0), t, math.nextafter(t, math.inf)):  # the nearest float to √t2
        if abs(Fraction(cand) ** 2 - t2) <= abs(Fraction(t) ** 2 - t2):
            t = cand
    return t if num > 0 else -t


@pytest.mark.parametrize("p", [0.6, 0.75, 0.9, 0.95, 0.975, 0.99, 0.995, 0.999, 0.025])
def test_the_t_of_three_seeds_is_its_closed_form_to_one_rounding(p):
    """``df = 2`` (the interval of three seeds, the standard's minimum) went through the bisection:
    ``t_quantile(0.975, 2)`` returned 4.302652729749458, 4 units in the last place below the
    closed form its docstring quoted (the exact value at the float 0.975 is 4.302652729749462)."""
    exact = _exact_df2(p)
    assert abs(t_quantile(p, 2) - exact) <= 2 * math.ulp(exact)


def test_the_docstring_example_is_what_t_quantile_returns():
    shown = re.search(r"t_quantile\(0\.975, 2\) = ([0-9.]+)", t_quantile.__doc__).group(1)
    assert float(shown) == t_quantile(0.975, 2) == _exact_df2(0.975)
    # and the interval of three seeds by hand: 0.1, 0.2, 0.3 → mean 0.2, std 0.1
    st = mean_interval([0.1, 0.2, 0.3])
    assert st["half_width"] == pytest.approx(_exact_df2(0.975) * 0.1 / math.sqrt(3), rel=4e-16, abs=0)


# --------------------------------------------------------------------------------------------
# icl_score's skip, as the other circuit scores take it
# --------------------------------------------------------------------------------------------


class _TokenModel(torch.nn.Module):
    """Logits ``x_t · w`` per position: a fixed, input-dependent prediction (float64)."""

    def __init__(self, V: int):
        super().__init__()
        self.w = torch.linspace(-1.0, 1.0, V, dtype=torch.float64)

    def forward(self, x, state=None):
        return x[..., None].double() * self.w, state


@pytest.mark.parametrize("skip", [np.int64(1), torch.tensor(1)])
def test_icl_score_takes_a_numpy_or_0d_tensor_skip(skip):
    """``icl_score`` refused ``skip=np.int64(1)`` ("expected an int ..., got np.int64(1)"), which
    ``previous_token_score``, ``induction_score`` and the others of the module take."""
    from mnemo.interp.scores import icl_score

    V = 7
    ids = torch.randint(0, V, (3, 21), generator=torch.Generator().manual_seed(0))
    m = _TokenModel(V)
    got = icl_score(m, ids, skip=skip)
    logits, _ = m(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(0)
    loss = loss[1:]  # 19 predictions: early (0.05, 0.15) → [0, 3), late (0.8, 1.0) → [15, 19)
    assert got == pytest.approx(float(loss[15:19].mean() - loss[0:3].mean()), rel=1e-14, abs=0)
    assert got == icl_score(m, ids, skip=1)
    for bad in (np.int64(20), np.float64(1.0), torch.tensor(True)):
        with pytest.raises(ValueError, match=r"skip: expected an int in \[0, 20\)"):
            icl_score(m, ids, skip=bad)
