"""The time-scale figure puts layer ``j`` (in the result's order) at the x tick labelled with it:
its box (median line), its "no decay" note and its CMS periods all at that tick, inside the axes."""

from __future__ import annotations

import pytest

from mnemo.interp.timescales import figure

pytest.importorskip("matplotlib")


def _hl(lo, p10, med, p90, hi):
    return {"count": 5, "never_decays": 0, "min": lo, "p10": p10, "median": med, "p90": p90, "max": hi}


def test_each_layer_is_drawn_at_its_own_tick():
    import matplotlib.pyplot as plt

    result = {
        "0": {"mixer": "GatedLinearAttention", "kind": "per-channel", "half_life": _hl(0.5, 2, 7, 40, 300)},
        "1": {"mixer": "Attention", "kind": "no decay", "cms_periods": [4, 16]},
        "2": {"mixer": "Mamba", "kind": "per-channel", "half_life": _hl(1, 3, 11, 50, 90)},
    }
    fig = figure(result)
    try:
        ax = fig.axes[0]
        ticks = {t.get_text().split("\n")[0]: x for t, x in zip(ax.get_xticklabels(), ax.get_xticks())}
        assert ticks == {"L0": 1, "L1": 2, "L2": 3}
        lo, hi = ax.get_xlim()

        def x_of_line(ys):  # the x centre of the (horizontal or vertical) line through exactly ys
            for line in ax.lines:
                if [float(y) for y in line.get_ydata()] == ys:
                    return sum(float(x) for x in line.get_xdata()) / len(line.get_xdata())
            raise AssertionError(f"no line with y = {ys}")

        for layer, med in (("L0", 7.0), ("L2", 11.0)):  # the median line of each box
            assert x_of_line([med, med]) == pytest.approx(ticks[layer])
            assert lo < ticks[layer] < hi
        assert x_of_line([4.0, 16.0]) == pytest.approx(ticks["L1"])  # the CMS periods
        (note,) = [t for t in ax.texts if t.get_text() == "no decay"]
        assert note.get_position()[0] == pytest.approx(ticks["L1"])
    finally:
        plt.close(fig)
