"""Sweeps over models × sizes × learning rates × task settings, stored in SQLite, and their
reports (``mnemo sweep``, ``mnemo report``)."""

from .db import SweepDB
from .report import best_per_cell, markdown_table, write_report
from .runner import run_one, run_sweep
from .spec import Run, SweepSpec

__all__ = [
    "Run",
    "SweepDB",
    "SweepSpec",
    "best_per_cell",
    "markdown_table",
    "run_one",
    "run_sweep",
    "write_report",
]
