"""Titles that fit their figure: shared by the circuit, time-scale and spectrum figures (a module
of its own, so that the figure modules need not import one another)."""

from __future__ import annotations

import textwrap


def fit_text(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped to lines that fit ``width_in`` inches at ``fontsize`` points (a title is cut
    by the figure's edge, never shrunk, when one line is wider than the figure)."""
    chars = max(20, int(width_in * 72 / (0.62 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.splitlines())
