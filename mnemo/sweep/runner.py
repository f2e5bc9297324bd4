"""Run a sweep: every run of a :class:`~mnemo.sweep.spec.SweepSpec` not yet finished in the
database, serially or in worker processes, resuming interrupted runs from their checkpoints."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
from pathlib import Path

from tqdm.auto import tqdm

from .db import FINISHED, SweepDB
from .spec import Run, SweepSpec, check_paths

WALL_NAME = "sweep_wall_time.json"


def default_paths(spec: SweepSpec, config_path: str | Path | None = None) -> tuple[Path, Path]:
    """``(db, out)``: the spec's ``db``/``out`` keys (read against its project folder,
    :attr:`SweepSpec.root`), else ``runs/sweeps/NAME.sqlite`` and ``runs/sweeps/NAME/`` under the
    project folder too, so a sweep is stored in one place from any working directory (under the
    working directory for a spec without a root: :meth:`SweepSpec.from_dict` without ``root``).

    A database that an earlier mnemo made at the old default, ``runs/sweeps/NAME.sqlite`` under the
    working directory, is continued there (with its ``runs/sweeps/NAME/`` unless ``out`` is set),
    with a warning; if the project folder holds one as well, ``ValueError`` names both (give the
    one to continue with ``--db``; with ``config_path``, the sweep file of ``mnemo reproduce``, which
    has no ``--db``: set the file's ``db`` to it)."""
    root = Path(spec.root) if spec.root is not None else Path()
    db = Path(spec.db) if spec.db else root / "runs" / "sweeps" / f"{spec.name}.sqlite"
    out = Path(spec.out) if spec.out else root / "runs" / "sweeps" / spec.name
    old = Path("runs") / "sweeps" / f"{spec.name}.sqlite"
    if spec.root is not None and not spec.db and old.is_file() and old.resolve() != db.resolve():
        if db.exists():
            raise ValueError(
                f"sweep {spec.name!r} has two databases: {db} (the default: under the sweep file's project "
                f"folder) and {old} under the working directory (the default of earlier versions); "
                + (
                    f"set the one to continue as db in {config_path} (its run folders as out), or move "
                    "the other away"
                    if config_path is not None
                    else "give the one to continue with --db (and its run folders with --out), or move the "
                    "other away"
                )
            )
        import warnings

        out = Path(spec.out) if spec.out else old.with_suffix("")
        move = "it" if spec.out else "them"  # (an out given: the run folders stay where they are)
        warnings.warn(
            f"continuing {old} (its run folders in {out}) under the working directory, where earlier "
            f"versions stored sweep {spec.name!r}; the default is now {db} under the sweep file's project "
            f"folder: move {move} there to continue from any working directory",
            stacklevel=2,
        )
        db = old
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
    from ..train.checkpoint import LATEST, run_checkpoints
    from ..train.sinks import METRICS_NAME, loads_record, metrics_lines

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
                # a kill between a first checkpoint and its ``latest`` pointer leaves checkpoints
                # alone: resumed from the newest intact one (a new run would be refused there)
                resume=(out / LATEST).is_file() or bool(run_checkpoints(out)),
                progress=False,
                # the circuit tracker when the run's config asks for it (``track_circuits``)
                callbacks=lambda c: [save_wall, *circuit_callbacks(c)],
            )
            result["n_params"] = trainer.model.num_parameters()
            # the memory's state (the axis of the recall-vs-state plots), not a task-signal model's
            # pending-segment bookkeeping (LanguageModel.state_size_bytes)
            result["state_size_bytes"] = trainer.model.state_size_bytes(1, cfg.seq_len, pending=False)
            record = trainer.fit()
            if not record:  # already trained to the end before an interruption: the logged record
                lines = [x for x in metrics_lines(out / METRICS_NAME) if x.strip()]
                record = loads_record(lines[-1]) if lines else trainer.evaluate(lengths=cfg.eval_lengths)
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
    from ..train.sinks import loads_record, metrics_lines

    keep = ("step", "val_loss", "val_acc", "val_seq_acc")
    curve = []
    for line in metrics_lines(path) if Path(path).is_file() else []:
        try:
            r = loads_record(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            curve.append({k: r[k] for k in keep if k in r})
    return curve


#: set in the sweep's workers by :func:`_init_worker`: the sweep is stopping, start no new run
_STOP = None


def _init_worker(threads: int | None, stop=None) -> None:
    import torch

    global _STOP
    _STOP = stop
    if threads:
        torch.set_num_threads(threads)


def _run_in_worker(config: dict, run_dir: str, threads: int | None) -> dict:
    """:func:`run_one` in a worker process, unless the sweep is stopping (then nothing starts)."""
    if _STOP is not None and _STOP.is_set():
        return {"status": "failed", "metrics": {}, "error": "the sweep was interrupted before this run"}
    return run_one(config, run_dir, threads)


def _raise_interrupt(signum, frame):
    """A signal handler: Ctrl-C's path for SIGTERM; ``signal`` tells the CLI which (exit 143)."""
    e = KeyboardInterrupt(signal.Signals(signum).name)
    e.signal = signal.Signals(signum).name
    raise e


def _stop_workers(pool, stop) -> None:
    """An interrupted sweep: no queued run starts, and every running one gets SIGTERM, which its
    trainer turns into a checkpoint of the last finished step (:mod:`mnemo.train.interrupts`), so
    the pool's shutdown waits for a step, not for whole runs, and no worker outlives the sweep."""
    stop.set()
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(proc.pid, signal.SIGTERM)


def _chosen_values(db: SweepDB, spec: SweepSpec, ids: set[str]) -> dict[str, dict | None]:
    """Per cell key: the tuned values seed ``spec.select_lr_on_seed`` chose (as the report chooses
    them, :func:`mnemo.sweep.report.cell_stats`), or ``None`` when that seed has no done run there."""
    from .report import cell_stats

    rows = [r for r in db.rows(spec.name) if r["run_id"] in ids]
    out: dict[str, dict | None] = {}
    for c in cell_stats(rows, spec.metric, select_lr_on_seed=spec.select_lr_on_seed):
        out[json.dumps(c["cell"], sort_keys=True)] = c["tuned"] if c["selection_value"] is not None else None
    return out


#: the states :func:`sweep_plan` gives a run that a complete sweep still has to train
PENDING = ("todo", "failed", "waiting")


def sweep_plan(spec: SweepSpec, db_path: str | Path) -> list[tuple[Run, str]]:
    """Each run ``spec`` defines, with its state in the database ``db_path`` (which need not exist):

    ``done`` / ``diverged`` (finished, never rerun); ``failed`` (retried by the next call);
    ``todo`` (not run yet); and under staged selection (see :func:`run_sweep`), for the runs of
    the other seeds: ``waiting`` (its cell's held-out runs have not all finished, so its value is
    not chosen yet), ``not-chosen`` (the held-out seed chose another value: never trained) and
    ``not-run`` (no held-out run of its cell is ``done``, so nothing was chosen). The runs a
    complete sweep still needs are those in :data:`PENDING`.
    """
    runs = spec.runs()
    staged = spec.select_lr_on_seed is not None and spec.selection == "staged"
    status: dict[str, str] = {}
    chosen: dict[str, dict | None] = {}
    if Path(db_path).is_file():
        with SweepDB(db_path, create=False) as db:
            ids = {r.run_id for r in runs}
            status = {r["run_id"]: r["status"] for r in db.rows(spec.name) if r["run_id"] in ids}
            if staged:
                chosen = _chosen_values(db, spec, ids)
    held_open = {
        r.cell_key
        for r in runs
        if staged and r.seed == spec.select_lr_on_seed and status.get(r.run_id) not in FINISHED
    }
    out = []
    for r in runs:
        st = status.get(r.run_id, "todo")
        if staged and r.seed != spec.select_lr_on_seed and st not in FINISHED:
            if r.cell_key in held_open:
                st = "waiting"
            elif chosen.get(r.cell_key) is None:
                st = "not-run"
            elif r.tuned != chosen[r.cell_key]:
                st = "not-chosen"
        out.append((r, st))
    return out


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
    threads).

    **Staged selection** (a held-out seed ``select_lr_on_seed: S`` with ``selection: staged``, the
    default): the seed-``S`` runs go first; once all of a cell's seed-``S`` runs have finished, its
    other seeds are queued at the tuned values seed ``S`` chose (the report's choice) and the
    rest are not trained (``not_selected``). A cell whose seed-``S`` runs all diverged or failed
    queues nothing (said in the log); a failed one is retried by the next call.

    Returns ``{"total", "skipped", "ran", "done", "diverged", "failed", "not_selected"}``:
    ``total`` counts the runs this sweep trains (staged: the held-out runs plus the chosen
    values' runs, as far as known), ``skipped`` those already finished.

    One sweep at a time per database: the call holds an exclusive lock on ``DB.lock`` (beside
    the database) until it returns.

    Raises:
        ValueError: another process is running a sweep on ``db_path`` (the message names its pid); a
            relative path names nothing under the sweep file's project folder but something under
            the working directory (:func:`~mnemo.sweep.spec.check_paths`), before anything is made;
            a run's ``data`` glob reads its run folder (its ``metrics.jsonl`` would be read as
            corpus by the runs after it).
    """
    check_paths(spec)
    _check_data_globs(spec, Path(out_dir))
    with _DatabaseLock(Path(db_path)):
        return _run_sweep(spec, db_path, out_dir, jobs=jobs, threads=threads, progress=progress, log=log)


def _check_data_globs(spec: SweepSpec, out_dir: Path) -> None:
    """Refuse a run whose ``data`` glob would read the files it writes in its run folder (as
    ``mnemo train`` refuses such an ``--out``): the next run, or its resume, would read them; and a
    glob that matches files of other training runs' folders now (an earlier sweep's, a run beside
    the corpus: :func:`~mnemo.data.corpus.refuse_run_files`, naming them), before any run starts."""
    import glob

    from ..data.corpus import BUNDLED, glob_reads_run, refuse_run_files

    looked = set()
    for run in spec.runs():
        cfg = run.train_config
        data = cfg.get("data")
        if cfg.get("task") or not isinstance(data, str) or data in BUNDLED or Path(data).exists():
            continue
        if not any(c in data for c in "*?["):
            continue
        try:
            if data not in looked:  # other runs' folders it matches now (a sibling's, an earlier sweep's)
                looked.add(data)
                refuse_run_files(
                    data, sorted(Path(f) for f in glob.glob(data, recursive=True) if Path(f).is_file())
                )
            reads = glob_reads_run(data, out_dir / run.run_id)
        except ValueError as e:
            raise ValueError(f"sweep {spec.name!r}: {e}") from None
        if reads:
            raise ValueError(
                f"sweep {spec.name!r}: its run folders in {out_dir} are where data {data!r} reads: the "
                "glob would match the runs' own files (metrics.jsonl, the checkpoints' .json files) and "
                "read them as corpus; give the sweep an out folder outside the glob"
            )


class _DatabaseLock:
    """An exclusive ``flock`` on ``DB.lock`` while a sweep runs (two sweeps on one database both
    trained its runs, and the one that failed on the other's rotated checkpoint recorded a finished
    run as failed). The kernel drops it when the process dies; release removes the file. No-op
    without ``fcntl``."""

    def __init__(self, db: Path):
        self.path = db.with_name(db.name + ".lock")
        self.file = None

    def __enter__(self):
        try:
            import fcntl  # noqa: F401
        except ImportError:  # pragma: no cover - not POSIX
            return self
        from ..train.run_folder import take_lock_file

        db = self.path.with_name(self.path.name.removesuffix(".lock"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = take_lock_file(
            self.path,
            lambda holder: (
                f"sweep database {db} is in use by another mnemo sweep (pid {holder}); wait "
                "for it to finish (runs it finishes are kept), or give another --db"
            ),
        )
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.path.unlink(missing_ok=True)
            self.file.close()
            self.file = None


def _run_sweep(spec: SweepSpec, db_path, out_dir, *, jobs, threads, progress, log) -> dict:
    runs = spec.runs()
    out_dir = Path(out_dir)
    log = log or tqdm.write
    staged = spec.select_lr_on_seed is not None and spec.selection == "staged"
    with SweepDB(db_path) as db:
        ids = {r.run_id for r in runs}
        # a run is one configuration (its id hashes it) and one row: shared with another sweep's
        # name, this sweep would count the other's runs as its own and record none (its report empty)
        foreign = sorted({r["sweep"] for r in db.rows() if r["run_id"] in ids and r["sweep"] != spec.name})
        if foreign:
            raise ValueError(
                f"sweep {spec.name!r}: {db_path} already holds runs of the same configurations under sweep "
                f"{', '.join(map(repr, foreign))}; give this sweep its own database (drop --db: "
                f"runs/sweeps/{spec.name}.sqlite) or its file the name {foreign[0]!r}"
            )
        db.set_meta(spec.name, spec.meta())
        finished = db.finished_ids()
        stale = [r for r in db.rows(spec.name) if r["run_id"] not in ids]
        if stale:
            log(
                f"warning: {db_path} holds {len(stale)} run(s) of sweep {spec.name!r} that this file no "
                "longer defines (a setting every run shares changed?); the report keeps the newest run per "
                "cell, learning rate and seed — give a changed sweep a new name to compare both"
            )
        # staged: the held-out seed's runs now, the rest per cell once that cell's are finished
        first = [r for r in runs if not staged or r.seed == spec.select_lr_on_seed]
        later: dict[str, list[Run]] = {}
        for r in runs:
            if staged and r.seed != spec.select_lr_on_seed:
                later.setdefault(r.cell_key, []).append(r)
        held_open = {}  # cell -> its held-out runs not finished yet
        held_failed: set[str] = set()  # cells with a held-out run that failed in this call
        for r in first:
            if staged and r.run_id not in finished:
                held_open[r.cell_key] = held_open.get(r.cell_key, 0) + 1
        expected = len(first) + sum(len({r.seed for r in rs}) for rs in later.values())
        counts = {"total": expected, "skipped": sum(r.run_id in finished for r in first), "ran": 0}
        counts.update(done=0, diverged=0, failed=0, not_selected=0)
        bar = tqdm(
            total=expected,
            initial=counts["skipped"],
            disable=not progress,
            desc=f"sweep {spec.name}",
            unit="run",
            dynamic_ncols=True,
        )
        queue: list[Run] = [r for r in first if r.run_id not in finished]

        def release(cell: str) -> None:
            """Queue a cell's other seeds at the values its held-out runs chose."""
            if cell not in later:
                return
            chosen = _chosen_values(db, spec, ids).get(cell)
            if cell in held_failed:  # a held-out run failed: it is retried by the next call
                log(
                    f"{later[cell][0].label} {json.loads(cell)}: a run of the held-out seed "
                    f"{spec.select_lr_on_seed} failed; its other seeds wait until it has run (run the "
                    "sweep again)"
                )
                return
            rs = later.pop(cell)
            if chosen is None:
                n_seeds = len({r.seed for r in rs})
                counts["total"] -= n_seeds
                bar.total = counts["total"]
                log(
                    f"{rs[0].label} {json.loads(cell)}: no done run of the held-out seed "
                    f"{spec.select_lr_on_seed}; its {n_seeds} other seed(s) are not run"
                )
                return
            keep = [r for r in rs if r.tuned == chosen]
            counts["not_selected"] += len(rs) - len(keep)
            done_before = [r for r in keep if r.run_id in finished]
            counts["skipped"] += len(done_before)
            bar.update(len(done_before))
            new = [r for r in keep if r.run_id not in finished]
            queue.extend(new)
            tuned = " ".join(f"{k}={v}" for k, v in chosen.items())
            log(
                f"{rs[0].label}: seed {spec.select_lr_on_seed} chose {tuned}; {len(new)} run(s) of the other "
                f"seeds queued, {len(rs) - len(keep)} at the other values not run"
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
            if res["status"] != "failed":
                finished.add(run.run_id)
            if run.cell_key in held_open and run.seed == spec.select_lr_on_seed:
                if res["status"] == "failed":
                    held_failed.add(run.cell_key)
                held_open[run.cell_key] -= 1
                if held_open[run.cell_key] == 0:
                    release(run.cell_key)

        for cell in list(later):  # cells whose held-out runs finished in an earlier call
            if cell not in held_open:
                release(cell)
        try:
            if jobs <= 1:
                while queue:
                    run = queue.pop(0)
                    finish(run, run_one(run.train_config, str(out_dir / run.run_id), threads))
            else:
                ctx = multiprocessing.get_context("spawn")
                stop = ctx.Event()
                # SIGTERM (a scheduler's, `kill`) takes the same path as Ctrl-C: workers stop too
                main = threading.current_thread() is threading.main_thread()
                old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None
                try:
                    with cf.ProcessPoolExecutor(
                        max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=(threads, stop)
                    ) as pool:
                        futures: dict = {}
                        try:
                            while queue or futures:
                                while queue:
                                    run = queue.pop(0)
                                    where = str(out_dir / run.run_id)
                                    futures[pool.submit(_run_in_worker, run.train_config, where, threads)] = (
                                        run
                                    )
                                done, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED)
                                for fut in done:
                                    finish(futures.pop(fut), fut.result())
                        except BaseException:
                            # no f.cancel(): the stop event already makes a queued run return at
                            # once, and a cancelled future meets CPython 3.11's race when a worker
                            # killed while it starts breaks the pool (the manager thread then raises
                            # InvalidStateError on it: gh-107219)
                            _stop_workers(pool, stop)
                            raise
                finally:
                    if old_term is not None:
                        signal.signal(signal.SIGTERM, old_term)
        finally:
            bar.close()
    return counts
