"""``mnemo sweep``, ``mnemo report`` and ``mnemo tasks`` (registered through
``mnemo.cli._COMMAND_MODULES``); the library behind them is :mod:`mnemo.sweep`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .. import argtypes as kinds


def _check_place(kind, path, where: str) -> None:
    import argparse

    try:
        kind(str(path))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{where}: {e}") from None


def _check_database(path, flag: str, create: bool = False) -> None:
    """An existing file must already be an SQLite database: reading or listing never turns another
    file (an empty one, a YAML file) into one. A file to ``create`` must end with one of
    :data:`DB_SUFFIXES` (a bare name is more often meant as a folder)."""
    p = Path(path)
    if p.exists():
        with open(p, "rb") as f:
            head = f.read(16)
        if head != b"SQLite format 3\x00":
            raise ValueError(
                f"{flag}: {p} is not an SQLite database (a sweep's database); it was left as it is"
            )
        why = _not_a_sweep_database(p)
        if why:
            raise ValueError(
                f"{flag}: {p} is an SQLite database but not a sweep's ({why}); it was left as it is"
            )
    elif create and p.suffix.lower() not in DB_SUFFIXES:  # e.g. --db swdir, meant as a folder
        raise ValueError(
            f"{flag}: a new sweep database is one SQLite file named with a suffix "
            f"({', '.join(DB_SUFFIXES)}), e.g. {p.name}.sqlite; got {str(p)!r} (the run folders go to --out)"
        )


def _not_a_sweep_database(p: Path) -> str:
    """Why the SQLite file ``p`` is no sweep's database ('' if it may be one), read without writing:
    a sweep's tables would otherwise be added to another program's database (or its own ``runs``
    table, of other columns, fail the first query). A hot journal (a sweep killed inside its
    transaction) is rolled back, as any SQLite reader does; a read-only connection cannot."""
    import sqlite3

    from ..sweep import db as dbmod

    try:
        # (mode=rw: mode=ro raised "attempt to write a readonly database" on a hot journal)
        conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=rw", uri=True, timeout=dbmod.BUSY_TIMEOUT_S)
        try:
            tables = [
                r[0]
                for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                if not r[0].startswith("sqlite_")
            ]
            columns = {
                t: {r[1] for r in conn.execute(f"PRAGMA table_info({t})")} for t in ("runs", "sweep_meta")
            }
        finally:
            conn.close()
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):  # held by another process (a running sweep), as SweepDB
            raise dbmod.busy_error(p, e) from None
        return f"it cannot be read: {e}"
    except sqlite3.DatabaseError as e:
        return f"it cannot be read: {e}"
    if tables and "runs" not in tables:  # (no table at all: an empty database, which a sweep may fill)
        return f"its tables: {', '.join(sorted(tables))}; a sweep's has 'runs'"
    columns_of_runs = set(dbmod._COLUMNS) - {"seed"}  # (seed: added to old ones)
    need = {"runs": columns_of_runs, "sweep_meta": {"sweep", "meta"}}
    for table, cols in need.items():
        missing = sorted(cols - columns[table]) if table in tables else []
        if missing:
            named = ", ".join(map(repr, missing[:3])) + (
                f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            )
            return f"its table {table!r} has no column {named}"
    return ""


#: the names a new sweep database may end with
DB_SUFFIXES = (".sqlite", ".sqlite3", ".db")
#: the kinds of ``--db`` and ``--out``, which a sweep file's ``db`` and ``out`` get too
DB_KIND = kinds.OutFile("a database file")
OUT_KIND = kinds.OutDir(not_a_run=True, not_inside_run=True)


def _cmd_sweep(args) -> int:
    import dataclasses

    from ..sweep.runner import default_paths, run_sweep
    from ..sweep.spec import SweepSpec

    spec = SweepSpec.load(args.config)
    # (a --db given: the file's or the default database is not looked for, an old one included;
    # an --out given: the run folders are there, as a warning about an old database says)
    given = {k: str(v) for k, v in (("db", args.db), ("out", args.out)) if v}
    db, out = default_paths(dataclasses.replace(spec, **given) if given else spec)
    # the file's (or the default) places get the checks the flags get, before any run starts
    # (a file without 'db'/'out': the default place is named as such, with the flag that sets another)
    db_where = f"{args.config}: " + (
        "db" if spec.db else "the default database (the file sets no 'db'; --db)"
    )
    out_where = f"{args.config}: " + (
        "out" if spec.out else "the default out (the file sets no 'out'; --out)"
    )
    if not args.db:
        _check_place(DB_KIND, db, db_where)
    if not args.out:
        _check_place(OUT_KIND, out, out_where)
    db = Path(args.db) if args.db else db
    out = Path(args.out) if args.out else out
    _check_database(db, "--db" if args.db else db_where, create=not args.list)
    runs = spec.runs()
    if args.list:
        from collections import Counter

        from ..sweep.runner import sweep_plan

        plan = sweep_plan(spec, db)
        gone = 0
        for r, state in plan:
            # a finished run's results are in the database (what the report reads); its folder
            # (checkpoints, logs) may have been deleted since
            missing = state in ("done", "diverged") and not (out / r.run_id).is_dir()
            gone += missing
            note = f"  (its folder {out / r.run_id} is gone; the results stay in the database)" * missing
            print(f"{r.run_id}  {state}  {r.label}  {r.cell}  {r.tuned}  seed={r.seed}{note}")
        counts = Counter(state for _, state in plan)
        print(
            f"{spec.name}: "
            + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
            + (f" ({gone} finished run folder(s) gone)" if gone else "")
        )
        return 0
    cells = len({r.cell_key for r in runs})
    seeds = f" x {len(spec.seeds)} seeds" if spec.seeds else ""
    if spec.select_lr_on_seed is not None and spec.selection == "staged":
        n_staged = len([r for r in runs if r.seed == spec.select_lr_on_seed]) + cells * (len(spec.seeds) - 1)
        seeds += (
            f" (staged selection: seed {spec.select_lr_on_seed} at every value first, the other seeds at "
            f"the chosen values only: {n_staged} runs)"
        )
    print(
        f"mnemo sweep: {spec.name}: {len(runs)} runs in {cells} cells{seeds} -> {db} "
        f"(run directories in {out}), "
        f"{args.jobs} job(s) x {args.threads} thread(s)",
        flush=True,
    )
    counts = run_sweep(spec, db, out, jobs=args.jobs, threads=args.threads, progress=not args.no_progress)
    print(
        f"sweep {spec.name}: {counts['total']} runs, {counts['skipped']} already finished, "
        f"ran {counts['ran']} ({counts['done']} done, {counts['diverged']} diverged, "
        f"{counts['failed']} failed)"
        + (
            f"; {counts['not_selected']} runs at values the held-out seed did not choose not run"
            if counts.get("not_selected")
            else ""
        )
    )
    print(f"try: mnemo report {shlex.quote(str(db))}")  # (a command to paste: a space in the path)
    return 1 if counts["failed"] else 0


def _cmd_report(args) -> int:
    from ..sweep.report import write_report

    _check_database(args.db, "db")
    from ..sweep.db import SweepDB
    from ..sweep.report import report_metric

    out = Path(args.out) if args.out else Path(args.db).with_name(Path(args.db).stem + "_report")
    with SweepDB(args.db, create=False) as db:
        names = [args.sweep] if args.sweep else db.sweeps()
        metrics = {report_metric(db.meta(n), args.metric) for n in names if n in db.sweeps()}
        metrics = metrics or {args.metric or "val_acc"}  # (no sweep: what a report would use)
    for metric in sorted(metrics):
        if args.threshold is not None and metric != "val_loss" and args.threshold > 1:
            raise ValueError(
                f"--threshold: {metric} is an accuracy in [0, 1], so a threshold above 1 counts no run; "
                f"got {args.threshold}"
            )
    suffixes = (".md", ".json", "_acc_vs_state.png", "_acc_vs_length.png")
    for name in names:  # before the work: a file there may be the user's or an earlier report
        for suffix in suffixes:
            kinds.refuse_existing(out / f"{name}{suffix}", "--out", args.overwrite)
    result = write_report(
        args.db,
        args.out,
        sweep=args.sweep,
        metric=args.metric,
        plots=not args.no_plots,
        threshold=args.threshold,
        select_lr_on_seed=args.select_lr_on_seed,
    )
    for name, r in result.items():
        print(r["markdown"])
        for f in r["files"]:
            print(f"wrote {f}")
        written = {Path(f).name for f in r["files"]}
        stale = [f"{name}{x}" for x in suffixes if f"{name}{x}" not in written]
        stale = [f for f in stale if (out / f).exists()]
        if stale:  # (--overwrite) an earlier report's file beside this one, which did not rewrite it
            print(
                f"mnemo report: warning: {out}: {', '.join(stale)} is left from an earlier report (this one "
                f"did not write it{': --no-plots' if args.no_plots else ''}); it may not match {name}.md",
                file=sys.stderr,
            )
    return 0


def _cmd_tasks(args) -> int:
    from ..data.tasks import TASKS, build_task, task_names

    for name in task_names():
        t = build_task(name)
        opts = ", ".join(f"{k}={v!r}" for k, v in t.options().items())
        print(f"{name:<18}  vocab {t.vocab_size:<4} min length {t.min_length:<4} {TASKS[name].paper}")
        print(f"{'':<18}  options: {opts}")
    return 0


def _cmd_reproduce(args) -> int:
    from ..sweep.reproduce import page_lines, page_sweeps, reproduce_page
    from . import capacity, continual

    if args.partial and not args.no_run:
        raise ValueError(
            "--partial: goes with --no-run (a call that trains writes the page whatever happens, and marks "
            "it partial when runs fail)"
        )
    files = page_sweeps(args.page)  # errors (no directive, missing file) before anything runs
    commands = page_lines(args.page, "continual")
    probes = page_lines(args.page, "capacity")
    print(
        f"mnemo reproduce: {args.page}: {len(files)} sweep(s)"
        + (f": {', '.join(map(str, files))}" if files else "")
        + (f"; {len(commands)} mnemo continual command(s)" if commands else "")
        + (f"; {len(probes)} mnemo probe capacity command(s)" if probes else ""),
        flush=True,
    )
    res = reproduce_page(
        args.page,
        run=not args.no_run,
        jobs=args.jobs,
        threads=args.threads,
        progress=not args.no_progress,
        partial=args.partial,
        only=[n.strip() for n in args.sweep.split(",") if n.strip()] if args.sweep is not None else None,
        continual=continual,
        capacity=capacity,
    )
    failed = sum((r["counts"] or {}).get("failed", 0) for r in res.values())
    if failed:
        print(f"{failed} run(s) failed (see their train.log); run the same command again to retry them")
    return 1 if failed else 0


def add_commands(sub) -> None:
    """Add ``sweep``, ``report``, ``reproduce`` and ``tasks`` to the ``mnemo`` sub-command parser."""
    s = sub.add_parser(
        "sweep",
        help="run a grid of training runs from a YAML file (resumable; results in SQLite)",
        description="Run every run of a sweep file that the database does not hold as finished. "
        "A killed sweep continues where it stopped; see configs/sweeps/*.yaml.",
    )
    s.add_argument(
        "config",
        type=kinds.ExistingFile("an existing sweep YAML file"),
        help="sweep YAML file (configs/sweeps/mqar.yaml, ...)",
    )
    s.add_argument(
        "--db",
        type=DB_KIND,
        help="SQLite database (default: the file's 'db', else runs/sweeps/NAME.sqlite; both under the sweep "
        "file's project folder, the nearest folder above it with pyproject.toml or .git, else its own "
        "folder; a database an earlier version made at runs/sweeps/NAME.sqlite under the working directory "
        "is continued there)",
    )
    s.add_argument(
        "--out",
        type=OUT_KIND,
        help="run directories (default: the file's 'out', else runs/sweeps/NAME/; both under the sweep "
        "file's project folder, the nearest folder above it with pyproject.toml or .git, else its own)",
    )
    s.add_argument(
        "--jobs",
        type=kinds.Int(1, 256),
        default=1,
        help="runs trained at once, in worker processes (default 1)",
    )
    s.add_argument("--threads", type=kinds.threads, default=1, help="torch threads per run (default 1)")
    s.add_argument(
        "--list",
        action="store_true",
        help="list the runs and the state of each (done, diverged, failed, todo; staged selection: "
        "waiting, not-chosen, not-run); train nothing",
    )
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=_cmd_sweep)

    r = sub.add_parser(
        "report",
        help="per-cell mean, 95%% t interval, n and threshold count of a sweep DB, as markdown, JSON "
        "and plots with error bars (accuracy vs state size / test length)",
    )
    r.add_argument(
        "db", type=kinds.ExistingFile("an existing sweep database"), help="the sweep's SQLite database"
    )
    r.add_argument(
        "--out",
        type=kinds.OutDir(not_a_run=True),
        help="directory for NAME.md and the PNG plots (default: DB_STEM_report/ next to DB)",
    )
    r.add_argument(
        "--overwrite", action="store_true", help="replace report files that exist (default: refuse)"
    )
    r.add_argument(
        "--sweep", type=kinds.Text("a sweep name"), help="only this sweep (a database may hold several)"
    )
    r.add_argument(
        "--metric",
        choices=["val_acc", "val_seq_acc", "val_loss"],
        help="the metric reported and judged (default: the sweep file's metric)",
    )
    r.add_argument(
        "--threshold",
        type=kinds.nonneg_float,
        help="count the runs whose metric reached this (>= for accuracies, <= for val_loss; "
        "default 0.99 for accuracies, none for val_loss)",
    )
    r.add_argument(
        "--select-lr-on-seed",
        type=kinds.seed,
        metavar="S",
        help="choose each cell's learning rate on seed S and report the other seeds "
        "(default: the sweep file's select_lr_on_seed)",
    )
    r.add_argument("--no-plots", action="store_true", help="only the markdown table and JSON")
    r.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "reproduce",
        help="rebuild a results page: run or resume its sweeps, then rewrite its tables and figures",
        description="Run (or resume) every sweep a results page names in its "
        "`<!-- mnemo:reproduce CONFIG -->` lines (and every `mnemo continual` command in its "
        "`<!-- mnemo:continual ARGS -->` lines), then replace the text between its "
        "`<!-- mnemo:begin NAME -->` / `<!-- mnemo:end NAME -->` markers with the commands, the table, "
        "the claims and the figure (mnemo.sweep.reproduce). Text outside the markers is kept.",
    )
    p.add_argument(
        "page",
        type=kinds.ExistingFile("an existing results page (.md)"),
        help="e.g. docs/results/zoology_equal_state.md",
    )
    p.add_argument("--jobs", type=kinds.Int(1, 256), default=1, help="runs trained at once (default 1)")
    p.add_argument("--threads", type=kinds.threads, default=1, help="torch threads per run (default 1)")
    p.add_argument(
        "--no-run",
        action="store_true",
        help="rebuild from the databases as they are; train nothing (refused while a sweep has runs left "
        "to train, unless --partial)",
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="with --no-run: write the page even if a sweep is unfinished (its block says so)",
    )
    p.add_argument(
        "--sweep",
        metavar="NAME",
        type=kinds.Text("sweep names, comma-separated"),
        help="only these sweeps of the page (their 'name'; a mnemo continual or mnemo probe capacity line's "
        "block is named after its --out folder), comma-separated; the page's other blocks are left as they "
        "are (default: every sweep the page names)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_reproduce)

    t = sub.add_parser("tasks", help="list the synthetic tasks and their options")
    t.set_defaults(func=_cmd_tasks)
