"""The per-seed MQAR table of docs/results/zoology_fig2.md from one sweep database.

    python scripts/fig2_table.py runs/sweeps/zoology_fig2_t64_v8192_e2.sqlite

Prints one markdown row per model, ordered by decoding-state size: the state in bytes, the mean
``val_acc`` over seeds with its 95% Student-t interval (as ``mnemo report`` computes it), the number
of seeds, how many reached the early-stop threshold (0.99), and each seed's final ``val_acc`` with the
step of its last evaluation (a run that stopped before the step budget reached the threshold there).
"""

import argparse
import json
from pathlib import Path

from mnemo.sweep.db import SweepDB
from mnemo.sweep.report import cell_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db", type=Path, help="a sweep database (.sqlite)")
    args = ap.parse_args()
    if not args.db.exists():
        ap.error(f"db: no such file {args.db}")
    with SweepDB(args.db, create=False) as d:
        rows = d.rows()
    steps = {}
    for r in rows:
        if r["status"] == "done" and r.get("metrics"):
            m = r["metrics"] if isinstance(r["metrics"], dict) else json.loads(r["metrics"])
            steps[(r["label"], r["seed"])] = m.get("step")
    print("| model | state (bytes) | val_acc mean | 95% interval | n | ≥ 0.99 | per seed (step) |")
    print("|---|---|---|---|---|---|---|")
    for s in sorted(cell_stats(rows, "val_acc"), key=lambda s: (s["state_size_bytes"] or 0, s["label"])):
        if not s["n"]:
            continue
        interval = "—" if s["low"] is None else f"[{s['low']:.4f}, {s['high']:.4f}]"
        per_seed = ", ".join(
            f"{v:.4f} ({steps.get((s['label'], seed))})" for seed, v in zip(s["seeds"], s["values"])
        )
        print(
            f"| {s['label']} | {s['state_size_bytes']:,} | {s['mean']:.4f} | {interval} | {s['n']} "
            f"| {s['n_reached']}/{s['n_finished']} | {per_seed} |"
        )


if __name__ == "__main__":
    main()
