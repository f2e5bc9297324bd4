"""The loss curves of two runs of the same job side by side: ``--precision fp32`` against
``--precision bf16`` (issue 36, item 4), from their ``metrics.jsonl``.

    python scripts/bf16_vs_fp32.py FP32_RUN BF16_RUN [--out table.txt] [--plot curves.png] [--header LINE ...]

Prints, per evaluation step both runs reached: the train loss (mean over the steps since the
previous evaluation) and the validation loss of each run, their relative differences
``|bf16 − fp32| / fp32``, and each run's throughput; then the largest relative difference.
``--plot`` also draws both curves (needs matplotlib)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mnemo.train.sinks import loads_record


def _records(run: Path) -> dict[int, dict]:
    rows = [loads_record(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "val_loss" in r}


def table(fp32: dict[int, dict], bf16: dict[int, dict]) -> list[str]:
    steps = sorted(set(fp32) & set(bf16))
    head = (
        f"{'step':>5s} {'train fp32':>10s} {'train bf16':>10s} {'rel':>8s} "
        f"{'val fp32':>9s} {'val bf16':>9s} {'rel':>8s} {'tok/s fp32':>10s} {'tok/s bf16':>10s}"
    )
    lines = [head, "-" * len(head)]
    worst = {"train": 0.0, "val": 0.0}
    for s in steps:
        a, b = fp32[s], bf16[s]
        rt = abs(b["train_loss"] - a["train_loss"]) / a["train_loss"]
        rv = abs(b["val_loss"] - a["val_loss"]) / a["val_loss"]
        worst["train"], worst["val"] = max(worst["train"], rt), max(worst["val"], rv)
        lines.append(
            f"{s:5d} {a['train_loss']:10.4f} {b['train_loss']:10.4f} {rt:8.1e} "
            f"{a['val_loss']:9.4f} {b['val_loss']:9.4f} {rv:8.1e} "
            f"{a['tokens_per_s']:10,.0f} {b['tokens_per_s']:10,.0f}"
        )
    lines.append(
        f"largest relative difference over {len(steps)} evaluations: train {worst['train']:.1e}, "
        f"val {worst['val']:.1e}"
    )
    return lines


def plot(fp32: dict[int, dict], bf16: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for recs, name, style in ((fp32, "fp32", "-"), (bf16, "bf16", "--")):
        steps = sorted(recs)
        ax.plot(steps, [recs[s]["train_loss"] for s in steps], style, marker="o", label=f"train {name}")
        ax.plot(steps, [recs[s]["val_loss"] for s in steps], style, marker="s", label=f"val {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/char)")
    ax.set_title("mnemo train: bf16 autocast vs fp32 (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fp32", type=Path)
    ap.add_argument("bf16", type=Path)
    ap.add_argument("--out", type=Path, help="also write the table (after the --header lines) here")
    ap.add_argument("--plot", type=Path, help="draw the curves into this PNG")
    ap.add_argument("--header", action="append", default=[], help="a line written before the table")
    args = ap.parse_args()
    fp32, bf16 = _records(args.fp32), _records(args.bf16)
    lines = table(fp32, bf16)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join([*args.header, *lines]) + "\n")
    if args.plot:
        plot(fp32, bf16, args.plot)


if __name__ == "__main__":
    main()
