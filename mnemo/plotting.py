"""Small helpers shared by mnemo's figures (matplotlib, imported lazily by the callers)."""

from __future__ import annotations


def legend(ax, **kwargs) -> None:
    """``ax.legend(**kwargs)`` when something on ``ax`` has a label; nothing otherwise (matplotlib
    would warn "No artists with labels found to put in legend", e.g. a plot of one empty run)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(**kwargs)
