"""The sweep database: one SQLite row per run (config, seed, status, metrics, state size, wall
time), and one row per sweep with the settings its report needs (``sweep_meta``)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path

from ..train.sinks import dumps_record, loads_record

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,          -- hash of the full run config
    sweep TEXT NOT NULL,              -- the sweep name
    label TEXT NOT NULL,              -- the model entry's label
    model TEXT NOT NULL,              -- the registry name
    cell TEXT NOT NULL,               -- JSON: label + non-tuned grid values
    tuned TEXT NOT NULL,              -- JSON: tuned grid values (e.g. {"lr": 0.003})
    config TEXT NOT NULL,             -- JSON: the TrainConfig fields
    status TEXT NOT NULL,             -- 'done' | 'diverged' | 'failed'
    metrics TEXT,                     -- JSON: the final evaluation record
    val_acc REAL,
    val_loss REAL,
    state_size_bytes INTEGER,         -- decoding state per sequence at the training length
    n_params INTEGER,
    wall_time_s REAL,                 -- wall time of the run (summed over resumed pieces)
    error TEXT,
    finished_at TEXT,
    seed INTEGER                      -- TrainConfig.seed of the run (added later: may be NULL in old files)
)
"""

META_SCHEMA = """
CREATE TABLE IF NOT EXISTS sweep_meta (
    sweep TEXT PRIMARY KEY,
    meta TEXT NOT NULL                -- JSON: SweepSpec.meta() (metric, tune, seeds, select_lr_on_seed)
)
"""

_COLUMNS = (
    "run_id",
    "sweep",
    "label",
    "model",
    "cell",
    "tuned",
    "config",
    "status",
    "metrics",
    "val_acc",
    "val_loss",
    "state_size_bytes",
    "n_params",
    "wall_time_s",
    "error",
    "finished_at",
    "seed",
)

#: seconds a connection waits for another process's write to the database before it gives up
#: (sqlite's busy timeout: a report or ``--list`` beside a running sweep waits, it does not fail)
BUSY_TIMEOUT_S = 60.0

#: a run in one of these states is not run again
FINISHED = ("done", "diverged")


def busy_error(path: Path, error: Exception) -> TimeoutError:
    """The error of a database another process kept locked for longer than :data:`BUSY_TIMEOUT_S`."""
    return TimeoutError(
        f"sweep database {path} stayed locked by another process for {BUSY_TIMEOUT_S:g} s ({error}); "
        "try again when it is done"
    )


class SweepDB:
    """A thin wrapper over an SQLite file (created on first use, with its parent directory).

    Several processes may use one database (a sweep, its report, ``--list``): a connection waits up
    to :data:`BUSY_TIMEOUT_S` for another one's write, then raises ``TimeoutError`` naming the
    database. ``metrics`` is stored as strict JSON (:func:`~mnemo.train.sinks.dumps_record`: a
    NaN/inf is ``null`` plus the record's ``"nonfinite"`` field) and read back with its NaN/inf."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise FileNotFoundError(f"sweep database not found: {str(path)!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S)
        self.conn.row_factory = sqlite3.Row
        try:
            with self.conn:
                self.conn.execute(SCHEMA)
                self.conn.execute(META_SCHEMA)
                have = {r[1] for r in self.conn.execute("PRAGMA table_info(runs)")}
                if "seed" not in have:  # a database written before sweeps had seeds
                    self.conn.execute("ALTER TABLE runs ADD COLUMN seed INTEGER")
        except sqlite3.OperationalError as e:
            self.conn.close()
            if "locked" in str(e) or "busy" in str(e):  # a sweep database, held by another process
                raise busy_error(self.path, e) from None
            raise ValueError(f"{self.path} is not a sweep database: {e}") from None
        except sqlite3.DatabaseError as e:
            self.conn.close()
            raise ValueError(f"{self.path} is not a sweep database: {e}") from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @contextlib.contextmanager
    def _writing(self):
        """A write (or a read) that waited :data:`BUSY_TIMEOUT_S` in vain raises :func:`busy_error`."""
        try:
            yield
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise busy_error(self.path, e) from None
            raise

    def finished_ids(self) -> set[str]:
        with self._writing():
            rows = self.conn.execute(
                f"SELECT run_id FROM runs WHERE status IN ({','.join('?' * len(FINISHED))})", FINISHED
            )
            return {r["run_id"] for r in rows}

    def record(self, sweep: str, run, result: dict) -> None:
        """Insert or replace the row of ``run`` (a :class:`~mnemo.sweep.spec.Run`) with ``result``
        (``status``, ``metrics``, ``state_size_bytes``, ``n_params``, ``wall_time_s``, ``error``)."""
        m = result.get("metrics") or {}
        columns, marks = ",".join(_COLUMNS), ",".join("?" * len(_COLUMNS))
        with self._writing(), self.conn:
            self.conn.execute(
                f"INSERT OR REPLACE INTO runs ({columns}) VALUES ({marks})",
                (
                    run.run_id,
                    sweep,
                    run.label,
                    run.config.get("model", "transformer"),
                    json.dumps(run.cell, sort_keys=True),
                    json.dumps(run.tuned, sort_keys=True),
                    json.dumps(run.config, sort_keys=True),
                    result["status"],
                    dumps_record(m),  # strict JSON: sqlite's json_extract refuses a bare NaN
                    m.get("val_acc"),
                    m.get("val_loss"),
                    result.get("state_size_bytes"),
                    result.get("n_params"),
                    result.get("wall_time_s"),
                    result.get("error"),
                    time.strftime("%Y-%m-%d %H:%M:%S"),
                    getattr(run, "seed", run.config.get("seed", 0)),
                ),
            )

    def set_meta(self, sweep: str, meta: dict) -> None:
        """Store the settings of ``sweep`` that its report uses (:meth:`SweepSpec.meta`)."""
        with self._writing(), self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO sweep_meta VALUES (?, ?)", (sweep, json.dumps(meta, sort_keys=True))
            )

    def meta(self, sweep: str) -> dict:
        """The stored settings of ``sweep`` (``{}`` when none were stored, e.g. an old database)."""
        with self._writing():
            row = self.conn.execute("SELECT meta FROM sweep_meta WHERE sweep = ?", (sweep,)).fetchone()
        return json.loads(row["meta"]) if row else {}

    def rows(self, sweep: str | None = None) -> list[dict]:
        """All rows (of one sweep), JSON columns decoded; ``seed`` is the run's ``TrainConfig.seed``
        (taken from its config for rows stored before the column existed)."""
        q = "SELECT * FROM runs" + (" WHERE sweep = ?" if sweep else "") + " ORDER BY rowid"
        out = []
        with self._writing():
            found = self.conn.execute(q, (sweep,) if sweep else ()).fetchall()
        for r in found:
            d = dict(r)
            for k in ("cell", "tuned", "config"):
                d[k] = json.loads(d[k]) if d[k] else {}
            d["metrics"] = loads_record(d["metrics"]) if d["metrics"] else {}  # NaN/inf again
            if d.get("seed") is None:
                d["seed"] = d["config"].get("seed", 0)
            out.append(d)
        return out

    def sweeps(self) -> list[str]:
        with self._writing():
            return [r[0] for r in self.conn.execute("SELECT DISTINCT sweep FROM runs ORDER BY sweep")]
