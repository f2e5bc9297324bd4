"""Op rows timed three ways, each in a fresh process: through the ``mnemo`` command (which calls
:func:`mnemo.runtime.tune_malloc` at start-up), from a plain Python process (no process-wide
tuning: what a library user gets), and from a plain Python process that calls ``tune_malloc``
itself. Issue 22 asks the plain-Python rows to be within 15% of the command's.

The three processes of a round run one after the other, the order rotated each round, so a drift
of the machine's speed hits all three alike; each row's number is the median over rounds of the
process's own median (``--repeats`` runs). Prints a table with ``python / cli`` ratios (above 1:
the plain process is slower) and, with ``--json``, writes every process's rows.

    python scripts/bench_python_vs_cli.py --ops gla_scalar,gated_delta_rule,ssd,gla_channel \\
        --lengths 4096 --rounds 3 --repeats 10

Run it on a quiet machine (nothing else heavy beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.bench import write_json

VARIANTS = ("cli", "python", "python+tune")


def _command(variant: str, bench_args: list[str], out: Path) -> list[str]:
    args = [*bench_args, "--json", str(out)]
    if variant == "cli":
        return [sys.executable, "-m", "mnemo", "bench", "--suite", "ops", *args]
    tune = "from mnemo.runtime import tune_malloc; tune_malloc(); " if variant == "python+tune" else ""
    code = (
        f"import sys; {tune}from mnemo.cli import build_parser; from mnemo.bench.ops import main; "
        "sys.exit(main(build_parser().parse_args(['bench', '--suite', 'ops', *sys.argv[1:]])))"
    )
    return [sys.executable, "-c", code, *args]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gla_scalar,gated_delta_rule,ssd,gla_channel")
    p.add_argument("--lengths", default="4096")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    a = p.parse_args(argv)
    if a.json and os.path.exists(a.json) and not a.overwrite:  # refused before the long run, not after
        p.error(f"--json: {a.json} exists; pass --overwrite to replace it")
    bench_args = ["--ops", a.ops, "--lengths", a.lengths, "--dtypes", "fp32", "--repeats", str(a.repeats)]
    bench_args += ["--modes", "chunk"]
    runs: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for v in order:
                out = Path(tmp) / f"{v}-{r}.json"
                print(f"round {r + 1}/{a.rounds}: {v} ...", flush=True)
                subprocess.run(_command(v, bench_args, out), check=True, stdout=subprocess.DEVNULL)
                runs[v].append(json.loads(out.read_text())["rows"])
    keys = sorted(
        {
            (x["op"], x["mode"], x["T"])
            for x in runs["cli"][0]
            if x["mode"] == "chunk" or x["op"] == "softmax_attention"
        }
    )

    def med(v, key, field):
        vals = [x[field] for rows in runs[v] for x in rows if (x["op"], x["mode"], x["T"]) == key]
        vals = [x for x in vals if isinstance(x, (int, float)) and x == x]
        return statistics.median(vals) if vals else float("nan")

    head = f"{'op':<20}{'mode':<10}{'T':>6}" + "".join(f"{v + ' f+b ms':>20}" for v in VARIANTS)
    head += f"{'python/cli':>12}{'tuned/cli':>11}{'cli %peak':>11}{'py %peak':>10}"
    print("\n" + head + "\n" + "-" * len(head))
    summary = []
    for key in keys:
        ms = {v: med(v, key, "fwd_bwd_ms") for v in VARIANTS}
        row = {
            "op": key[0],
            "mode": key[1],
            "T": key[2],
            **{f"{v}_fwd_bwd_ms": ms[v] for v in VARIANTS},
            "python_over_cli": ms["python"] / ms["cli"],
            "tuned_over_cli": ms["python+tune"] / ms["cli"],
            "cli_percent_of_peak": med("cli", key, "percent_of_peak"),
            "python_percent_of_peak": med("python", key, "percent_of_peak"),
        }
        summary.append(row)
        print(
            f"{key[0]:<20}{key[1]:<10}{key[2]:>6}"
            + "".join(f"{ms[v]:>20.2f}" for v in VARIANTS)
            + f"{row['python_over_cli']:>12.2f}{row['tuned_over_cli']:>11.2f}"
            + f"{row['cli_percent_of_peak']:>11.1f}{row['python_percent_of_peak']:>10.1f}"
        )
    if a.json:
        write_json(a.json, {"summary": summary, "runs": runs})  # strict JSON: a NaN cell is null
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
