"""Run ``mnemo train`` commands a few at a time, each logging to ``RUN.log`` beside its run folder
(what the results scripts that train several runs share: scripts/attention_sinks.py,
scripts/context_extension.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def train_runs(jobs: list[tuple[Path, list[str]]], parallel: int, label: str = "train") -> dict[str, float]:
    """Run each ``(run folder, argv)`` of ``jobs``, ``parallel`` at a time, single-threaded
    (``OMP_NUM_THREADS`` 1 unless set); stdout and stderr go to ``RUN.log``. Returns the wall time
    per run folder (s). Raises ``SystemExit`` naming the log of every command that failed, after
    the others have finished."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    queue, running, walls, failed = list(jobs), [], {}, []
    while queue or running:
        while queue and len(running) < parallel:
            run, argv = queue.pop(0)
            run.parent.mkdir(parents=True, exist_ok=True)
            log = open(run.with_name(run.name + ".log"), "a")
            print(f"{label}: {' '.join(argv[2:])}", flush=True)
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((run, proc, log, time.time()))
        time.sleep(1)
        for item in list(running):
            run, proc, log, t0 = item
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            walls[str(run)] = time.time() - t0
            if proc.returncode != 0:
                failed.append(f"{run} (exit {proc.returncode}): see {log.name}")
    if failed:
        raise SystemExit(f"{label}: failed: " + "; ".join(failed))
    return walls
