"""Sweep reports: per cell, the selected learning rate and the mean, 95% Student-t interval, number
of seeds and threshold count of its runs, as a markdown table and JSON, and the two recall plots
with error bars (accuracy vs recurrent state size, accuracy vs test length).

Statistics (:func:`cell_stats`): a cell's tuned values (``tune``, default the learning rate) are
chosen either on a held-out seed (``select_lr_on_seed: S`` in the sweep file: seed S's metric
alone; the statistics then use the other seeds at that learning rate, never S) or, without one, by
the mean over all seeds (optimistic: the same seeds choose and are reported). Over the reported
seeds at the chosen values: ``mean``; the interval ``mean ± t_{0.975, n−1} · s / √n`` (``s`` the
sample standard deviation; see :mod:`mnemo.sweep.stats` for why t and not a bootstrap), none for
``n = 1``; and how many runs reached the threshold (default 0.99 for accuracies, the early-stop
level of Zoology). ``n`` counts runs that finished training (``done``); a diverged run has no
metric, so it is left out of the mean but counts in the threshold's denominator as a run that did
not reach it; ``failed`` runs (errors, retried by the next ``mnemo sweep``) count nowhere. The
table's ``n`` column names every reported run left out of the mean (``3 (1 diverged, 1 without
val_loss)``: a ``done`` run whose metric is missing or not finite), and a claim names the seeds a
divergence left out of its pairs.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
import warnings
from collections import defaultdict
from pathlib import Path

from ..plotting import legend
from ..train.sinks import dumps_record, loads_record
from .db import SweepDB
from .recipe import claims_markdown, judge_claim, left_plateau
from .spec import METRICS_HIGHER_IS_BETTER
from .stats import mean_interval

_LEN_KEY = re.compile(r"^(val_acc|val_seq_acc)@(\d+)$")


def _score(row: dict, metric: str) -> float:
    v = row["metrics"].get(metric) if row["status"] == "done" else None
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return -math.inf
    return v if METRICS_HIGHER_IS_BETTER.get(metric, True) else -v


def best_per_cell(rows: list[dict], metric: str = "val_acc") -> list[dict]:
    """One row per cell: the run with the best ``metric`` (ties: lower ``val_loss``), with
    ``n_runs`` (runs in the cell) and ``cell_wall_time_s`` (their summed wall time) added."""
    cells: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        cells[json.dumps(r["cell"], sort_keys=True)].append(r)
    out = []
    for group in cells.values():

        def key(r):
            loss = r["metrics"].get("val_loss")
            loss = loss if isinstance(loss, (int, float)) and math.isfinite(loss) else math.inf
            return (_score(r, metric), -loss)

        best = dict(max(group, key=key))
        best["n_runs"] = len(group)
        best["n_failed"] = sum(r["status"] != "done" for r in group)
        best["cell_wall_time_s"] = sum(r["wall_time_s"] or 0.0 for r in group)
        out.append(best)
    return out


def default_threshold(metric: str) -> float | None:
    """0.99 for the accuracies (``val_acc``, ``val_seq_acc``: Zoology's early-stop level), ``None``
    (no threshold count) for ``val_loss``."""
    return 0.99 if METRICS_HIGHER_IS_BETTER.get(metric, True) else None


def _reached(value: float, threshold: float, metric: str) -> bool:
    """``value ≥ threshold`` for higher-is-better metrics, ``value ≤ threshold`` for losses."""
    return value >= threshold if METRICS_HIGHER_IS_BETTER.get(metric, True) else value <= threshold


def _value(row: dict, key: str) -> float | None:
    v = row["metrics"].get(key) if row["status"] == "done" else None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _seed(row: dict) -> int:
    s = row.get("seed")
    return int(row["config"].get("seed", 0)) if s is None else int(s)


def _mean(xs: list[float], empty: float) -> float:
    return sum(xs) / len(xs) if xs else empty


def cell_stats(
    rows: list[dict],
    metric: str = "val_acc",
    *,
    threshold: float | None = None,
    select_lr_on_seed: int | None = None,
    confidence: float = 0.95,
) -> list[dict]:
    """One summary per cell over its seeds (rows as :meth:`SweepDB.rows` returns them).

    Selection of the tuned values (``tuned``, e.g. ``{"lr": 0.003}``): with ``select_lr_on_seed =
    S``, the values whose ``done`` seed-``S`` run is best (``metric``, then lower ``val_loss``; a
    cell where seed ``S`` has no done run reports nothing, status ``"no done run of seed S"``); the
    statistics use the cell's runs at those values with ``seed != S``. Without
    it, the values with the largest share of ``done`` runs, then the best mean ``metric``, then the
    lower mean ``val_loss``, and the statistics use all their seeds (optimistic).

    Args:
        rows: sweep rows (``cell``, ``tuned``, ``seed``, ``status``, ``metrics``, ...).
        metric: the reported metric (``val_acc``, ``val_seq_acc``: fractions; ``val_loss``: nats).
        threshold: a run "reaches" it when its metric is ≥ it (≤ for ``val_loss``); default
            :func:`default_threshold` (0.99 for accuracies, none for the loss).
        select_lr_on_seed: the held-out seed ``S`` that chooses the tuned values, or ``None``.
        confidence: coverage of the Student-t interval (default 0.95).
    Returns:
        Per cell a dict: ``label``, ``model``, ``cell``, ``tuned`` (chosen values, ``{}`` when the
        held-out seed has no run in the cell), ``selected_on_seed`` (``S`` or ``None``),
        ``selection_value`` (seed ``S``'s metric at ``tuned``), ``seeds`` and ``values`` (the reported
        ``done`` runs, by seed), ``n``, ``mean``, ``std``, ``half_width``, ``low``, ``high``
        (:func:`~mnemo.sweep.stats.mean_interval`; ``None`` when ``n < 2``), ``confidence``,
        ``threshold``, ``plateau`` (per reported seed: whether its run left the initial plateau,
        ``None`` where unknown or for a fine-tuning run, :func:`_plateau`), ``n_reached`` and
        ``n_finished`` (reported runs that reached the threshold /
        that finished, done or diverged), ``n_diverged`` and ``diverged_seeds`` (their seeds),
        ``lengths`` (``{L: mean_interval}`` of
        the accuracy at test length ``L``, the training length included: ``val_seq_acc@L`` for a
        ``val_seq_acc`` sweep, else ``val_acc@L``), ``at_length`` (``{L: {"seeds", "values"}}``,
        the same per seed), ``state_size_bytes``, ``n_params``,
        ``seq_len``, ``status`` (``"done"`` when some reported run is, else the runs' status),
        ``n_runs``, ``n_failed`` (not-done runs of the whole cell) and ``cell_wall_time_s``.
    Raises:
        ValueError: ``threshold`` is not a finite number or ``select_lr_on_seed`` not an int.
    """
    if threshold is None:
        threshold = default_threshold(metric)
    elif (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold)
    ):
        raise ValueError(f"cell_stats: threshold must be a finite number or None, got {threshold!r}")
    if select_lr_on_seed is not None and (
        isinstance(select_lr_on_seed, bool) or not isinstance(select_lr_on_seed, int)
    ):
        raise ValueError(
            f"cell_stats: select_lr_on_seed must be an int seed or None, got {select_lr_on_seed!r}"
        )
    rows, superseded = newest_runs(rows)
    cells: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        cells[json.dumps(r["cell"], sort_keys=True)].append(r)
    out = []
    for key, group in cells.items():
        by_tuned: dict[str, list[dict]] = defaultdict(list)
        for r in group:
            by_tuned[json.dumps(r["tuned"], sort_keys=True)].append(r)

        def loss(r):
            v = _value(r, "val_loss")
            return math.inf if v is None else v

        selection_value, no_selection = None, None
        if select_lr_on_seed is not None:
            held = [r for r in group if _seed(r) == select_lr_on_seed and r["status"] == "done"]
            if held:
                pick = max(held, key=lambda r: (_score(r, metric), -loss(r)))
                chosen = by_tuned[json.dumps(pick["tuned"], sort_keys=True)]
                reported = [r for r in chosen if _seed(r) != select_lr_on_seed]
                selection_value = _value(pick, metric)
                tuned = pick["tuned"]
            else:  # no done run of the held-out seed here (yet): nothing may be reported
                reported, tuned = [], {}
                no_selection = f"no done run of seed {select_lr_on_seed}"
        else:

            def rank(rs):
                fin = [r for r in rs if r["status"] != "failed"]
                done = [r for r in fin if r["status"] == "done"]
                scores = [_score(r, metric) for r in done]
                return (
                    len(done) / len(fin) if fin else -1.0,
                    _mean(scores, -math.inf),
                    -_mean([loss(r) for r in done], math.inf),
                )

            chosen = max(by_tuned.values(), key=rank)
            reported, tuned = chosen, chosen[0]["tuned"]
        reported = sorted((r for r in reported if r["status"] != "failed"), key=_seed)
        done = [r for r in reported if _value(r, metric) is not None]
        values = [_value(r, metric) for r in done]
        stats = mean_interval(values, confidence)
        lengths: dict[int, list[float]] = defaultdict(list)
        at_length: dict[int, dict] = defaultdict(lambda: {"seeds": [], "values": []})
        for r in done:
            for L, v in _lengths(r, metric).items():
                lengths[L].append(v)
                at_length[L]["seeds"].append(_seed(r))
                at_length[L]["values"].append(v)
        rep = (done or reported or group)[0]
        out.append(
            {
                "label": rep["label"],
                "model": rep["model"],
                "cell": rep["cell"],
                "tuned": tuned,
                "selected_on_seed": select_lr_on_seed,
                "selection_value": selection_value,
                "seeds": [_seed(r) for r in done],
                "values": values,
                **stats,
                "confidence": confidence,
                "metric": metric,
                "threshold": threshold,
                "n_reached": None
                if threshold is None
                else sum(_reached(v, threshold, metric) for v in values),
                "plateau": [_plateau(r, metric, threshold) for r in done],
                "budget_steps": max((int(r["config"].get("steps", 0)) for r in reported), default=None),
                "n_finished": len(reported),
                "n_diverged": sum(r["status"] == "diverged" for r in reported),
                "diverged_seeds": [_seed(r) for r in reported if r["status"] == "diverged"],
                "lengths": {L: mean_interval(v, confidence) for L, v in sorted(lengths.items())},
                "at_length": dict(sorted(at_length.items())),  # per seed, for claims per test length
                "state_size_bytes": rep["state_size_bytes"],
                "n_params": rep["n_params"],
                "seq_len": int(rep["config"].get("seq_len", 0)),
                "status": _cell_status(done, reported, group, no_selection, select_lr_on_seed, tuned),
                "n_runs": len(group),
                "n_failed": sum(r["status"] != "done" for r in group),
                "cell_wall_time_s": sum(r["wall_time_s"] or 0.0 for r in group),
                "n_superseded": superseded.get(key, 0),
            }
        )
    return out


def _cell_status(done, reported, group, no_selection, select, tuned) -> str:
    """What a cell's metric column says when no reported run measured the metric."""
    if done:
        return "done"
    if no_selection:
        return no_selection
    if reported:
        return reported[0]["status"]  # e.g. every reported seed diverged
    if select is not None:  # seed S chose, and no other seed has finished there yet
        at = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in tuned.items())
        return f"no other seed finished{' at ' + at if at else ''}"
    return group[0]["status"]


def newest_runs(rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """One run per (cell, tuned values, seed): the newest (``rows`` in database order). Two runs
    there have different configurations — the sweep file changed something every run shares
    (e.g. ``base.steps``) under the same name — and pooling them would count two settings as two
    seeds. Of the rest, a cell keeps only the runs of its newest run's setting (:func:`_setting`):
    after such an edit, the other seeds' runs of the earlier version would otherwise be reported at
    the rate the new version's held-out seed chose, one mean over two configurations. Returns the
    kept rows and, per cell key, how many runs were left out."""
    newest: dict[tuple, dict] = {}
    superseded: dict[str, int] = defaultdict(int)
    latest: dict[str, str] = {}  # cell -> the setting of its newest run
    for r in rows:
        cell = json.dumps(r["cell"], sort_keys=True)
        k = (cell, json.dumps(r["tuned"], sort_keys=True), _seed(r))
        if k in newest:
            superseded[cell] += 1
        newest[k] = r
        latest[cell] = _setting(r)
    kept = []
    for (cell, _, _), r in newest.items():
        if _setting(r) == latest[cell]:
            kept.append(r)
        else:
            superseded[cell] += 1
    return kept, dict(superseded)


def _setting(row: dict) -> str:
    """A run's configuration without what varies inside one version of a sweep's cell: its seed,
    its tuned values (dotted grid keys) and ``init_from`` (which may name the seed)."""
    cfg = json.loads(json.dumps(row.get("config") or {}, default=str))
    cfg.pop("seed", None)
    cfg.pop("init_from", None)
    for key in row.get("tuned") or {}:
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return json.dumps(cfg, sort_keys=True)


def _axes(rows: list[dict]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        for k in r["cell"]:
            if k != "label" and k not in keys:
                keys.append(k)
    return keys


def _axis_key(v) -> tuple:
    """A grid axis value's place in tables, panels and claims: numbers by value (64 before 128,
    which as text sort the other way), before everything else, which sorts as its text."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v, "") if v == v else (0, math.inf, "nan")
    return (1, 0, str(v))


def _cell_key(cell: dict, axes: list[str]) -> list[tuple]:
    """The order of a cell (its ``cell`` mapping) by its values of ``axes`` (:func:`_axis_key`)."""
    return [_axis_key(cell.get(a)) for a in axes]


def _plateau(row: dict, metric: str, threshold) -> bool | None:
    """:func:`~mnemo.sweep.recipe.left_plateau` of a run's curve; ``None`` (not judged) for a run
    that starts from another run's weights (``init_from``: fine-tuning), which has no initial
    plateau to leave — its first evaluation may already sit near the ceiling, where no curve can
    rise by the rule's margin."""
    if row["config"].get("init_from"):
        return None
    return left_plateau(row["metrics"].get("curve"), metric, threshold)


def _length_metric(metric: str) -> str:
    """The accuracy measured per test length for a sweep on ``metric``: the metric itself when it
    is an accuracy (``val_seq_acc``: exact match at every length), else ``val_acc``."""
    return metric if metric in FRACTION_METRICS else "val_acc"


def _lengths(row: dict, metric: str = "val_acc") -> dict[int, float]:
    """``{test length: accuracy}`` including the training length (:func:`_length_metric`)."""
    m, name = row["metrics"], _length_metric(metric)
    out = {}
    if _finite(m.get(name)):
        out[int(row["config"].get("seq_len", 0))] = m[name]
    for k, v in m.items():
        hit = _LEN_KEY.match(k)
        if hit and hit.group(1) == name and _finite(v):
            out[int(hit.group(2))] = v
    return dict(sorted(out.items()))


def _finite(v) -> bool:
    """A finite number (not a bool): a NaN accuracy at a length is no measurement (:func:`_value`)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v, digits=4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _axis(v) -> str:
    """A grid axis value as the table shows it: a float in ``g`` format, as the tuned values (4 fixed
    decimals printed 1e-5 and 2e-5 both as 0.0000: two cells under one label)."""
    return f"{v:g}" if isinstance(v, float) else _fmt(v)


def _bytes(n) -> str:
    if n is None:
        return "–"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _interval(st: dict, digits: int = 4) -> str:
    if not st.get("n"):
        return "–"
    if st["n"] == 1:
        return "n=1"
    return f"[{st['low']:.{digits}f}, {st['high']:.{digits}f}]"


def _mean_pm(st: dict | None, digits: int = 4) -> str:
    if not st or not st.get("n"):
        return "–"
    if st["n"] == 1:
        return f"{st['mean']:.{digits}f}"
    return f"{st['mean']:.{digits}f} ± {st['half_width']:.{digits}f}"


def markdown_table(
    rows: list[dict],
    metric: str = "val_acc",
    *,
    threshold: float | None = None,
    select_lr_on_seed: int | None = None,
    confidence: float = 0.95,
) -> str:
    """:func:`cell_stats` as a GitHub markdown table (sorted by axes, numbers by value, then state size): per
    cell the chosen tuned values, state bytes, parameters, the mean ``metric`` over the reported seeds, its
    confidence interval (``n=1``: none), ``n``, the runs that reached ``threshold`` (``k/N``), the mean ±
    half-width at every further test length, all runs of the cell and their wall time. An accuracy's interval
    that reaches past [0, 1] is marked ``†`` and explained under the table."""
    stats = cell_stats(
        rows, metric, threshold=threshold, select_lr_on_seed=select_lr_on_seed, confidence=confidence
    )
    axes = _axes(stats)
    tuned_keys = sorted({k for r in stats for k in r["tuned"]})
    # every length some cell was tested at beyond its own training length (not minus the others':
    # a cell trained at 128 must not hide the 128-token test of a cell trained at 64)
    lengths = sorted({L for r in stats for L in r["lengths"] if L != r["seq_len"]})
    thr = stats[0]["threshold"] if stats else threshold
    chosen = (
        (lambda k: f"{k} (seed {select_lr_on_seed})")
        if select_lr_on_seed is not None
        else (lambda k: f"best {k}")
    )
    header = (
        ["model", *axes, *(chosen(k) for k in tuned_keys), "state", "params", metric]
        + [f"{confidence:.0%} CI", "n"]
        + (
            [f"≥ {thr:g}" if METRICS_HIGHER_IS_BETTER.get(metric, True) else f"≤ {thr:g}"]
            if thr is not None
            else []
        )
        + [f"{_length_metric(metric).removeprefix('val_')}@{L}" for L in lengths]
        + ["runs", "wall (s)"]
    )
    stats.sort(key=lambda r: (_cell_key(r["cell"], axes), r["state_size_bytes"] or 0, r["label"]))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    outside = False  # an accuracy's interval that reaches past [0, 1] (marked, not clipped)
    for r in stats:
        # every reported run that is not in the mean is named: diverged, or done without a finite metric
        blank = r["n_finished"] - r["n_diverged"] - (r["n"] or 0)
        notes = [f"{r['n_diverged']} diverged"] * bool(r["n_diverged"]) + [f"{blank} without {metric}"] * (
            blank > 0
        )
        n = f"{r['n']}" + (f" ({', '.join(notes)})" if notes else "")
        past = metric in FRACTION_METRICS and (r.get("n") or 0) >= 2 and (r["low"] < 0 or r["high"] > 1)
        outside |= past
        cells = (
            [r["label"], *(_axis(r["cell"].get(a)) for a in axes)]
            + [
                f"{r['tuned'][k]:g}" if isinstance(r["tuned"].get(k), float) else _fmt(r["tuned"].get(k), 6)
                for k in tuned_keys
            ]
            + [_bytes(r["state_size_bytes"]), _fmt(r["n_params"])]
            + [_fmt(r["mean"]) if r["n"] else r["status"], _interval(r) + (" †" if past else ""), n]
            + ([f"{r['n_reached']}/{r['n_finished']}"] if thr is not None else [])
            + [_mean_pm(r["lengths"].get(L)) for L in lengths]
            + [
                f"{r['n_runs']}" + (f" ({r['n_failed']} failed/diverged)" if r["n_failed"] else ""),
                f"{r['cell_wall_time_s']:.0f}",
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    if outside:
        lines += [
            "",
            f"† the Student-t interval reaches outside [0, 1], where {metric} lives: the seeds disagree "
            "(reported as computed, not clipped; see mnemo.sweep.stats).",
        ]
    return "\n".join(lines)


#: metrics that are fractions in [0, 1] (their intervals are marked when they reach past it)
FRACTION_METRICS = ("val_acc", "val_seq_acc")


def _groups(best: list[dict], along_line: str | None = None) -> dict[str, list[dict]]:
    """One panel per setting of the grid axes, except axes starting with ``along_line`` (those
    vary along each line of the panel instead)."""
    axes = [a for a in _axes(best) if not (along_line and a.startswith(along_line))]
    groups: dict[str, list[dict]] = defaultdict(list)
    order: dict[str, list] = {}
    for r in best:
        name = ", ".join(f"{a.split('.')[-1]}={r['cell'].get(a)}" for a in axes) or "all runs"
        groups[name].append(r)
        order[name] = _cell_key(r["cell"], axes)
    return {name: groups[name] for name in sorted(groups, key=lambda n: (order[n], n))}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("mnemo report needs matplotlib for its plots: pip install 'mnemo[plot]'") from e
    return plt


def _yerr(sts: list[dict]) -> list[float]:
    """Half-widths for ``errorbar`` (0 where ``n = 1``: no interval)."""
    return [st["half_width"] if st.get("half_width") is not None else 0.0 for st in sts]


def plot_accuracy_vs_state(
    rows: list[dict],
    path: str | Path,
    metric: str = "val_acc",
    title: str = "",
    *,
    select_lr_on_seed: int | None = None,
    confidence: float = 0.95,
    return_figure: bool = False,
    stats: list[dict] | None = None,
):
    """Mean ``metric`` over seeds (:func:`cell_stats`) vs decoding-state bytes per sequence, with the
    confidence interval as error bars and each reported seed as a faint dot, one line per model
    entry (its label: a sweep's variants of one registry model get a line each) through its model
    sizes (``model_overrides.*`` grid axes such as ``d_model``), one panel per setting of the other
    grid axes (the Zoology / Based recall–memory plot). Cells without a finished run are left out.
    ``stats``: the cells' statistics already computed (e.g. a report's kept ``SWEEP.json``
    ``"cells"``, :func:`replot_state_from_summary`); ``rows`` are then not read.
    Returns the path, or ``(path, figure)`` with ``return_figure`` (then the caller closes it)."""
    plt = _pyplot()
    if stats is None:
        stats = cell_stats(rows, metric, select_lr_on_seed=select_lr_on_seed, confidence=confidence)
    groups = _groups(stats, along_line="model_overrides.")
    fig, axs = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, (name, group) in zip(axs[0], groups.items()):
        by_model: dict[str, list[dict]] = defaultdict(list)
        for r in group:
            by_model[r["label"]].append(r)
        for model, rs in sorted(by_model.items()):
            rs = sorted(
                (r for r in rs if r["state_size_bytes"] and r["n"]), key=lambda r: r["state_size_bytes"]
            )
            bars = ax.errorbar(
                [r["state_size_bytes"] for r in rs],
                [r["mean"] for r in rs],
                yerr=_yerr(rs),
                marker="o",
                capsize=3,
                label=model,
            )
            seeds = [(r["state_size_bytes"], v) for r in rs for v in r["values"]]
            if seeds:  # each seed as a faint dot: a bimodal cell shows as two clusters, not one bar
                x, y = zip(*seeds)
                ax.scatter(x, y, s=12, alpha=0.35, color=bars[0].get_color(), linewidths=0, zorder=1)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # decade labels only: minor ones overlap
        sizes = sorted({r["state_size_bytes"] for r in group if r["state_size_bytes"] and r["n"]})
        if sizes and math.floor(math.log10(sizes[0])) == math.floor(math.log10(sizes[-1])):
            # every size inside one decade: no decade tick would show, so label the sizes themselves
            ax.set_xticks(sizes, [f"{v:,}" for v in sizes])
        _panel(ax, name, "decoding state per sequence (bytes)", metric, fraction=metric in FRACTION_METRICS)
    return _save(plt, fig, path, title, return_figure)


def state_plot_title(name: str, metric: str, seeds: list, confidence: float) -> str:
    """The title :func:`write_report` gives sweep ``name``'s state plot."""
    bars = f" (mean over seeds, bars: {confidence:.0%} CI)" if len(seeds) > 1 else ""
    return f"{name}: {'recall' if metric in FRACTION_METRICS else metric} vs state size{bars}"


def replot_state_from_summary(summary_path: str | Path, path: str | Path) -> Path:
    """Redraw a report's state plot (``SWEEP_acc_vs_state.png``) from its kept ``SWEEP.json``: the
    same cells, means, intervals and seeds :func:`write_report` drew from the database (for a page
    whose databases are not at hand)."""
    summary = loads_record(Path(summary_path).read_text())
    metric, confidence, seeds = summary["metric"], summary["confidence"], summary["seeds"]
    title = state_plot_title(summary["sweep"], metric, seeds, confidence)
    return plot_accuracy_vs_state([], path, metric, title, confidence=confidence, stats=summary["cells"])


def plot_accuracy_vs_length(
    rows: list[dict],
    path: str | Path,
    metric: str = "val_acc",
    title: str = "",
    *,
    select_lr_on_seed: int | None = None,
    confidence: float = 0.95,
    return_figure: bool = False,
):
    """Mean accuracy over seeds vs test length (training length and every ``eval_lengths``) at each
    cell's chosen learning rate, with confidence intervals as error bars, one line per model label,
    one panel per setting of the other grid axes. Returns as :func:`plot_accuracy_vs_state`."""
    plt = _pyplot()
    stats = cell_stats(rows, metric, select_lr_on_seed=select_lr_on_seed, confidence=confidence)
    groups = _groups(stats)
    fig, axs = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, (name, group) in zip(axs[0], groups.items()):
        for r in sorted(group, key=lambda r: r["label"]):
            accs = r["lengths"]
            if not accs:
                continue
            sts = list(accs.values())
            ax.errorbar(
                list(accs),
                [st["mean"] for st in sts],
                yerr=_yerr(sts),
                marker="o",
                capsize=3,
                label=r["label"],
            )
            ax.axvline(r["seq_len"], color="grey", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        _panel(ax, name, "test sequence length (dotted: training length)", "accuracy")
    return _save(plt, fig, path, title, return_figure)


def _panel(ax, name: str, xlabel: str, ylabel: str, fraction: bool = True) -> None:
    """Labels, grid and legend of one panel, and the accuracy range [0, 1] when the values are
    fractions (``fraction``); a loss keeps matplotlib's range (in [0, 1] its nats were off the
    chart: an empty figure)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if fraction:
        ax.set_ylim(-0.02, 1.02)
    ax.set_title(name, fontsize=9)
    ax.grid(alpha=0.3)
    legend(ax, fontsize=8)


def _save(plt, fig, path: str | Path, title: str, return_figure: bool = False):
    if title:  # wrapped to the figure's width (about 11 characters per inch at this size)
        width = max(20, int(fig.get_figwidth() * 11))
        fig.suptitle(textwrap.fill(title, width), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    if return_figure:
        return path, fig
    plt.close(fig)
    return path


def _selection_note(select: int | None, seeds: list[int], metric: str, tuned: bool = True) -> str:
    if not tuned:
        if select is not None:  # nothing to choose, but seed S is still held out of the statistics
            return (
                f"one setting per cell (nothing tuned); held-out seed {select} is never reported, "
                "every other run of a cell is"
            )
        return "one setting per cell (nothing tuned): every run of a cell is reported"
    if select is not None:
        return (
            f"learning rate (tuned values) per cell chosen by `{metric}` of held-out seed {select} "
            "alone; the statistics use the other seeds at that learning rate, never seed "
            f"{select}"
        )
    if len(seeds) > 1:
        return (
            f"learning rate per cell chosen by the mean `{metric}` over the same seeds that are "
            "reported (not held out: optimistic; set `select_lr_on_seed` in the sweep file)"
        )
    return f"best run per cell by `{metric}`"


def _tuned(rows: list[dict]) -> bool:
    """Whether some cell holds runs at more than one tuned value (a learning rate to choose)."""
    values: dict[str, set] = defaultdict(set)
    for r in rows:
        values[json.dumps(r["cell"], sort_keys=True, default=str)].add(json.dumps(r["tuned"], sort_keys=True))
    return any(len(v) > 1 for v in values.values())


def judge_claims_at_lengths(
    claims: list[dict], cells: list[dict], metric: str, threshold, confidence=0.95
) -> list[dict]:
    """:func:`judge_claims` once per test length longer than the training length, on the cells'
    per-seed accuracy there (``at_length``, :func:`_length_metric`); each entry's claim names the
    length and carries ``length``. The plateau flags are the training metric's. ``threshold`` is
    the metric's; when the accuracy at length is another metric (a ``val_loss`` report), its own
    :func:`default_threshold` is the ceiling instead. Empty when no accuracy was measured at a
    longer length."""
    if _length_metric(metric) != metric:  # a loss threshold says nothing about an accuracy
        threshold = default_threshold(_length_metric(metric))
    lengths = sorted({L for c in cells for L in c.get("at_length", {}) if L != c["seq_len"]})
    out = []
    for L in lengths:
        at = [
            {**c, **c["at_length"][L], "plateau": _plateau_at(c, c["at_length"][L]["seeds"])}
            for c in cells
            if L in c.get("at_length", {})
        ]
        for j in judge_claims(claims, at, _length_metric(metric), threshold, confidence):
            out.append({**j, "claim": f"{j['claim']} (at {L} tokens)", "length": L})
    return out


def _plateau_at(cell: dict, seeds: list) -> list:
    by_seed = dict(zip(cell["seeds"], cell.get("plateau") or [None] * len(cell["seeds"])))
    return [by_seed.get(s) for s in seeds]


def judge_claims(
    claims: list[dict], cells: list[dict], metric: str, threshold, confidence=0.95
) -> list[dict]:
    """Each claim (``{"name", "better", "than"}``, labels) judged in every pair of cells that
    differ only in the label (:func:`~mnemo.sweep.recipe.judge_claim`); the entry gets ``cell``
    (the shared grid values). A claim whose labels share no such pair is not testable here."""
    axes = _axes(cells)
    cells = sorted(cells, key=lambda c: _cell_key(c["cell"], axes))  # as the table orders them
    out = []
    for claim in claims:
        found = False
        for a in cells:
            if a["label"] != claim["better"]:
                continue
            where = {k: v for k, v in a["cell"].items() if k != "label"}
            for b in cells:
                if (
                    b["label"] == claim["than"]
                    and {k: v for k, v in b["cell"].items() if k != "label"} == where
                ):
                    found = True
                    j = judge_claim(claim, a, b, metric=metric, threshold=threshold, confidence=confidence)
                    if where:
                        j["claim"] += " (" + ", ".join(f"{k}={v}" for k, v in where.items()) + ")"
                    out.append({**j, "cell": where})
        if not found:
            out.append(
                {
                    "claim": claim["name"],
                    "better": claim["better"],
                    "than": claim["than"],
                    "metric": metric,
                    "seeds": [],
                    "differences": [],
                    "n": 0,
                    "mean": None,
                    "low": None,
                    "high": None,
                    "confidence": confidence,
                    "cell": None,
                    "verdict": "not testable here",
                    "why": "no cell of the one model matches a cell of the other",
                }
            )
    return out


def report_metric(meta: dict, metric: str | None) -> str:
    """The metric a report of a sweep uses: ``metric`` if given, else the sweep file's (its stored
    ``meta``), else ``val_acc``."""
    return metric or meta.get("metric") or "val_acc"


def write_report(
    db_path: str | Path,
    out_dir: str | Path | None = None,
    *,
    sweep: str | None = None,
    metric: str | None = None,
    plots: bool = True,
    threshold: float | None = None,
    select_lr_on_seed: int | None = None,
    confidence: float = 0.95,
    run_ids: set[str] | None = None,
    meta: dict | None = None,
) -> dict:
    """Write ``SWEEP.md`` (the :func:`markdown_table`), ``SWEEP.json`` (the :func:`cell_stats`)
    and (with ``plots``) ``SWEEP_acc_vs_state.png`` and ``SWEEP_acc_vs_length.png`` (means with
    confidence-interval error bars) for each sweep in the database (or just ``sweep``).

    ``metric`` defaults to each sweep file's ``metric`` (stored in the database; ``val_acc`` for a
    database without it). ``out_dir`` defaults to ``<db stem>_report/`` next to the database.
    ``threshold`` defaults to
    :func:`default_threshold` of ``metric`` (0.99 for accuracies); ``select_lr_on_seed`` defaults
    to the sweep file's (stored in the database by :func:`~mnemo.sweep.run_sweep`). ``run_ids``
    keeps only those runs (the runs a sweep file defines now: :func:`mnemo.sweep.reproduce_page`
    leaves out the runs of an earlier version of the file, or of another file with the same name).
    ``meta`` (with ``sweep``): the sweep file's settings as it reads now (:meth:`SweepSpec.meta`:
    claims, seeds, held-out seed, ...), used instead of those the database stored when the sweep last
    ran (:func:`mnemo.sweep.reproduce_page` without running: a claim added to the file since is
    judged). Returns ``{sweep: {"markdown": text, "cells": cell_stats, "files": [paths]}}``.

    Raises:
        FileNotFoundError: the database does not exist. ValueError: it holds no (such) sweep, or
        ``threshold`` / ``select_lr_on_seed`` is malformed (see :func:`cell_stats`), or
        ``select_lr_on_seed`` is a seed that no run of the database has, or no finished run of a
        sweep measured ``metric`` (e.g. ``val_acc`` asked of a text sweep), or ``meta`` is given
        without ``sweep``.
    """
    if meta is not None and sweep is None:
        raise ValueError("write_report: meta (a sweep file's settings) needs sweep (the sweep it belongs to)")
    db_path = Path(db_path)
    with SweepDB(db_path, create=False) as db:
        names = db.sweeps()
        if sweep is not None:
            if sweep not in names:
                raise ValueError(f"sweep {sweep!r} is not in {db_path} (it holds: {names or 'no runs'})")
            names = [sweep]
        if not names:
            raise ValueError(f"{db_path} holds no runs yet (run `mnemo sweep CONFIG` first)")
        all_rows = {n: [r for r in db.rows(n) if run_ids is None or r["run_id"] in run_ids] for n in names}
        metas = {n: db.meta(n) for n in names}
    if meta is not None:
        metas[sweep] = {**metas[sweep], **meta}
    if select_lr_on_seed is not None:  # a seed given by hand must be one the sweeps ran
        ran = sorted({_seed(r) for rows in all_rows.values() for r in rows})
        if select_lr_on_seed not in ran:
            raise ValueError(
                f"select_lr_on_seed (--select-lr-on-seed): seed {select_lr_on_seed} has no run in {db_path} "
                f"(its seeds: {', '.join(map(str, ran))}); nothing could be selected on it"
            )
    metrics = {n: report_metric(metas[n], metric) for n in names}
    for name, rows in all_rows.items():  # before anything is written: a table of blanks is no report
        m = metrics[name]
        done = [r for r in rows if r["status"] == "done"]
        if done and not any(m in (r["metrics"] or {}) for r in done):
            have = sorted(
                {k for r in done for k in (r["metrics"] or {}) if k.startswith("val_")} - {"val_tokens"}
            )
            given = "--metric" if metric is not None else "the sweep file's metric"
            raise ValueError(
                f"metric {m!r} ({given}): no finished run of sweep {name!r} in {db_path} measured it (they "
                f"measured: {', '.join(have) or 'nothing'}); the sweep file's metric is "
                f"{metas[name].get('metric', 'not stored')!r}"
            )
    out = Path(out_dir) if out_dir else db_path.with_name(db_path.stem + "_report")
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name, rows in all_rows.items():
        metric = metrics[name]
        select = select_lr_on_seed if select_lr_on_seed is not None else metas[name].get("select_lr_on_seed")
        kw = {"select_lr_on_seed": select, "confidence": confidence}
        cells = cell_stats(rows, metric, threshold=threshold, **kw)
        old_runs = sum(c["n_superseded"] for c in cells)
        if old_runs:
            warnings.warn(
                f"sweep {name!r} in {db_path}: {old_runs} run(s) of an earlier version of the sweep file "
                "(same cell, another configuration) are left out; the report uses the runs of each cell's "
                "newest configuration (give a changed sweep a new name to keep both)",
                stacklevel=2,
            )
        thr = cells[0]["threshold"] if cells else threshold
        seeds = sorted({_seed(r) for r in rows})
        n_done = sum(r["status"] == "done" for r in rows)
        total_wall = sum(r["wall_time_s"] or 0.0 for r in rows)
        thr_note = (
            f"; `{'≥' if METRICS_HIGHER_IS_BETTER.get(metric, True) else '≤'} {thr:g}`: runs at that "
            "learning rate (done or diverged) whose metric reached it"
            if thr is not None
            else ""
        )
        text = (
            f"## sweep `{name}`\n\n{len(rows)} runs ({n_done} done"
            + (f"; {old_runs} of an earlier version of the sweep file, left out" if old_runs else "")
            + f") over seeds {seeds}, total wall "
            f"time {total_wall / 60:.1f} min; {_selection_note(select, seeds, metric, _tuned(rows))}. "
            f"`{metric}`: mean over the reported seeds that finished training; `{confidence:.0%} CI`: "
            f"Student-t interval of that mean (mean ± t·s/√n, none for n=1); n: seeds in the mean"
            f"{thr_note}; {_length_metric(metric).removeprefix('val_')}@L: mean ± half-width. State = "
            "decoding state per sequence at the "
            "training length (KV cache for attention).\n\n"
            + markdown_table(rows, metric, threshold=threshold, **kw)
            + "\n"
        )
        planned = metas[name].get("seeds")  # the sweep file's seeds (stored by run_sweep)
        if planned and cells:
            per_cell = len([s for s in planned if s != select])
            short = [c for c in cells if c["n_finished"] < per_cell]
            if short:
                text += (
                    f"\n**Partial:** {', '.join(sorted({c['label'] for c in short}))}: fewer than the "
                    f"{per_cell} seed(s) the sweep file reports per cell have finished; `mnemo sweep "
                    "CONFIG --list` shows what is left, and running the sweep again finishes it.\n"
                )
        judged = judge_claims(metas[name].get("claims") or [], cells, metric, thr, confidence)
        if judged:
            text += (
                f"\n### claims\n\nEach claim on `{metric}`, per cell, on the seeds both models report "
                f"(paired: the difference per seed, then its {confidence:.0%} Student-t interval; "
                "positive favours `better`). *not testable here*: fewer than 3 paired seeds, a run "
                "still on its initial plateau, or both at the ceiling.\n\n" + claims_markdown(judged)
            )
        longer = judge_claims_at_lengths(metas[name].get("claims") or [], cells, metric, thr, confidence)
        if longer:
            text += (
                f"\n\nThe same claims on `{_length_metric(metric)}` at each longer test length "
                "(`eval_lengths`, through the same runs at the learning rate chosen above):\n\n"
                + claims_markdown(longer)
            )
        files = [out / f"{name}.md", out / f"{name}.json"]
        files[0].write_text(text)
        summary = {
            "sweep": name,
            "metric": metric,
            "interval": "student-t",
            "confidence": confidence,
            "threshold": thr,
            "select_lr_on_seed": select,
            "seeds": seeds,
            "cells": cells,
            "recipe": metas[name].get("recipe"),
            "claims": judged,
            "claims_at_lengths": longer,
        }
        # strict JSON: a non-finite value is null, mapped under "nonfinite" (mnemo.train.sinks)
        strict = json.loads(dumps_record(summary))
        files[1].write_text(json.dumps(strict, indent=1, allow_nan=False) + "\n")
        if plots:
            bars = f" (mean over seeds, bars: {confidence:.0%} CI)" if len(seeds) > 1 else ""
            files.append(
                plot_accuracy_vs_state(
                    rows,
                    out / f"{name}_acc_vs_state.png",
                    metric,
                    state_plot_title(name, metric, seeds, confidence),
                    **kw,
                )
            )
            if any(len(c["lengths"]) > 1 for c in cells):  # only when eval_lengths ran
                files.append(
                    plot_accuracy_vs_length(
                        rows,
                        out / f"{name}_acc_vs_length.png",
                        metric,
                        f"{name}: recall vs test length{bars}",
                        **kw,
                    )
                )
        result[name] = {"markdown": text, "cells": cells, "files": files}
    return result
