"""Second review of the statistics behind the published results (``mnemo.sweep.stats``, ``recipe``,
``report``): each value against a hand computation on made-up rows, and each defect found as a
test that failed before its fix. Nothing here trains."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from mnemo.sweep.recipe import judge_claim, left_plateau
from mnemo.sweep.report import cell_stats, judge_claims, markdown_table
from mnemo.sweep.stats import mean_interval, t_quantile


def _row(lr, seed, acc, *, status="done", label="gla", seq_len=16, lengths=None, cell=None, loss=None):
    m = {"val_acc": acc, "val_loss": (1.0 - (acc or 0.0)) if loss is None else loss}
    m.update({f"val_acc@{L}": v for L, v in (lengths or {}).items()})
    return {
        "label": label,
        "model": label,
        "cell": {"label": label, **(cell or {})},
        "tuned": {"lr": lr},
        "seed": seed,
        "config": {"seq_len": seq_len, "lr": lr, "seed": seed, "steps": 10},
        "status": status,
        "metrics": m if status == "done" else {},
        "state_size_bytes": 100,
        "n_params": 10,
        "wall_time_s": 1.0,
    }


# ---------------------------------------------------------------------------------------------
# the interval against hand values
# ---------------------------------------------------------------------------------------------


def test_t_critical_values_and_the_interval_by_hand():
    # table values (3 decimals) and the closed forms of df = 1, 2 and 4
    assert round(t_quantile(0.975, 2), 3) == 4.303 and round(t_quantile(0.975, 4), 3) == 2.776
    p = 0.975
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-14)
    a = 4 * p * (1 - p)  # df = 4: t = 2 √(q − 1), q = cos(arccos(√a) / 3) / √a
    q = math.cos(math.acos(math.sqrt(a)) / 3) / math.sqrt(a)
    assert t_quantile(p, 4) == pytest.approx(2 * math.sqrt(q - 1), rel=1e-13)
    # 3 seeds: mean 0.7, s = 0.1, half = t_{.975,2} · 0.1 / √3 = 0.248414 → [0.4516, 0.9484]
    st = mean_interval([0.6, 0.7, 0.8])
    assert st["n"] == 3 and st["mean"] == pytest.approx(0.7, abs=1e-15)
    assert st["std"] == pytest.approx(0.1, rel=1e-12)
    assert (round(st["low"], 4), round(st["high"], 4)) == (0.4516, 0.9484)
    # one seed: a mean, no interval (not a zero-width one)
    one = mean_interval([0.7])
    assert one["mean"] == 0.7 and one["std"] is one["half_width"] is one["low"] is one["high"] is None


def test_the_docstring_example_of_t_quantile_is_the_value_it_returns():
    """``t_quantile``'s docstring gave ``t_quantile(0.975, 2) = 4.302652729911275``, an old
    tabulated value 1.6e-10 off: the function returns the exact 4.302652729749464."""
    shown = float(re.search(r"t_quantile\(0\.975, 2\) = ([0-9.]+)", t_quantile.__doc__).group(1))
    assert shown == pytest.approx(t_quantile(0.975, 2), rel=1e-15)
    assert shown == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-15)


def test_numpy_scalars_are_numbers_to_the_interval():
    """``mean_interval`` refused NumPy ``float32`` values ("must be a finite number, got
    np.float32(0.5)", which is one) and ``t_quantile`` a NumPy integer ``df``."""
    vals = np.array([0.5, 0.75, 1.0], dtype=np.float32)
    st = mean_interval(vals)
    ref = mean_interval([0.5, 0.75, 1.0])
    assert st == ref
    assert t_quantile(0.975, np.int64(2)) == t_quantile(0.975, 2)
    assert mean_interval([np.float64(0.25), np.int64(1)])["mean"] == 0.625
    with pytest.raises(ValueError, match=r"values\[1\] must be a finite number, got np.float32\(nan\)"):
        mean_interval([0.5, np.float32("nan")])
    with pytest.raises(ValueError, match="df must be an int >= 1, got 2.0"):
        t_quantile(0.975, 2.0)


# ---------------------------------------------------------------------------------------------
# a made-up database by hand: selection, divergence, threshold, formatting
# ---------------------------------------------------------------------------------------------


def _db():
    """Seed 0 (held out) is best at lr 1e-3 and diverged at 1e-1; seeds 1-3 would prefer 1e-2;
    seed 4 diverged at 1e-3; seed 5's run failed (retried later)."""
    acc = {
        (1e-3, 0): 0.9,
        (1e-3, 1): 0.61,
        (1e-3, 2): 0.73,
        (1e-3, 3): 0.995,
        (1e-2, 0): 0.5,
        (1e-2, 1): 0.99,
        (1e-2, 2): 0.99,
        (1e-2, 3): 0.99,
    }
    rows = [_row(lr, s, a) for (lr, s), a in acc.items()]
    rows += [_row(1e-1, 0, None, status="diverged"), _row(1e-3, 4, None, status="diverged")]
    rows += [_row(1e-3, 5, None, status="failed")]
    return rows


def test_a_made_up_database_by_hand():
    (c,) = cell_stats(_db(), select_lr_on_seed=0)
    # the held-out seed alone chooses (0.9 at 1e-3 > 0.5 at 1e-2; its diverged 1e-1 run cannot win)
    assert c["tuned"] == {"lr": 1e-3} and c["selection_value"] == 0.9
    # reported: seeds 1-3 at 1e-3, never seed 0; seed 4 diverged (named), seed 5 failed (nowhere)
    assert c["seeds"] == [1, 2, 3] and c["values"] == [0.61, 0.73, 0.995]
    assert (c["n"], c["n_diverged"], c["n_finished"], c["diverged_seeds"]) == (3, 1, 4, [4])
    mean = (0.61 + 0.73 + 0.995) / 3
    s = math.sqrt(((0.61 - mean) ** 2 + (0.73 - mean) ** 2 + (0.995 - mean) ** 2) / 2)
    half = 4.302652729749464 * s / math.sqrt(3)
    assert c["mean"] == pytest.approx(mean, rel=1e-14)
    assert (c["low"], c["high"]) == pytest.approx((mean - half, mean + half), rel=1e-12)
    assert (c["n_reached"], c["n_finished"]) == (1, 4)  # the diverged run did not reach 0.99
    table = markdown_table(_db(), select_lr_on_seed=0)
    ci = f"[{mean - half:.4f}, {mean + half:.4f}] †"  # past 1: marked, not clipped
    runs = "11 (3 failed/diverged) | 11 |"  # every run of the cell: the other rates and seed 0 too
    row = f"| gla | 0.001 | 100 B | 10 | {mean:.4f} | {ci} | 3 (1 diverged) | 1/4 | {runs}"
    assert row in table, table
    # without a held-out seed: the rate with all of its (non-failed) runs done wins, all seeds reported
    (naive,) = cell_stats(_db())
    assert naive["tuned"] == {"lr": 1e-2} and naive["seeds"] == [0, 1, 2, 3]


def test_every_longer_test_length_of_every_cell_gets_its_column():
    """The test-length columns were ``all lengths − every cell's training length``: a sweep over
    ``seq_len: [64, 128]`` lost the 64-token cells' accuracy at 128 (another cell's training length)
    from the table, with no word."""
    rows = [
        _row(1e-3, s, 0.9, seq_len=64, cell={"seq_len": 64}, lengths={128: 0.5 + s / 10}) for s in range(3)
    ]
    rows += [_row(1e-3, s, 0.95, seq_len=128, cell={"seq_len": 128}, lengths={256: 0.6}) for s in range(3)]
    table = markdown_table(rows)
    header = table.split("\n")[0]
    assert "| acc@128 | acc@256 |" in header, header
    st = mean_interval([0.5, 0.6, 0.7])
    line = next(x for x in table.split("\n") if x.startswith("| gla | 64 |"))
    assert f"| {st['mean']:.4f} ± {st['half_width']:.4f} | – |" in line, line


def test_a_float_grid_axis_keeps_its_value_in_the_table():
    """Grid axes were printed with 4 fixed decimals: cells at 1e-5 and 2e-5 both read 0.0000."""
    rows = [_row(1e-3, 0, 0.5, cell={"weight_decay": 1e-5}), _row(1e-3, 0, 0.6, cell={"weight_decay": 2e-5})]
    table = markdown_table(rows)
    assert "| gla | 1e-05 |" in table and "| gla | 2e-05 |" in table, table


# ---------------------------------------------------------------------------------------------
# the plateau and the claims
# ---------------------------------------------------------------------------------------------


def test_a_rise_of_exactly_the_margin_leaves_the_plateau():
    """0.25 → 0.35 rose by exactly ``ACC_RISE`` = 0.1, but 0.35 − 0.25 = 0.09999999999999998 in
    floats: the run was called "still on its plateau" and the claim made untestable."""
    assert left_plateau([{"val_acc": 0.25}, {"val_acc": 0.25}, {"val_acc": 0.35}], "val_acc", 0.99) is True
    assert left_plateau([{"val_acc": 0.25}, {"val_acc": 0.25}, {"val_acc": 0.34}], "val_acc", 0.99) is False
    # a loss: 5% of the level below it (0.7 → 0.665), and just short of it
    assert left_plateau([{"val_loss": 0.7}, {"val_loss": 0.7}, {"val_loss": 0.665}], "val_loss") is True
    assert left_plateau([{"val_loss": 0.7}, {"val_loss": 0.7}, {"val_loss": 0.666}], "val_loss") is False


def test_a_claim_names_the_seeds_a_divergence_left_out():
    """A diverged run has no value, so its seed silently dropped out of the paired difference: a
    claim "a beats b" was judged on the seeds where ``a`` did not diverge, and nothing said so."""
    rows = [_row(1e-3, s, v, label="a") for s, v in zip([1, 2, 3], [0.9, 0.92, 0.95])]
    rows += [_row(1e-3, 4, None, label="a", status="diverged")]
    rows += [_row(1e-3, s, v, label="b") for s, v in zip([1, 2, 3, 4], [0.5, 0.55, 0.45, 0.5])]
    cells = cell_stats(rows)
    (j,) = judge_claims([{"name": "a beats b", "better": "a", "than": "b"}], cells, "val_acc", 0.99)
    assert j["seeds"] == [1, 2, 3] and j["verdict"] == "reproduced"
    d = [0.4, 0.37, 0.5]
    st = mean_interval(d)
    assert (j["mean"], j["low"], j["high"]) == pytest.approx((st["mean"], st["low"], st["high"]), rel=1e-12)
    assert j["why"].endswith("left out of the pairs: a seed(s) [4] diverged"), j["why"]
    # without a divergence nothing is added
    clean = judge_claim(
        {"name": "x", "better": "a", "than": "b"},
        {"seeds": [1, 2, 3], "values": [0.9, 0.92, 0.95]},
        {"seeds": [1, 2, 3], "values": [0.5, 0.55, 0.45]},
        metric="val_acc",
        threshold=0.99,
    )
    assert "diverged" not in clean["why"]


def test_a_done_run_without_a_finite_metric_is_named_not_silently_dropped():
    """A ``done`` run whose metric is missing or not finite (a NaN ``val_loss``) was left out of the
    mean with no word: ``n`` read 2 beside 3 runs, and a loss table has no threshold column to show
    the 3 finished runs."""
    rows = [_row(1e-3, s, 0.5, loss=v) for s, v in [(0, 1.0), (1, 1.2), (2, float("nan"))]]
    rows.append(_row(1e-3, 3, None, status="diverged"))
    (c,) = cell_stats(rows, "val_loss")
    assert (c["n"], c["n_finished"], c["n_diverged"]) == (2, 4, 1) and c["mean"] == pytest.approx(1.1)
    table = markdown_table(rows, "val_loss")
    assert "| 1.1000 | [-0.1706, 2.3706] | 2 (1 diverged, 1 without val_loss) |" in table, table


def test_the_report_text_says_the_held_out_seed_is_left_out_when_nothing_was_tuned(tmp_path, monkeypatch):
    """A sweep with one learning rate and ``select_lr_on_seed: 0`` (or ``mnemo report
    --select-lr-on-seed 0``) reports seeds 1-3 only, but its text said "every run of a cell is
    reported"."""
    import mnemo.sweep.runner as runner_mod
    from mnemo.sweep import SweepSpec, run_sweep, write_report
    from tests.tasks.test_sweep_seeds import BASE, _fake_run_one

    acc = {(1e-3, s): v for s, v in enumerate([0.9, 0.6, 0.7, 0.8])}
    monkeypatch.setattr(runner_mod, "run_one", _fake_run_one(acc, []))
    d = {"name": "one", "base": BASE, "models": ["gla"], "grid": {"lr": [1e-3]}, "seeds": 4}
    spec = SweepSpec.from_dict({**d, "select_lr_on_seed": 0})
    run_sweep(spec, tmp_path / "db.sqlite", tmp_path / "runs", progress=False, log=lambda s: None)
    rep = write_report(tmp_path / "db.sqlite", tmp_path / "rep", plots=False)["one"]
    (c,) = rep["cells"]
    assert c["seeds"] == [1, 2, 3] and c["mean"] == pytest.approx(0.7)
    assert "every run of a cell is reported" not in rep["markdown"]
    assert "held-out seed 0 is never reported" in rep["markdown"]


def test_a_loss_sweeps_state_plot_shows_its_values(tmp_path):
    """The recall-vs-state plot fixed every panel's y range to [−0.02, 1.02]: a ``val_loss`` sweep's
    means (nats, e.g. 2.1) were drawn off the chart, so the published figures of the loss sweeps
    (docs/results/moe/moe_acc_vs_state.png) were empty axes."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.sweep.report import plot_accuracy_vs_state

    rows = [_row(1e-3, s, 0.5, loss=v) for s, v in enumerate([2.1, 2.3, 2.2])]
    _, fig = plot_accuracy_vs_state(rows, tmp_path / "s.png", "val_loss", return_figure=True)
    try:
        (ax,) = fig.axes
        lo, hi = ax.get_ylim()
        assert lo < 2.2 - 0.2484 and hi > 2.2 + 0.2484  # the mean and its interval (±0.2484) in view
    finally:
        plt.close(fig)
    _, fig = plot_accuracy_vs_state(rows, tmp_path / "a.png", "val_acc", return_figure=True)
    try:
        assert fig.axes[0].get_ylim() == pytest.approx((-0.02, 1.02))  # accuracies keep [0, 1]
    finally:
        plt.close(fig)


def test_an_edited_sweeps_old_seeds_are_not_reported_at_the_new_versions_choice(tmp_path, monkeypatch):
    """The sweep file changed ``base.steps`` and ran again under the same name; only its held-out
    seed 0 had finished. ``mnemo report`` reported seeds 1-3 *of the earlier version* at the rate
    the new version's seed 0 chose (mean 0.54 of the 4-step runs: one row over two
    configurations), and its warning said only the 2 duplicated seed-0 runs were left out."""
    import mnemo.sweep.runner as runner_mod
    from mnemo.sweep import SweepSpec, run_sweep, write_report
    from tests.tasks.test_sweep_seeds import BASE

    def fake(config, run_dir, threads=None):
        a = {4: 0.5, 8: 0.9}[config["steps"]] + 0.01 * config.get("seed", 0)
        a += 0.02 if config["lr"] == 1e-3 else 0.0
        return {"status": "done", "metrics": {"val_acc": a, "val_loss": 1 - a}, "wall_time_s": 1.0}

    monkeypatch.setattr(runner_mod, "run_one", fake)
    d = {"name": "s", "models": ["gla"], "grid": {"lr": [1e-3, 1e-2]}}
    old = SweepSpec.from_dict({**d, "base": {**BASE, "steps": 4}, "seeds": 4})
    new_seed0 = SweepSpec.from_dict({**d, "base": {**BASE, "steps": 8}})  # = seed 0 of `seeds: 4`
    db = tmp_path / "db.sqlite"
    for spec in (old, new_seed0):
        run_sweep(spec, db, tmp_path / "runs", progress=False, log=lambda s: None)
    with pytest.warns(UserWarning, match="8 run"):
        rep = write_report(db, tmp_path / "rep", plots=False, select_lr_on_seed=0)["s"]
    (c,) = rep["cells"]
    assert c["tuned"] == {"lr": 1e-3} and c["selection_value"] == pytest.approx(0.92)
    assert c["n"] == 0 and c["values"] == [], "only the held-out seed of the 8-step version has run"
    assert c["n_superseded"] == 8 and c["status"] == "no other seed finished at lr=0.001"
    # one version only: nothing is left out, every seed reported
    (c,) = write_report(
        db, tmp_path / "rep2", plots=False, sweep="s", run_ids={r.run_id for r in old.runs()}
    )["s"]["cells"]
    assert c["n_superseded"] == 0 and c["seeds"] == [0, 1, 2, 3]
