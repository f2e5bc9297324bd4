"""Fifth break-it review of the recall tasks, the task metrics and the statistics behind claims."""

from __future__ import annotations

import pytest

import mnemo.data.tasks as tasks
from mnemo.sweep import SweepSpec
from mnemo.sweep.recipe import recipe_problems
from mnemo.sweep.stats import mean_interval, t_quantile

# --------------------------------------------------------------------------------------------
# the recipe's learning-rate span
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [[3e-5, 1e-4, 3e-4], [1.1e-3, 3e-3, 1.1e-2], [0.07, 0.2, 0.7]])
def test_a_grid_spanning_exactly_ten_times_meets_the_standard(grid):
    """3e-5 … 3e-4 spans 10x, but 3e-4 / 3e-5 is 9.999999999999998 in floats: the standard refused
    the grid with "spans 10x ...; the standard needs >= 10x"."""
    assert grid[-1] / grid[0] < 10  # the float ratio this is about
    assert recipe_problems(grid, [0, 1, 2, 3], 0) == []
    spec = SweepSpec.from_dict(
        {
            "name": "span",
            "base": {"task": "mqar", "task_options": {"num_pairs": 2, "vocab_size": 16}, "seq_len": 16},
            "models": ["gla"],
            "grid": {"lr": grid},
            "seeds": 4,
            "select_lr_on_seed": 0,
            "recipe": "standard",
        }
    )
    assert spec.recipe == "standard"
    # a grid short of the span is still refused
    assert recipe_problems([1e-4, 3e-4, 9.99e-4], [0, 1, 2, 3], 0) == [
        "'grid.lr' spans 9.99x (0.0001 … 0.000999); the standard needs >= 10x"
    ]


# --------------------------------------------------------------------------------------------
# Student-t with one degree of freedom (two seeds)
# --------------------------------------------------------------------------------------------


def test_the_t_quantile_of_one_degree_of_freedom_holds_its_stated_accuracy():
    """df = 1 (the interval of two seeds) is the Cauchy quantile tan(π(p − ½)); the bisection on
    θ near π/2 returned 63.65674116287316 at p = 0.995, 2.6e-14 off, where the docstring promises
    6e-15 (reference values to 22 digits from mpmath)."""
    exact = {
        0.9: 3.077683537175254133079,
        0.975: 12.7062047361746933141,
        0.99: 31.82051595377392975844,
        0.995: 63.65674116287152444716,
    }
    for p, t in exact.items():
        assert t_quantile(p, 1) == pytest.approx(t, rel=6e-15, abs=0)
        assert t_quantile(1 - p, 1) == pytest.approx(-t, rel=1e-13, abs=0)
    assert t_quantile(0.5, 1) == 0.0
    assert t_quantile(0.75, 1) == pytest.approx(1.0, rel=1e-15)
    # two seeds 1 and 2 at 99%: mean 1.5, std 1/√2, half width t · std / √2 = t / 2
    st = mean_interval([1.0, 2.0], confidence=0.99)
    assert st["half_width"] == pytest.approx(exact[0.995] / 2, rel=6e-15, abs=0)


# --------------------------------------------------------------------------------------------
# the task registry's exports
# --------------------------------------------------------------------------------------------


def test_every_registered_task_class_is_exported():
    """``__all__`` listed every task class but RepeatSegment (``from mnemo.data.tasks import *``
    left it out)."""
    for cls in tasks.TASKS.values():
        assert cls.__name__ in tasks.__all__
        assert getattr(tasks, cls.__name__) is cls
