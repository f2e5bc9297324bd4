"""Tables and learning curves of the Titans ablation sweep (configs/titans_ablation.yaml).

Reads the sweep database and the run directories; prints, per variant, the mean and 95% Student-t
interval over seeds of the final ``val_acc`` and ``val_loss``, then the paired differences to
``full`` (a seed fixes the initial weights, the training batches and the test set, so the variant
and ``full`` of one seed saw the same data); with ``--plot`` it also writes the mean validation
curves (every ``eval_interval`` steps) of each variant.

    python scripts/titans_ablation.py runs/sweeps/titans_ablation.sqlite \\
        --plot docs/results/titans_ablation/curves.png
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from mnemo.sweep.db import SweepDB
from mnemo.sweep.stats import mean_interval
from mnemo.train.sinks import loads_record

ORDER = ["full", "linear_memory", "no_convolution", "no_momentum", "no_weight_decay", "no_persistent_memory"]


def _fmt(m: dict) -> str:
    if m.get("half_width") is None:
        return f"{m['mean']:.3f} (one seed)"
    return f"{m['mean']:.3f} ± {m['half_width']:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db")
    ap.add_argument("--sweep", default="titans_ablation")
    ap.add_argument("--runs", help="run directories (default: runs/sweeps/SWEEP next to DB)")
    ap.add_argument("--seeds", help="only these seeds, e.g. 0,1,2")
    ap.add_argument("--plot", help="write the mean validation curves to this PNG")
    args = ap.parse_args()
    seeds = {int(s) for s in args.seeds.split(",")} if args.seeds else None
    rows = [
        r
        for r in SweepDB(args.db, create=False).rows(args.sweep)
        if r["status"] == "done" and (seeds is None or r["seed"] in seeds)
    ]
    final: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        final[r["label"]][r["seed"]] = r["metrics"]
    labels = [x for x in ORDER if x in final] + sorted(set(final) - set(ORDER))

    print("| variant | n | val_acc (mean ± 95% CI) | per seed | val_loss (mean ± 95% CI) | per seed |")
    print("|---|---|---|---|---|---|")
    for lab in labels:
        d = final[lab]
        acc = [d[s]["val_acc"] for s in sorted(d)]
        loss = [d[s]["val_loss"] for s in sorted(d)]
        print(
            f"| {lab} | {len(d)} | {_fmt(mean_interval(acc))} | {', '.join(f'{x:.3f}' for x in acc)} | "
            f"{_fmt(mean_interval(loss))} | {', '.join(f'{x:.3f}' for x in loss)} |"
        )
    print()
    print("| variant − full (same seeds) | n | Δ val_acc (mean ± 95% CI) | Δ val_loss (mean ± 95% CI) |")
    print("|---|---|---|---|")
    for lab in labels:
        if lab == "full":
            continue
        common = sorted(set(final[lab]) & set(final.get("full", {})))
        if not common:
            continue
        da = [final[lab][s]["val_acc"] - final["full"][s]["val_acc"] for s in common]
        dl = [final[lab][s]["val_loss"] - final["full"][s]["val_loss"] for s in common]
        print(f"| {lab} | {len(common)} | {_fmt(mean_interval(da))} | {_fmt(mean_interval(dl))} |")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        runs_dir = Path(args.runs) if args.runs else Path(args.db).with_suffix("")
        curves: dict[str, list[list[dict]]] = defaultdict(list)
        for r in rows:
            lines = (runs_dir / r["run_id"] / "metrics.jsonl").read_text().splitlines()
            points = [loads_record(line) for line in lines if line.strip()]
            curves[r["label"]].append([p for p in points if "val_acc" in p])
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for lab in labels:
            runs = curves[lab]
            steps = [p["step"] for p in runs[0]]
            for ax, key in zip(axes, ("val_acc", "val_loss")):
                mean = [sum(run[i][key] for run in runs) / len(runs) for i in range(len(steps))]
                ax.plot(steps, mean, marker="o", ms=3, label=f"{lab} (n={len(runs)})")
                ax.set_xlabel("step")
                ax.set_ylabel(key)
                ax.grid(alpha=0.3)
        task = rows[0]["config"].get("task_options", {}) if rows else {}
        n_values = task.get("vocab_size", 32) // 2
        axes[0].axhline(1 / n_values, color="gray", ls=":", lw=1)
        axes[1].axhline(math.log(n_values), color="gray", ls=":", lw=1)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{args.sweep}: mean over seeds (dotted: chance, 1/{n_values} values)", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=80)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
