"""The needles table (kind x model x test length) and plot from the three needles sweep databases.

    python scripts/needles_table.py docs/results/needles/needles_acc_vs_length.png
    python scripts/needles_table.py --suffix _long --steps --drops \
        docs/results/needles/needles_long_acc_vs_length.png

Reads runs/sweeps/needles_niah{1,2,3}{suffix}.sqlite (configs/needles/*.yaml); prints a markdown table of
the mean value-token accuracy over seeds ± the 95% Student-t half-width at each test length, and the
per-seed accuracies at the training length; writes a one-row plot of the three kinds when a path is
given (thick: mean over seeds, thin: each seed). See docs/results/needles.md."""

import argparse
import json
from pathlib import Path

from mnemo.sweep.db import SweepDB
from mnemo.sweep.report import _lengths, cell_stats
from mnemo.sweep.stats import mean_interval

KINDS = [
    ("niah1", "(i) S-NIAH-1: repeat filler, 5 digits"),
    ("niah2", "(ii) S-NIAH-2: random filler, 5 digits"),
    ("niah3", "(iii) S-NIAH-3: random filler, 8 hex"),
]
ORDER = ["deltanet", "gated_deltanet", "mamba2", "mamba2_d8", "titans_lmm"]


def fmt(st):
    if st is None:
        return "–"
    if st.get("half_width") is None:
        return f"{st['mean']:.3f} (n={st['n']})"
    return f"{st['mean']:.3f} ± {st['half_width']:.3f} (n={st['n']})"


def drop_rows(title: str, rows: list[dict]) -> list[str]:
    """Per model: the paired per-seed drop acc@256 − acc@2048 (mean ± 95% t half-width, n) and each
    seed's (acc@256 → acc@2048). A run that never left the plateau is flat, so its drop is ~0."""
    out = []
    for m in ORDER:
        runs = sorted((r for r in rows if r["label"] == m and r["status"] == "done"), key=lambda r: r["seed"])
        pairs = [(L[256], L[2048]) for L in map(_lengths, runs) if 256 in L and 2048 in L]
        if not pairs:
            continue
        st = mean_interval([a - b for a, b in pairs])
        mean = f"{st['mean']:+.3f}" + ("" if st["half_width"] is None else f" ± {st['half_width']:.3f}")
        seeds = ", ".join(f"{a:.2f}→{b:.2f}" for a, b in pairs)
        out.append(f"| {title} | {m} | {mean} (n={st['n']}) | {seeds} |")
    return out


def main(out_png=None, suffix="", with_steps=False, drops=False):
    rows_out, data, rows_by_kind, drop_out = [], {}, {}, []
    for key, title in KINDS:
        db = Path(f"runs/sweeps/needles_{key}{suffix}.sqlite")
        if not db.exists():
            continue
        with SweepDB(db, create=False) as d:
            rows = d.rows()
        stats = {s["label"]: s for s in cell_stats(rows, "val_acc")}
        steps = {}
        for r in rows:
            if r["status"] == "done" and r.get("metrics"):
                met = r["metrics"] if isinstance(r["metrics"], dict) else json.loads(r["metrics"])
                steps[(r["label"], r["seed"])] = met.get("step")
        data[key] = (title, stats)
        rows_by_kind[title] = rows
        drop_out += drop_rows(title, rows)
        for m in ORDER:
            s = stats.get(m)
            if not s or not s["lengths"]:
                continue
            L = s["lengths"]
            cells = [fmt(L.get(x)) for x in (256, 512, 1024, 2048)]
            per_seed = ", ".join(
                f"{v:.2f}" + (f" @{steps.get((m, seed), '?')}" if with_steps else "")
                for seed, v in zip(s["seeds"], s["values"])
            )
            rows_out.append(f"| {title} | {m} | " + " | ".join(cells) + f" | {per_seed} |")
    if not data:
        raise SystemExit(f"no runs/sweeps/needles_niah{{1,2,3}}{suffix}.sqlite: run its sweeps first")
    seed_col = "1x per seed (@ last step)" if with_steps else "1x per seed"
    print(f"| kind | model | 1x (256) | 2x (512) | 4x (1024) | 8x (2048) | {seed_col} |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows_out))
    if drops:
        print("\n| kind | model | drop 1x − 8x | per seed: 1x → 8x |")
        print("|---|---|---|---|")
        print("\n".join(drop_out))
    if out_png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axs = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.6), squeeze=False, sharey=True)
        for ax, (title, stats) in zip(axs[0], data.values()):
            for i, m in enumerate(ORDER):
                s = stats.get(m)
                if not s or not s["lengths"]:
                    continue
                color = f"C{i}"
                for r in rows_by_kind[title]:
                    if r["label"] == m and r["status"] == "done":
                        acc = _lengths(r)
                        ax.plot(list(acc), list(acc.values()), color=color, alpha=0.35, lw=0.8)
                xs = sorted(s["lengths"])
                ys = [s["lengths"][x]["mean"] for x in xs]
                ax.plot(xs, ys, marker="o", color=color, lw=2, label=f"{m} (n={s['n']})")
            ax.set_xscale("log", base=2)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("test length (trained at 256)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axs[0][0].set_ylabel("value-token accuracy")
        fig.tight_layout()
        fig.savefig(out_png, dpi=90)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("png", nargs="?", help="where to write the plot (none: the table only)")
    ap.add_argument("--suffix", default="", help="database name suffix, e.g. _long for niah*_long.yaml")
    ap.add_argument(
        "--steps", action="store_true", help="add each seed's last step (an early stop shows as < steps)"
    )
    ap.add_argument("--drops", action="store_true", help="add the per-seed 1x − 8x accuracy drops")
    args = ap.parse_args()
    main(args.png, args.suffix, args.steps, args.drops)
