"""Regressions the review of today's break-it fixes found (ring attention's autocast, the checkpoint
converters, the CLI's argument layer, mnemo continual and the task-signal model): each test fails on
the code before its fix. (The continual one joined its first test in
tests/nested/test_review_continual.py.)"""

from __future__ import annotations

import subprocess
import sys

from mnemo.commands.sweep import _check_database


def _leave_a_hot_journal(db) -> None:
    """A writer that dies inside its transaction (killed, out of memory, the machine lost): its
    rollback journal stays beside the database, "hot", for the next connection to roll back."""
    code = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA cache_size=1')\n"
        "c.execute('PRAGMA synchronous=OFF')\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "for i in range(100):\n"
        "    c.execute('INSERT INTO runs (run_id, sweep, label, model, cell, tuned, config, status) '\n"
        "              'VALUES (?, 1, 1, 1, 1, 1, 1, 1)', (str(i) + 'x' * 500,))\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(db)], check=True, timeout=60)


def test_a_sweep_database_left_with_a_hot_journal_is_still_a_sweeps(tmp_path):
    """``_not_a_sweep_database`` opened the file read-only (``mode=ro``), which cannot roll back a
    hot journal: a sweep killed while it recorded a run left a database that ``mnemo report`` and
    ``mnemo sweep`` (resuming it) refused as "not a sweep's (it cannot be read: attempt to write a
    readonly database)"; SweepDB rolls the journal back and reads it."""
    import json

    from mnemo.sweep.db import SweepDB

    db = tmp_path / "s.sqlite"
    with SweepDB(db) as d:
        with d.conn:
            d.conn.execute(
                "INSERT INTO runs (run_id, sweep, label, model, cell, tuned, config, status, metrics, "
                "val_acc, val_loss, seed) VALUES ('r', 's', 'gla', 'gla', ?, ?, ?, 'done', ?, 0.5, 1.0, 0)",
                (
                    json.dumps({"label": "gla"}),
                    json.dumps({"lr": 0.001}),
                    json.dumps({"model": "gla", "lr": 0.001, "seed": 0}),
                    json.dumps({"val_acc": 0.5, "val_loss": 1.0}),
                ),
            )
    _leave_a_hot_journal(db)
    assert (tmp_path / "s.sqlite-journal").stat().st_size > 0
    _check_database(db, "db")  # mnemo report's check (and mnemo sweep --db's); raised ValueError
    with SweepDB(db, create=False) as d:
        assert [r["run_id"] for r in d.rows()] == ["r"]  # the killed transaction rolled back
