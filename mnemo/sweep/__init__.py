"""Sweeps over models × sizes × learning rates × task settings, stored in SQLite, and their
reports with seeds and confidence intervals (``mnemo sweep``, ``mnemo report``)."""

from .db import SweepDB
from .report import best_per_cell, cell_stats, markdown_table, write_report
from .runner import run_one, run_sweep
from .spec import Run, SweepSpec
from .stats import mean_interval, t_quantile

__all__ = [
    "Run",
    "SweepDB",
    "SweepSpec",
    "best_per_cell",
    "cell_stats",
    "markdown_table",
    "mean_interval",
    "run_one",
    "run_sweep",
    "t_quantile",
    "write_report",
]
