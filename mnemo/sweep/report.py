"""Sweep reports: the best run per cell as a markdown table, and the two recall plots
(accuracy vs recurrent state size, accuracy vs test length)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from .db import SweepDB
from .spec import METRICS_HIGHER_IS_BETTER

_LEN_KEY = re.compile(r"^val_acc@(\d+)$")


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


def _axes(rows: list[dict]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        for k in r["cell"]:
            if k != "label" and k not in keys:
                keys.append(k)
    return keys


def _lengths(row: dict) -> dict[int, float]:
    """``{test length: accuracy}`` including the training length."""
    m = row["metrics"]
    out = {}
    if isinstance(m.get("val_acc"), (int, float)):
        out[int(row["config"].get("seq_len", 0))] = m["val_acc"]
    for k, v in m.items():
        hit = _LEN_KEY.match(k)
        if hit and isinstance(v, (int, float)):
            out[int(hit.group(1))] = v
    return dict(sorted(out.items()))


def _fmt(v, digits=4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _bytes(n) -> str:
    if n is None:
        return "–"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def markdown_table(rows: list[dict], metric: str = "val_acc") -> str:
    """The best run of each cell as a GitHub markdown table (sorted by axes, then state size)."""
    best = best_per_cell(rows, metric)
    axes = _axes(best)
    tuned_keys = sorted({k for r in best for k in r["tuned"]})
    lengths = sorted(
        {L for r in best for L in _lengths(r)} - {int(r["config"].get("seq_len", 0)) for r in best}
    )
    header = (
        ["model", *axes, *(f"best {k}" for k in tuned_keys), "state", "params", metric]
        + [f"acc@{L}" for L in lengths]
        + ["runs", "wall (s)"]
    )
    best.sort(key=lambda r: ([str(r["cell"].get(a)) for a in axes], r["state_size_bytes"] or 0, r["label"]))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in best:
        accs = _lengths(r)
        cells = (
            [r["label"], *(_fmt(r["cell"].get(a)) for a in axes)]
            + [
                _fmt(r["tuned"].get(k), 6)
                if not isinstance(r["tuned"].get(k), float)
                else f"{r['tuned'][k]:g}"
                for k in tuned_keys
            ]
            + [_bytes(r["state_size_bytes"]), _fmt(r["n_params"])]
            + [_fmt(r["metrics"].get(metric)) if r["status"] == "done" else r["status"]]
            + [_fmt(accs.get(L)) for L in lengths]
            + [
                f"{r['n_runs']}" + (f" ({r['n_failed']} failed/diverged)" if r["n_failed"] else ""),
                f"{r['cell_wall_time_s']:.0f}",
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _groups(best: list[dict], along_line: str | None = None) -> dict[str, list[dict]]:
    """One panel per setting of the grid axes, except axes starting with ``along_line`` (those
    vary along each line of the panel instead)."""
    axes = [a for a in _axes(best) if not (along_line and a.startswith(along_line))]
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in best:
        name = ", ".join(f"{a.split('.')[-1]}={r['cell'].get(a)}" for a in axes) or "all runs"
        groups[name].append(r)
    return dict(sorted(groups.items()))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("mnemo report needs matplotlib for its plots: pip install 'mnemo[plot]'") from e
    return plt


def plot_accuracy_vs_state(
    rows: list[dict], path: str | Path, metric: str = "val_acc", title: str = ""
) -> Path:
    """Accuracy (best per cell) vs decoding-state bytes per sequence, one line per registry model
    through its model sizes (``model_overrides.*`` grid axes such as ``d_model``), one panel per
    setting of the other grid axes (the Zoology / Based recall–memory plot)."""
    plt = _pyplot()
    groups = _groups(best_per_cell(rows, metric), along_line="model_overrides.")
    fig, axs = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, (name, group) in zip(axs[0], groups.items()):
        by_model: dict[str, list[dict]] = defaultdict(list)
        for r in group:
            by_model[r["model"]].append(r)
        for model, rs in sorted(by_model.items()):
            rs = sorted((r for r in rs if r["state_size_bytes"]), key=lambda r: r["state_size_bytes"])
            xs = [r["state_size_bytes"] for r in rs]
            ys = [r["metrics"].get(metric) if r["status"] == "done" else 0.0 for r in rs]
            ax.plot(xs, ys, marker="o", label=model)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # decade labels only: minor ones overlap
        _panel(ax, name, "decoding state per sequence (bytes)", metric)
    return _save(plt, fig, path, title)


def plot_accuracy_vs_length(
    rows: list[dict], path: str | Path, metric: str = "val_acc", title: str = ""
) -> Path:
    """Accuracy vs test length (training length and every ``eval_lengths``) of each cell's best
    run, one line per model label, one panel per setting of the other grid axes."""
    plt = _pyplot()
    groups = _groups(best_per_cell(rows, metric))
    fig, axs = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.2), squeeze=False)
    for ax, (name, group) in zip(axs[0], groups.items()):
        for r in sorted(group, key=lambda r: r["label"]):
            accs = _lengths(r)
            if not accs:
                continue
            ax.plot(list(accs), list(accs.values()), marker="o", label=r["label"])
            ax.axvline(int(r["config"].get("seq_len", 0)), color="grey", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        _panel(ax, name, "test sequence length (dotted: training length)", "accuracy")
    return _save(plt, fig, path, title)


def _panel(ax, name: str, xlabel: str, ylabel: str) -> None:
    """Labels, accuracy range [0, 1], grid and legend of one panel."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(name, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt, fig, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(
    db_path: str | Path,
    out_dir: str | Path | None = None,
    *,
    sweep: str | None = None,
    metric: str = "val_acc",
    plots: bool = True,
) -> dict:
    """Write ``SWEEP.md`` and (with ``plots``) ``SWEEP_acc_vs_state.png`` and
    ``SWEEP_acc_vs_length.png`` for each sweep in the database (or just ``sweep``).

    ``out_dir`` defaults to ``<db stem>_report/`` next to the database. Returns
    ``{sweep: {"markdown": text, "files": [paths]}}``.

    Raises:
        FileNotFoundError: the database does not exist. ValueError: it holds no (such) sweep.
    """
    db_path = Path(db_path)
    with SweepDB(db_path, create=False) as db:
        names = db.sweeps()
        if sweep is not None:
            if sweep not in names:
                raise ValueError(f"sweep {sweep!r} is not in {db_path} (it holds: {names or 'no runs'})")
            names = [sweep]
        if not names:
            raise ValueError(f"{db_path} holds no runs yet (run `mnemo sweep CONFIG` first)")
        all_rows = {n: db.rows(n) for n in names}
    out = Path(out_dir) if out_dir else db_path.with_name(db_path.stem + "_report")
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name, rows in all_rows.items():
        n_done = sum(r["status"] == "done" for r in rows)
        total_wall = sum(r["wall_time_s"] or 0.0 for r in rows)
        text = (
            f"## sweep `{name}`\n\n{len(rows)} runs ({n_done} done), total wall time "
            f"{total_wall / 60:.1f} min; best run per cell by `{metric}`; state = decoding state per "
            "sequence at the training length (KV cache for attention).\n\n"
            + markdown_table(rows, metric)
            + "\n"
        )
        files = [out / f"{name}.md"]
        files[0].write_text(text)
        if plots:
            files.append(
                plot_accuracy_vs_state(
                    rows, out / f"{name}_acc_vs_state.png", metric, f"{name}: recall vs state size"
                )
            )
            files.append(
                plot_accuracy_vs_length(
                    rows, out / f"{name}_acc_vs_length.png", metric, f"{name}: recall vs test length"
                )
            )
        result[name] = {"markdown": text, "files": files}
    return result
