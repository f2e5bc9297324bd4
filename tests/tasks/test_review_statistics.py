"""A hostile statistician's review of the evidence machinery (``mnemo.sweep.stats``, ``recipe``,
``report``, ``reproduce``): each formula against an independent computation, and each defect the
review found as a test that failed before its fix."""

from __future__ import annotations

import json
import math

import pytest
import yaml

import mnemo.sweep.runner as runner_mod
from mnemo.sweep.recipe import judge_claim, left_plateau
from mnemo.sweep.report import judge_claims_at_lengths
from mnemo.sweep.reproduce import reproduce_page
from mnemo.sweep.stats import mean_interval, t_quantile
from tests.tasks.test_sweep_seeds import BASE


def _t_pdf(x: float, df: int) -> float:
    return math.exp(
        math.lgamma((df + 1) / 2)
        - math.lgamma(df / 2)
        - 0.5 * math.log(df * math.pi)
        - (df + 1) / 2 * math.log1p(x * x / df)
    )


def _t_mass(t: float, df: int, n: int = 2000) -> float:
    """``P(0 < T < t)`` by Simpson's rule on ``x = √df · tan θ`` (a smooth, bounded integrand)."""
    top = math.atan(t / math.sqrt(df))
    h = top / n

    def g(th):
        return _t_pdf(math.sqrt(df) * math.tan(th), df) * math.sqrt(df) / math.cos(th) ** 2

    return h / 3 * (g(0) + g(top) + sum((4 if i % 2 else 2) * g(i * h) for i in range(1, n)))


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 10, 19, 30, 31, 60])
def test_the_t_quantile_holds_its_probability_by_quadrature(df):
    # independent of the closed forms the module uses: integrate Student's density itself
    for p in (0.9, 0.975, 0.995):
        assert _t_mass(t_quantile(p, df), df) == pytest.approx(p - 0.5, abs=1e-9)


def test_the_interval_of_a_mean_by_hand():
    # t_{0.975, 4} = 2.7764451051977987 (tables: 2.776); s of 1..5 = √2.5
    st = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)
    assert (st["mean"], st["low"], st["high"]) == pytest.approx((3.0, 3.0 - half, 3.0 + half), rel=1e-12)
    # n = 2: one degree of freedom, t = 12.706, not 1.96
    st = mean_interval([0.2, 0.4])
    assert st["half_width"] == pytest.approx(12.706204736174707 * math.sqrt(0.02) / math.sqrt(2), rel=1e-12)
    # identical values: no spread, a zero-width interval at the value (not an error, not None)
    st = mean_interval([0.5, 0.5, 0.5])
    assert (st["std"], st["low"], st["high"]) == (0.0, 0.5, 0.5)


def test_a_single_evaluation_cannot_say_a_run_is_still_on_its_plateau():
    """One point has no plateau to measure a rise from: a run evaluated once at 0.95 (far above
    MQAR's 0.25 of guessing) was called "still on its plateau", so its claims were not testable.
    (Review 4: 0.95 lies within ACC_RISE of the 0.99 threshold, so it left before that evaluation.)"""
    assert left_plateau([{"step": 100, "val_acc": 0.95}], "val_acc", 0.99) is True
    assert left_plateau([{"step": 100, "val_acc": 0.55}], "val_acc", 0.99) is None
    assert left_plateau([{"step": 100, "val_loss": 0.3}], "val_loss") is None
    # ... unless that one value reached the threshold
    assert left_plateau([{"step": 100, "val_acc": 0.995}], "val_acc", 0.99) is True
    assert left_plateau([{"step": 100, "val_loss": 0.3}], "val_loss", 0.5) is True
    # an unknown flag does not make the claim untestable; a False one still does
    claim = {"name": "a beats b", "better": "a", "than": "b"}
    a = {"seeds": [1, 2, 3], "values": [0.95, 0.9, 0.92], "plateau": [None] * 3}
    b = {"seeds": [1, 2, 3], "values": [0.5, 0.55, 0.45], "plateau": [True] * 3}
    assert judge_claim(claim, a, b, metric="val_acc", threshold=0.99)["verdict"] == "reproduced"


def _at_length_cell(label, train, long):
    return {
        "label": label,
        "cell": {"label": label},
        "seq_len": 64,
        "seeds": [1, 2, 3],
        "values": train,
        "plateau": [True] * 3,
        "at_length": {256: {"seeds": [1, 2, 3], "values": long}},
    }


def test_claims_at_longer_lengths_of_a_loss_report_keep_the_ceiling_rule():
    """A ``val_loss`` report judges its claims at longer lengths on ``val_acc``; the loss's
    threshold (none) was passed on, so two models at 1.0 / 0.995 there were judged "no difference"
    where an accuracy report says the task cannot separate them."""
    cells = [
        _at_length_cell("a", [1.2, 1.3, 1.1], [1.0, 1.0, 1.0]),
        _at_length_cell("b", [1.4, 1.5, 1.6], [1.0, 0.995, 1.0]),
    ]
    claim = [{"name": "a beats b", "better": "a", "than": "b"}]
    (acc,) = judge_claims_at_lengths(claim, cells, "val_acc", 0.99)
    (loss,) = judge_claims_at_lengths(claim, cells, "val_loss", None)
    assert acc["verdict"] == loss["verdict"] == "not testable here"
    assert "reached val_acc ≥ 0.99" in loss["why"]
    # a given accuracy threshold is kept
    (j,) = judge_claims_at_lengths(claim, cells, "val_acc", 0.999)
    assert j["verdict"] == "not reproduced"


def test_a_rebuild_without_running_judges_the_claims_the_sweep_file_makes_now(tmp_path, monkeypatch):
    """``mnemo reproduce PAGE --no-run`` reported the claims (and held-out seed, seeds) stored in
    the database when the sweep last ran, not the file's: a claim added to the file since was
    silently missing from the rebuilt page that says it was generated from that file."""
    acc = {"gla": [0.9, 0.8, 0.85, 0.9], "retnet": [0.5, 0.4, 0.5, 0.45]}

    def run_one(config, run_dir, threads=None):
        a = acc[config["model"]][config.get("seed", 0)] * (1.0 if config["lr"] == 1e-3 else 0.5)
        return {
            "status": "done",
            "metrics": {"val_acc": a, "val_loss": 1 - a, "curve": [{"val_acc": 0.1}, {"val_acc": a}]},
            "state_size_bytes": 256,
            "n_params": 10,
            "wall_time_s": 0.5,
        }

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner_mod, "run_one", run_one)
    sweep = {
        "name": "tiny",
        "base": BASE,
        "models": ["gla", "retnet"],
        "grid": {"lr": [1e-3, 1e-2]},
        "seeds": 4,
        "select_lr_on_seed": 0,
    }
    config = tmp_path / "configs" / "tiny.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump(sweep))
    page = tmp_path / "docs" / "results" / "tiny.md"
    page.parent.mkdir(parents=True)
    page.write_text("# Tiny\n\n<!-- mnemo:reproduce configs/tiny.yaml -->\n")
    reproduce_page(page, progress=False, log=lambda s: None)
    assert "### claims" not in page.read_text()
    config.write_text(
        yaml.safe_dump({**sweep, "claims": [{"name": "gating", "better": "gla", "than": "retnet"}]})
    )
    res = reproduce_page(page, run=False, progress=False, log=lambda s: None)
    text = page.read_text()
    assert "### claims" in text and "| gating | gla | retnet | 3 |" in text and "**reproduced**" in text
    (claim,) = json.loads((tmp_path / "docs" / "results" / "tiny" / "tiny.json").read_text())["claims"]
    assert claim["seeds"] == [1, 2, 3] and claim["differences"] == pytest.approx([0.4, 0.35, 0.45])
    assert res["tiny"]["report"]["cells"][0]["selected_on_seed"] == 0
