"""Third review (regressions of the day's fixes in layers, memory, interp, ssd and probe): each test
pins something the day's changes broke that worked before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mnemo.interp.scores import repeated_random_tokens


@pytest.mark.parametrize("bos", [None, 1])
@pytest.mark.parametrize("offset", [np.int64(3), np.int32(3), torch.tensor(3)])
def test_repeated_random_tokens_takes_any_integer_offset_as_before(offset, bos):
    """The new offset check (``isinstance(offset, int)``) refused a numpy or 0-d tensor integer,
    which ``torch.randint`` took before: the same tokens as the plain int, drawn from ``3 … 9``."""
    want = repeated_random_tokens(4, 16, 10, torch.Generator().manual_seed(0), offset=3, bos=bos)
    got = repeated_random_tokens(4, 16, 10, torch.Generator().manual_seed(0), offset=offset, bos=bos)
    assert torch.equal(got, want)
    body = got if bos is None else got[:, 1:]
    assert int(body.min()) >= 3 and int(body.max()) <= 9 and (bos is None or not (body == bos).any())


@pytest.mark.parametrize("bad", [True, 1.0, -1, np.int64(-2), "3"])
def test_repeated_random_tokens_still_refuses_a_bad_offset_by_name(bad):
    with pytest.raises(ValueError, match=r"offset: expected the first token id drawn.*got"):
        repeated_random_tokens(2, 4, 10, offset=bad)


def test_spectrum_flow_axis_names_what_it_plots():
    """The right panel now plots intermediate + marginal + relevant (not 1 − irrelevant), but its
    axis still read "share of directions not irrelevant": with half the directions unresolved the
    plotted 0.25 is not the share that is not irrelevant (0.75)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.interp.probe import spectrum_flow_figure

    shares = {"irrelevant": 0.25, "intermediate": 0.125, "marginal": 0.0625, "relevant": 0.0625}
    fig = spectrum_flow_figure(
        [{"step": 1, "spectrum_by_memory": {"0": {**shares, "median_half_life": 2.0}}}]
    )
    try:
        right = fig.axes[1]
        (line,) = right.get_lines()
        assert list(line.get_ydata()) == pytest.approx([0.25], abs=1e-15)
        label = right.get_ylabel()
        assert "not irrelevant" not in label
        assert all(c in label for c in ("intermediate", "marginal", "relevant"))
    finally:
        plt.close(fig)
