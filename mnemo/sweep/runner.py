"""Run a sweep: every run of a :class:`~mnemo.sweep.spec.SweepSpec` not yet finished in the
database, serially or in worker processes, resuming interrupted runs from their checkpoints."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import time
import traceback
from pathlib import Path

from tqdm.auto import tqdm

from .db import SweepDB
from .spec import Run, SweepSpec

WALL_NAME = "sweep_wall_time.json"


def default_paths(spec: SweepSpec, config_path: str | Path | None = None) -> tuple[Path, Path]:
    """``(db, out)``: the spec's ``db``/``out`` keys, else ``runs/sweeps/NAME.sqlite`` and
    ``runs/sweeps/NAME/`` (relative to the working directory)."""
    db = Path(spec.db) if spec.db else Path("runs") / "sweeps" / f"{spec.name}.sqlite"
    out = Path(spec.out) if spec.out else Path("runs") / "sweeps" / spec.name
    return db, out


def run_one(config: dict, run_dir: str, threads: int | None = None) -> dict:
    """Train one run in ``run_dir`` (resuming its latest checkpoint if there is one).

    Returns ``{"status": "done" | "diverged" | "failed", "metrics": final record, "state_size_bytes",
    "n_params", "wall_time_s", "error"}``; the trainer's output goes to ``run_dir/train.log``. A
    config with ``track_circuits: true`` records the circuit scores
    (:func:`mnemo.interp.circuit_callbacks`).
    Never raises except ``KeyboardInterrupt``.
    """
    import torch

    from ..interp import circuit_callbacks
    from ..train import TrainConfig, Trainer, TrainingDiverged
    from ..train.sinks import METRICS_NAME, metrics_lines

    if threads:
        torch.set_num_threads(threads)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall_file = out / WALL_NAME
    prev_wall = json.loads(wall_file.read_text())["wall_time_s"] if wall_file.is_file() else 0.0
    t0 = time.perf_counter()

    def wall() -> float:
        return prev_wall + time.perf_counter() - t0

    def save_wall(trainer, record):  # after each evaluation (= checkpoint schedule by default)
        wall_file.write_text(json.dumps({"wall_time_s": wall()}))

    result: dict = {"status": "failed", "metrics": {}, "error": None}
    with (
        open(out / "train.log", "a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        try:
            cfg = TrainConfig.from_dict(config)
            trainer = Trainer(
                cfg,
                out,
                resume=(out / "latest").is_file(),
                progress=False,
                # the circuit tracker when the run's config asks for it (``track_circuits``)
                callbacks=lambda c: [save_wall, *circuit_callbacks(c)],
            )
            result["n_params"] = trainer.model.num_parameters()
            result["state_size_bytes"] = trainer.model.state_size_bytes(1, cfg.seq_len)
            record = trainer.fit()
            if not record:  # already trained to the end before an interruption: the logged record
                lines = [x for x in metrics_lines(out / METRICS_NAME) if x.strip()]
                record = json.loads(lines[-1]) if lines else trainer.evaluate(lengths=cfg.eval_lengths)
            result.update(status="done", metrics={**record, "curve": _curve(out / METRICS_NAME)})
        except TrainingDiverged as e:
            result.update(status="diverged", metrics={"step": e.step}, error=str(e))
        except KeyboardInterrupt:
            raise
        except Exception as e:  # recorded; the sweep goes on and retries the run next time
            traceback.print_exc()
            result.update(status="failed", error=f"{type(e).__name__}: {e}")
    result["wall_time_s"] = wall()
    save_wall(None, None)
    return result


def _curve(path) -> list[dict]:
    """The run's evaluation curve from its ``metrics.jsonl``: per record ``step`` and the
    validation metrics (``val_loss``, ``val_acc``, ``val_seq_acc`` where present), for the
    plateau check of :func:`mnemo.sweep.recipe.left_plateau`."""
    from ..train.sinks import metrics_lines

    keep = ("step", "val_loss", "val_acc", "val_seq_acc")
    curve = []
    for line in metrics_lines(path) if Path(path).is_file() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            curve.append({k: r[k] for k in keep if k in r})
    return curve


def _init_worker(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def run_sweep(
    spec: SweepSpec,
    db_path: str | Path,
    out_dir: str | Path,
    *,
    jobs: int = 1,
    threads: int | None = 1,
    progress: bool = True,
    log=None,
) -> dict:
    """Run every run of ``spec`` that ``db_path`` does not hold as finished; return counts.

    Finished (``done`` or ``diverged``) runs are skipped, so a killed sweep continues where it
    stopped (an interrupted run resumes from its last checkpoint); ``failed`` runs are retried. A
    run is one grid point at one seed, so finished ``(cell, tuned value, seed)`` runs are never
    rerun. The sweep's report settings (:meth:`SweepSpec.meta`) are stored in the database.
    ``jobs > 1`` trains that many runs at once in worker processes (each with ``threads`` torch
    threads). Returns ``{"total", "skipped", "ran", "done", "diverged", "failed"}``.
    """
    runs = spec.runs()
    out_dir = Path(out_dir)
    log = log or tqdm.write
    with SweepDB(db_path) as db:
        db.set_meta(spec.name, spec.meta())
        finished = db.finished_ids()
        todo = [r for r in runs if r.run_id not in finished]
        ids = {r.run_id for r in runs}
        stale = [r for r in db.rows(spec.name) if r["run_id"] not in ids]
        if stale:
            log(
                f"warning: {db_path} holds {len(stale)} run(s) of sweep {spec.name!r} that this file no "
                "longer defines (a setting every run shares changed?); the report keeps the newest run per "
                "cell, learning rate and seed — give a changed sweep a new name to compare both"
            )
        counts = {"total": len(runs), "skipped": len(runs) - len(todo), "ran": 0}
        counts.update(done=0, diverged=0, failed=0)
        bar = tqdm(
            total=len(runs),
            initial=counts["skipped"],
            disable=not progress,
            desc=f"sweep {spec.name}",
            unit="run",
            dynamic_ncols=True,
        )

        def finish(run: Run, res: dict) -> None:
            db.record(spec.name, run, res)
            counts["ran"] += 1
            counts[res["status"]] += 1
            m = res.get("metrics") or {}
            acc = m.get(spec.metric)
            shown = f"{spec.metric} {acc:.4f}" if isinstance(acc, float) else res["status"]
            tuned = " ".join([*(f"{k}={v}" for k, v in run.tuned.items()), f"seed={run.seed}"])
            log(
                f"[{run.run_id}] {run.label} {tuned}: {shown}  "
                f"({res.get('wall_time_s', 0):.0f} s, state {res.get('state_size_bytes')} B)"
                + (f"  error: {res['error']}" if res["status"] == "failed" else "")
            )
            bar.set_postfix_str(f"{run.label} {shown}", refresh=False)
            bar.update(1)

        try:
            if jobs <= 1:
                for run in todo:
                    finish(run, run_one(run.config, str(out_dir / run.run_id), threads))
            else:
                ctx = multiprocessing.get_context("spawn")
                with cf.ProcessPoolExecutor(
                    max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=(threads,)
                ) as pool:
                    futures = {
                        pool.submit(run_one, run.config, str(out_dir / run.run_id), threads): run
                        for run in todo
                    }
                    try:
                        for fut in cf.as_completed(futures):
                            finish(futures[fut], fut.result())
                    except BaseException:
                        for f in futures:
                            f.cancel()
                        raise
        finally:
            bar.close()
    return counts
