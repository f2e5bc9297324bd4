"""What the chunk forms' buffer cache (``mnemo/ops/_workspace.py``) buys a plain Python process.

Each cell is a fresh process that does nothing but time one op's forward+backward (the op rows of
``mnemo bench``, chunk form): with the cache (the default), without it (``MNEMO_WORKSPACE_MB=0``),
and with :func:`mnemo.runtime.tune_malloc` on top of the cache (what the ``mnemo`` command runs
with). Nothing else runs in the process first, so glibc's ``malloc`` starts from its defaults, as
in a user's script (``scripts/bench_python_vs_cli.py`` runs the matmul-peak measurement first,
whose 16 MiB blocks raise glibc's thresholds and hide most page faults). The processes of a round
run one after the other, the order rotated each round; a row's number is the median over rounds of
each process's median, with the minor page faults per call.

    python scripts/bench_workspace.py --ops gla_scalar,gla_channel,gated_delta_rule,ssd --rounds 5
    python scripts/bench_workspace.py --ops model:mamba2,model:gated_deltanet --length 1024 --repeats 3

An op name ``model:<name>`` times a training step (forward, backward, AdamW) of that registered
model at d_model 256, 6 layers, batch 8 and ``--length`` tokens instead.

Run it on a quiet machine (nothing else heavy beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.bench import write_json

VARIANTS = ("cache", "no cache", "cache+tune")

_CHILD = """
import json, resource, statistics, sys, time
import torch
if sys.argv[3] == "cache+tune":
    from mnemo.runtime import tune_malloc
    tune_malloc()
T, repeats = int(sys.argv[2]), int(sys.argv[4])
if sys.argv[1].startswith("model:"):  # a training step (AdamW) of a registered model, batch 8
    from mnemo.bench.models import Size, mnemo_entry, train_step
    step = train_step(mnemo_entry(sys.argv[1][6:], size=Size(256, 6)), T, 8)
else:
    from mnemo.bench.ops import _registry
    bench = {b.name: b for b in _registry()}[sys.argv[1]]
    x = {n: t.detach().requires_grad_(True) for n, t in bench.make(1, T, 4, 64, "cpu").items()}
    def step():
        for t in x.values():
            t.grad = None
        bench.call(x, "chunk").float().sum().backward()
for _ in range(3):
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / repeats
print(json.dumps({"ms": 1e3 * statistics.median(times), "faults": faults}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ops", default="gla_scalar,gla_channel,gated_delta_rule,ssd", help="op rows or model:<name>"
    )
    p.add_argument("--length", type=positive_int, default=4096)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    a = p.parse_args(argv)
    if a.json and os.path.exists(a.json) and not a.overwrite:  # refused before the long run, not after
        p.error(f"--json: {a.json} exists; pass --overwrite to replace it")
    ops = a.ops.split(",")
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for op in ops:
            for v in order:
                env = dict(os.environ, MNEMO_WORKSPACE_MB="0" if v == "no cache" else "1024")
                cmd = [sys.executable, "-c", _CHILD, op, str(a.length), v, str(a.repeats)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                cells.setdefault((op, v), []).append(json.loads(out.strip().splitlines()[-1]))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(
        f"ops: B=1 T={a.length} H=4 D=64 fp32, chunk form fwd+bwd; model:<name>: a training step at"
        f" d_model 256, 6 layers, {a.length}x8; medians over {a.rounds} rounds of fresh processes"
    )
    head = f"{'op':22}" + "".join(f"{v + ' ms':>15}" for v in VARIANTS)
    print(head + f"{'no cache/cache':>16}{'tune/cache':>12}   faults/call " + " / ".join(VARIANTS))
    rows = []
    for op in ops:
        ms = {v: statistics.median(c["ms"] for c in cells[(op, v)]) for v in VARIANTS}
        fl = {v: statistics.median(c["faults"] for c in cells[(op, v)]) for v in VARIANTS}
        per_round = [n["ms"] / c["ms"] for c, n in zip(cells[(op, "cache")], cells[(op, "no cache")])]
        print(
            f"{op:22}"
            + "".join(f"{ms[v]:15.2f}" for v in VARIANTS)
            + f"{ms['no cache'] / ms['cache']:16.2f}{ms['cache+tune'] / ms['cache']:12.2f}   "
            + " / ".join(f"{fl[v]:.0f}" for v in VARIANTS)
        )
        print(f"{'':22}no cache/cache per round: " + " ".join(f"{x:.2f}" for x in per_round))
        rows.append({"op": op, "ms": ms, "faults_per_call": fl, "no_cache_over_cache_per_round": per_round})
    if a.json:
        meta = {"length": a.length, "rounds": a.rounds, "repeats": a.repeats}
        write_json(a.json, {**meta, "rows": rows})  # strict JSON: a NaN ratio is null
    return 0


if __name__ == "__main__":
    sys.exit(main())
