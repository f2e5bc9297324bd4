"""The recipe standard of mnemo's published comparisons, and the verdict on a claim.

A comparison a reviewer accepts gives every model its own learning rate, chosen on a seed that is
not reported, trains until the runs have left the initial plateau, reports several seeds with
intervals, and says for each claim whether the experiment could tell it from its negation. This
module holds the three pieces the sweep machinery uses for that:

* :func:`recipe_problems` — a sweep file with ``recipe: standard`` must tune ``lr`` per cell over
  at least :data:`MIN_LR_VALUES` values spanning at least :data:`MIN_LR_SPAN` (max / min), select
  it on a held-out seed (``select_lr_on_seed``) and report at least :data:`MIN_REPORTED_SEEDS`
  other seeds. :meth:`mnemo.sweep.SweepSpec.from_dict` refuses a standard sweep that does not.
* :func:`left_plateau` — whether one run's evaluation curve (``metrics.jsonl``, stored with each
  sweep run as ``curve``) left its initial plateau: its best value improved on the plateau's level
  (the median of the curve's first half) by at least ``rise`` (accuracies: :data:`ACC_RISE`
  absolute; ``val_loss``: :data:`LOSS_RISE` of the level), or reached the threshold (or, for an
  accuracy, started within ``ACC_RISE`` of the ceiling: it left before the first evaluation). A
  run that did not is still on the plateau: its value says nothing about the model's ability, only
  about the budget.
* :func:`judge_claim` — a claim ``better`` beats ``than`` on the sweep's metric, judged on the
  seeds both report (paired: the difference per seed, then its Student-t interval,
  :func:`~mnemo.sweep.stats.mean_interval`). The verdict is one of ``reproduced`` (the interval
  lies above 0), ``not reproduced`` (it contains 0, or lies below: then the opposite holds), or
  ``not testable here`` with the reason: fewer than :data:`MIN_REPORTED_SEEDS` paired seeds, a
  run still on its plateau, or both models at the ceiling (every value past the threshold: the
  task cannot separate them).
"""

from __future__ import annotations

import math
from typing import Any

from .stats import mean_interval

#: the standard's learning-rate grid: at least this many values ...
MIN_LR_VALUES = 3
#: ... spanning at least this factor (largest / smallest)
MIN_LR_SPAN = 10.0
#: seeds reported per cell (the held-out selection seed comes on top)
MIN_REPORTED_SEEDS = 3
#: an accuracy curve left its plateau when its best value rose this much (absolute) above the
#: plateau's level (the median of the curve's first half, :func:`left_plateau`)
ACC_RISE = 0.1
#: a loss curve left its plateau when its best value fell this fraction of the level below it
LOSS_RISE = 0.05
#: slack on the rise rules: a rise of exactly ``ACC_RISE`` (0.25 to 0.35, whose float difference is
#: 0.09999999999999998) or ``LOSS_RISE`` counts as a rise, not as rounding's "still on the plateau";
#: and on the lr span: a grid spanning exactly ``MIN_LR_SPAN`` (3e-5 … 3e-4) meets it
_RISE_SLACK = 1e-9

VERDICTS = ("reproduced", "not reproduced", "not testable here")


def recipe_problems(
    lr_values: list | None,
    seeds: list[int] | None,
    select_lr_on_seed: int | None,
    where: str = "grid.lr",
) -> list[str]:
    """What a sweep lacks against the standard (empty when it meets it).

    Args:
        lr_values: the sweep's tuned ``lr`` grid (``None`` when ``lr`` is not a tuned axis).
        seeds: the sweep's seeds (``None`` when it has none).
        select_lr_on_seed: its held-out selection seed, or ``None``.
        where: the sweep key that holds ``lr_values`` (a model entry's own ``grid:`` may;
            default ``"grid.lr"``).
    Returns:
        One sentence per problem, each naming the sweep key to change.
    """
    problems = []
    if not lr_values:
        problems.append("'grid' has no tuned 'lr' axis: every model needs its own learning rate")
    else:
        bad = [
            v
            for v in lr_values
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0)
        ]
        lrs = [v for v in lr_values if v not in bad]
        if bad:  # named as such: counting them out would blame the number of values
            from ..train.config import _yaml_hint

            problems.append(
                f"'{where}' holds {bad[0]!r}, which is not a positive finite learning rate"
                + _yaml_hint(bad[0])
            )
        elif len(set(lrs)) < MIN_LR_VALUES:
            problems.append(
                f"'{where}' has {len(set(lrs))} distinct value(s); the standard needs >= {MIN_LR_VALUES}"
            )
        elif max(lrs) / min(lrs) < MIN_LR_SPAN * (1 - _RISE_SLACK):  # 3e-5 … 3e-4 is 9.999999999999998
            problems.append(
                f"'{where}' spans {max(lrs) / min(lrs):.3g}x ({min(lrs):g} … {max(lrs):g}); the standard "
                f"needs >= {MIN_LR_SPAN:g}x"
            )
    if select_lr_on_seed is None:
        problems.append("'select_lr_on_seed' is not set: the learning rate must be chosen on a held-out seed")
    reported = sorted({s for s in (seeds or []) if s != select_lr_on_seed})  # a repeated seed counts once
    if len(reported) < MIN_REPORTED_SEEDS:
        problems.append(
            f"'seeds' leaves {len(reported)} reported seed(s) besides the held-out one; the standard needs "
            f">= {MIN_REPORTED_SEEDS}"
        )
    return problems


def _higher_is_better(metric: str) -> bool:
    return metric != "val_loss"


def left_plateau(curve: list[dict] | None, metric: str, threshold: float | None = None) -> bool | None:
    """Whether a run's evaluation ``curve`` (records with ``step`` and ``metric``, in order) left
    its initial plateau; ``None`` (unknown) when the curve has no finite value, or only one that did
    not reach ``threshold`` (nor lies in the ceiling's band below): a single evaluation shows no rise
    and no plateau either.

    The plateau's level is the median of the first half of the curve (its first ``⌈n/2⌉``
    values), not its first value: a first evaluation often sits *below* the plateau (MQAR's
    first evaluation at 0.16, then 0.24–0.28 for 900 steps, the level of guessing one of the
    values present), and a rise from there is not learning. Accuracies (higher is better): the best
    value is at least :data:`ACC_RISE` above that level, or reaches ``threshold``. ``val_loss``: the
    best value is at least :data:`LOSS_RISE` × the level below it, or at most ``threshold``.

    An accuracy curve whose level already lies within :data:`ACC_RISE` of the ceiling (``threshold``,
    else 1; not for a threshold below ``1 − ACC_RISE``, which may lie within the margin of a task's
    guessing) left its plateau before the first evaluation (``True``, also for a single evaluation):
    there a rise by the margin could only be the threshold reached, so a run that learnt the task
    to 0.93 at its first evaluation and ends at 0.95 (threshold 0.99) would read as "stuck"; the
    initial plateau of a run from scratch is its untrained model's guessing level, which it has
    left. (A run that starts from another run's weights is not judged at all: the report's
    ``_plateau``.) A loss has no ceiling, so ``val_loss`` curves have no such rule."""
    values = [r.get(metric) for r in curve or []]
    values = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return None
    head = sorted(values[: (len(values) + 1) // 2])
    level = head[(len(head) - 1) // 2]  # the (lower) median of the first half
    # (a threshold below 1 − ACC_RISE may lie within ACC_RISE of a task's guessing: MQAR's 0.25
    # under --threshold 0.3; there the rule stays a rise or the threshold reached)
    if _higher_is_better(metric) and (threshold is None or threshold >= 1 - ACC_RISE - _RISE_SLACK):
        ceiling = 1.0 if threshold is None else min(threshold, 1.0)
        if level >= ceiling - ACC_RISE - _RISE_SLACK:  # no room for a rise short of the ceiling:
            return True  # the plateau (an untrained model's guessing) lay before the first evaluation
    if len(values) == 1:  # one evaluation: reached the threshold, or nothing to compare it with
        reached = threshold is not None and (
            values[0] >= threshold if _higher_is_better(metric) else values[0] <= threshold
        )
        return True if reached else None
    if _higher_is_better(metric):
        best = max(values)
        return best - level >= ACC_RISE - _RISE_SLACK or (threshold is not None and best >= threshold)
    best = min(values)
    return level - best >= LOSS_RISE * abs(level) * (1 - _RISE_SLACK) or (
        threshold is not None and best <= threshold
    )


def judge_claim(
    claim: dict[str, Any],
    better: dict,
    than: dict,
    *,
    metric: str,
    threshold: float | None,
    confidence: float = 0.95,
) -> dict:
    """The verdict on ``claim`` (``{"name", "better", "than"}``) from two cells' statistics.

    ``better`` and ``than`` are :func:`~mnemo.sweep.report.cell_stats` entries with, per reported
    seed, ``seeds``, ``values`` and ``plateau`` (:func:`left_plateau` of that run, or ``None``).
    The difference per shared seed is ``better − than`` (``than − better`` for ``val_loss``, so
    that a positive difference always favours ``better``). A seed where either cell's run diverged
    (its ``diverged_seeds``) has no value to pair, so it is left out of the difference; ``why``
    names it (a divergence is a result about the model, not a missing measurement).

    Returns:
        ``{"claim", "better", "than", "metric", "seeds", "differences", "n", "mean", "low",
        "high", "confidence", "verdict", "why"}`` (``verdict`` in :data:`VERDICTS`; ``why`` one
        sentence).
    """
    sign = 1.0 if _higher_is_better(metric) else -1.0
    a = dict(zip(better["seeds"], better["values"]))
    b = dict(zip(than["seeds"], than["values"]))
    shared = sorted(set(a) & set(b))
    diffs = [sign * (a[s] - b[s]) for s in shared]
    st = mean_interval(diffs, confidence)
    out = {
        "claim": claim.get("name", f"{claim['better']} > {claim['than']}"),
        "better": claim["better"],
        "than": claim["than"],
        "metric": metric,
        "seeds": shared,
        "differences": diffs,
        "n": st["n"],
        "mean": st["mean"],
        "low": st["low"],
        "high": st["high"],
        "confidence": confidence,
    }

    def stuck(cell):
        plateau = dict(zip(cell["seeds"], cell.get("plateau") or [None] * len(cell["seeds"])))
        return [s for s in shared if plateau.get(s) is False]

    stuck_a, stuck_b = stuck(better), stuck(than)
    at_ceiling = (
        threshold is not None
        and shared
        and all(
            (v >= threshold) if _higher_is_better(metric) else (v <= threshold)
            for v in [a[s] for s in shared] + [b[s] for s in shared]
        )
    )
    if len(shared) < MIN_REPORTED_SEEDS:
        verdict, why = "not testable here", f"{len(shared)} paired seed(s) (< {MIN_REPORTED_SEEDS})"
    elif stuck_a or stuck_b:
        who = [f"{claim['better']} seed(s) {stuck_a}"] * bool(stuck_a) + [
            f"{claim['than']} seed(s) {stuck_b}"
        ] * bool(stuck_b)
        verdict, why = "not testable here", f"{' and '.join(who)} did not leave the initial plateau"
    elif at_ceiling:
        verdict = "not testable here"
        why = (
            f"every run of both reached {metric} {'≥' if sign > 0 else '≤'} {threshold:g}: the task cannot "
            "separate them"
        )
    elif st["low"] > 0:
        verdict, why = (
            "reproduced",
            f"paired difference {st['mean']:+.4g} [{st['low']:+.4g}, {st['high']:+.4g}] > 0",
        )
    elif st["high"] < 0:
        verdict = "not reproduced"
        why = f"the opposite holds: paired difference {_ci(st)} < 0"
    else:
        verdict = "not reproduced"
        why = f"no difference: paired difference {_ci(st)} contains 0"
    lost = [
        f"{claim[side]} seed(s) {gone}"
        for side, cell in (("better", better), ("than", than))
        if (gone := sorted(set(cell.get("diverged_seeds") or [])))
    ]
    if lost:  # never silently: the paired seeds above are fewer than the runs of the two cells
        why += f"; left out of the pairs: {' and '.join(lost)} diverged"
    out.update(verdict=verdict, why=why)
    return out


def _ci(st: dict) -> str:
    return f"{st['mean']:+.4g} [{st['low']:+.4g}, {st['high']:+.4g}]"


def claims_markdown(judged: list[dict]) -> str:
    """The claims table of a report: claim, paired seeds, difference with its interval, verdict."""
    if not judged:
        return ""
    lines = [
        "| claim | better | than | n (paired) | difference [CI] | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for j in judged:
        diff = "—" if j["mean"] is None else f"{j['mean']:+.4f}"
        if j["low"] is not None:
            diff += f" [{j['low']:+.4f}, {j['high']:+.4f}]"
        lines.append(
            f"| {j['claim']} | {j['better']} | {j['than']} | {j['n']} | {diff} | "
            f"**{j['verdict']}**: {j['why']} |"
        )
    return "\n".join(lines) + "\n"
