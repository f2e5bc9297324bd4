"""The recipe standard (issue 39 item 1): a standard sweep is refused below it, a run's curve
says whether it left the initial plateau, and each claim gets one of three verdicts from a paired
interval computed by hand here."""

from __future__ import annotations

import json
import math

import pytest

import mnemo.sweep.runner as runner_mod
from mnemo.sweep import SweepSpec, cell_stats, run_sweep, write_report
from mnemo.sweep.recipe import judge_claim, left_plateau, recipe_problems
from mnemo.sweep.stats import t_quantile

BASE = {
    "task": "mqar",
    "task_options": {"num_pairs": 2, "vocab_size": 16},
    "seq_len": 16,
    "batch_size": 4,
    "steps": 4,
    "eval_interval": 2,
    "eval_batches": 1,
    "model_overrides": {"d_model": 16, "n_layers": 1},
}
STANDARD = {"grid": {"lr": [1e-3, 3e-3, 1e-2]}, "seeds": 4, "select_lr_on_seed": 0, "recipe": "standard"}


def _spec(**kw) -> SweepSpec:
    d = {"name": "recipe", "base": BASE, "models": ["gla", "retnet"], **STANDARD}
    d.update(kw)
    return SweepSpec.from_dict(d)


def test_a_standard_sweep_meets_the_standard_or_is_refused_naming_what_lacks():
    assert _spec().recipe == "standard"
    for change, said in (
        ({"grid": {"lr": [1e-3, 1e-2]}}, "'grid.lr' has 2 distinct value(s); the standard needs >= 3"),
        (
            {"grid": {"lr": [1e-3, 2e-3, 4e-3]}},
            "'grid.lr' spans 4x (0.001 … 0.004); the standard needs >= 10x",
        ),
        ({"seeds": 3}, "'seeds' leaves 2 reported seed(s) besides the held-out one"),
        ({"select_lr_on_seed": None}, "'select_lr_on_seed' is not set"),
    ):
        with pytest.raises(ValueError, match="'recipe: standard' is not met") as e:
            _spec(**change)
        assert said in str(e.value)
    assert recipe_problems([1e-3, 3e-3, 1e-2], [0, 1, 2, 3], 0) == []
    assert recipe_problems(None, [0, 1, 2, 3], 0) == [
        "'grid' has no tuned 'lr' axis: every model needs its own learning rate"
    ]
    with pytest.raises(ValueError, match="'recipe' must be 'standard'"):
        _spec(recipe="loose")


def test_each_model_may_tune_its_own_learning_rates_under_a_held_out_seed():
    """Every model entry with its own ``grid: {lr: [...]}`` and no top-level lr axis: the held-out
    seed selects on those axes (it was refused: "needs a tuned grid axis ... grid keys []"), the
    standard holds each entry's axis to the rules, and the top level is not asked for one."""
    own = [
        {"model": "gla", "grid": {"lr": [1e-3, 3e-3, 1e-2]}},
        {"model": "retnet", "grid": {"lr": [3e-3, 1e-2, 3e-2]}},
    ]
    spec = _spec(models=own, grid={})
    runs = spec.runs()
    by = {}
    for r in runs:
        by.setdefault(r.label, set()).add(r.tuned["lr"])
    assert by == {"gla": {1e-3, 3e-3, 1e-2}, "retnet": {3e-3, 1e-2, 3e-2}} and len(runs) == 24
    own[1]["grid"] = {"lr": [1e-2, 3e-2]}
    with pytest.raises(ValueError, match="'recipe: standard' is not met") as e:
        _spec(models=own, grid={})
    assert "'models[retnet].grid.lr' has 2 distinct value(s)" in str(e.value)
    assert "'grid' has no tuned 'lr' axis" not in str(e.value)
    # a model without an lr axis of its own still needs the top-level one
    with pytest.raises(ValueError, match="needs a tuned grid axis|has no tuned 'lr' axis"):
        _spec(models=[own[0], "retnet"], grid={})


def test_claims_name_labels_of_the_sweep():
    spec = _spec(claims=[{"better": "gla", "than": "retnet"}])
    assert spec.claims == [{"name": "gla beats retnet", "better": "gla", "than": "retnet"}]
    assert spec.meta()["claims"] == spec.claims
    with pytest.raises(ValueError, match=r"claims\[0\].than must be a model label of the sweep"):
        _spec(claims=[{"better": "gla", "than": "mamba"}])
    with pytest.raises(ValueError, match="compares 'gla' with itself"):
        _spec(claims=[{"better": "gla", "than": "gla"}])


def test_left_plateau_on_known_curves():
    flat = [{"step": s, "val_acc": 0.02 + 0.01 * (s % 2)} for s in range(0, 100, 10)]
    assert left_plateau(flat, "val_acc") is False  # 0.02..0.03: never rose by 0.1
    rose = flat + [{"step": 100, "val_acc": 0.4}]
    assert left_plateau(rose, "val_acc") is True
    # a run whose first evaluation already sits at the ceiling has left it too
    assert left_plateau([{"step": 2, "val_acc": 0.995}, {"step": 4, "val_acc": 0.996}], "val_acc", 0.99)
    # MQAR's curve (zoology_equal_state, Mamba-2 seed 2): a first evaluation below the plateau of
    # guessing (0.16), then 0.24-0.28 for 900 steps: on the plateau, though 0.28 - 0.16 > 0.1
    mqar = [0.1592, 0.2393, 0.2605, 0.2637, 0.2610, 0.2683, 0.2666, 0.2700, 0.2734, 0.2805]
    assert left_plateau([{"val_acc": v} for v in mqar], "val_acc", 0.99) is False
    # the same start, then learning (gated DeltaNet seed 1 of that sweep): left it
    learnt = [0.1938, 0.2378, 0.2534, 0.2673, 0.4771, 0.6987, 0.8394, 0.9102, 0.9246, 0.9258]
    assert left_plateau([{"val_acc": v} for v in learnt], "val_acc", 0.99) is True
    # losses: down by 5% of the plateau's level (here the first value)
    assert left_plateau([{"val_loss": 2.0}, {"val_loss": 1.91}], "val_loss") is False
    assert left_plateau([{"val_loss": 2.0}, {"val_loss": 1.89}], "val_loss") is True
    assert (
        left_plateau([], "val_acc") is None and left_plateau([{"val_acc": float("nan")}], "val_acc") is None
    )


def _cell(seeds, values, plateau=None):
    return {"seeds": seeds, "values": values, "plateau": plateau or [True] * len(seeds)}


def test_each_verdict_from_a_paired_interval_computed_by_hand():
    claim = {"name": "a beats b", "better": "a", "than": "b"}
    a = _cell([1, 2, 3], [0.80, 0.80, 0.93])
    b = _cell([1, 2, 3, 4], [0.60, 0.65, 0.75, 0.10])  # seed 4 is not paired
    j = judge_claim(claim, a, b, metric="val_acc", threshold=0.99)
    d = [0.20, 0.15, 0.18]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = t_quantile(0.975, 2) * sd / math.sqrt(3)
    assert j["seeds"] == [1, 2, 3] and j["differences"] == pytest.approx(d)
    assert (j["mean"], j["low"], j["high"]) == pytest.approx((mean, mean - half, mean + half))
    assert j["verdict"] == "reproduced" and mean - half > 0
    # the same values the other way round: the opposite is significant
    j = judge_claim({**claim, "better": "b", "than": "a"}, b, a, metric="val_acc", threshold=0.99)
    assert j["verdict"] == "not reproduced" and "the opposite holds" in j["why"]
    # a noisy difference: the interval contains 0
    j = judge_claim(
        claim,
        _cell([1, 2, 3], [0.8, 0.5, 0.7]),
        _cell([1, 2, 3], [0.6, 0.7, 0.6]),
        metric="val_acc",
        threshold=0.99,
    )
    assert j["verdict"] == "not reproduced" and "contains 0" in j["why"]
    # val_loss: lower is better, so a positive difference still favours `better`
    j = judge_claim(
        claim,
        _cell([1, 2, 3], [1.0, 1.1, 0.9]),
        _cell([1, 2, 3], [1.5, 1.4, 1.6]),
        metric="val_loss",
        threshold=None,
    )
    assert j["differences"] == pytest.approx([0.5, 0.3, 0.7]) and j["verdict"] == "reproduced"


def test_what_cannot_tell_the_claim_from_its_negation_is_not_testable_here():
    claim = {"name": "a beats b", "better": "a", "than": "b"}
    j = judge_claim(
        claim, _cell([1, 2], [0.9, 0.8]), _cell([1, 2], [0.1, 0.2]), metric="val_acc", threshold=0.99
    )
    assert j["verdict"] == "not testable here" and "2 paired seed(s) (< 3)" in j["why"]
    stuck = _cell([1, 2, 3], [0.9, 0.05, 0.8], plateau=[True, False, True])
    j = judge_claim(claim, stuck, _cell([1, 2, 3], [0.1, 0.1, 0.1]), metric="val_acc", threshold=0.99)
    assert (
        j["verdict"] == "not testable here" and "a seed(s) [2] did not leave the initial plateau" in j["why"]
    )
    top = _cell([1, 2, 3], [0.995, 0.999, 1.0])
    j = judge_claim(claim, top, _cell([1, 2, 3], [0.991, 0.992, 0.99]), metric="val_acc", threshold=0.99)
    assert j["verdict"] == "not testable here" and "cannot separate them" in j["why"]


def test_claims_through_the_sweep_and_its_report(tmp_path, monkeypatch):
    """gla beats retnet by 0.2 at every reported seed (lr chosen on seed 0); retnet's seed 3 never
    left its plateau in the second claim's sweep: the report says so instead of a verdict."""
    acc = {"gla": [0.8, 0.7, 0.75, 0.9], "retnet": [0.6, 0.5, 0.55, 0.7]}

    def run_one(config, run_dir, threads=None):
        a = acc[config["model"]][config.get("seed", 0)] * (1.0 if config["lr"] == 3e-3 else 0.5)
        curve = [{"step": 2, "val_acc": 0.02}, {"step": 4, "val_acc": a}]
        return {
            "status": "done",
            "metrics": {"val_acc": a, "val_loss": 1 - a, "curve": curve},
            "state_size_bytes": 256,
            "n_params": 10,
            "wall_time_s": 0.5,
        }

    monkeypatch.setattr(runner_mod, "run_one", run_one)
    spec = _spec(claims=[{"name": "gating", "better": "gla", "than": "retnet"}])
    db = tmp_path / "s.sqlite"
    run_sweep(spec, db, tmp_path / "runs", progress=False, log=lambda s: None)
    res = write_report(db, tmp_path / "rep", plots=False)["recipe"]
    cells = {c["label"]: c for c in res["cells"]}
    assert cells["gla"]["tuned"] == {"lr": 3e-3} and cells["gla"]["seeds"] == [1, 2, 3]
    assert cells["gla"]["plateau"] == [True, True, True] and cells["gla"]["budget_steps"] == 4
    saved = json.loads((tmp_path / "rep" / "recipe.json").read_text())
    (claim,) = saved["claims"]
    assert claim["verdict"] == "reproduced" and claim["differences"] == pytest.approx([0.2, 0.2, 0.2])
    assert "### claims" in res["markdown"] and "**reproduced**" in res["markdown"]
    assert saved["recipe"] == "standard"
    # the same sweep where retnet's seed 3 stays on the plateau
    acc["retnet"][3] = 0.021
    rows = [dict(r) for r in __import__("mnemo.sweep", fromlist=["SweepDB"]).SweepDB(db).rows("recipe")]
    for r in rows:
        if r["label"] == "retnet" and r["seed"] == 3:
            r["metrics"] = {
                **r["metrics"],
                "val_acc": 0.021,
                "curve": [{"val_acc": 0.02}, {"val_acc": 0.021}],
            }
    from mnemo.sweep.report import judge_claims

    cells = cell_stats(rows, select_lr_on_seed=0)
    (claim,) = judge_claims(spec.claims, cells, "val_acc", 0.99)
    assert claim["verdict"] == "not testable here" and "retnet seed(s) [3]" in claim["why"]


def test_the_standard_configs_meet_the_standard():
    """Every sweep under configs/standard/ loads (each run's config validated) with ``recipe:
    standard`` and at least one claim to judge."""
    from pathlib import Path

    files = sorted((Path(__file__).parents[2] / "configs" / "standard").glob("*.yaml"))
    assert files
    for f in files:
        spec = SweepSpec.load(f)
        assert spec.recipe == "standard" and spec.claims, f


def test_a_model_entry_may_carry_its_own_grid_axes():
    """M3's eps is tuned for M3 only: AdamW's runs are not tripled by an axis they ignore, and an
    entry's own lr values replace the sweep's for that model."""
    spec = _spec(
        models=[
            "gla",
            {"label": "gla-m3", "model": "gla", "optimizer": "m3", "grid": {"m3_eps": [1e-3, 1e-2]}},
        ],
        tune=["lr", "m3_eps"],
    )
    runs = spec.runs()
    plain = [r for r in runs if r.label == "gla"]
    m3 = [r for r in runs if r.label == "gla-m3"]
    assert len(plain) == 3 * 4 and len(m3) == 3 * 2 * 4
    assert all("m3_eps" not in r.tuned for r in plain) and {r.tuned["m3_eps"] for r in m3} == {1e-3, 1e-2}
    assert all(r.config["m3_eps"] == r.tuned["m3_eps"] and "grid" not in r.config for r in m3)
    assert len({r.cell_key for r in runs}) == 2  # the eps is tuned: not part of the cell
    with pytest.raises(ValueError, match="'grid' must map keys to non-empty lists"):
        _spec(models=[{"label": "x", "model": "gla", "grid": {"m3_eps": []}}]).runs()


def test_claims_are_also_judged_at_each_longer_test_length(tmp_path, monkeypatch):
    """A ``val_seq_acc`` sweep with ``eval_lengths``: the table's length columns are exact match
    (``seq_acc@L``), and each claim is judged again at every longer length on the same runs,
    with the paired differences computed here by hand: at the training length both models sit at
    the ceiling (not testable here); at 64 tokens yarn beats pi by 0.2, 0.25, 0.3."""
    at64 = {"yarn": [0.5, 0.8, 0.85, 0.9], "pi": [0.5, 0.6, 0.6, 0.6]}

    def run_one(config, run_dir, threads=None):
        s, label = config.get("seed", 0), config["model_overrides"]["label_hint"]
        full = config["lr"] == 3e-3
        metrics = {
            "val_seq_acc": 1.0 if full else 0.5,
            "val_acc": 1.0,
            "val_seq_acc@64": at64[label][s] if full else 0.1,
            "val_acc@64": 0.9,
            "curve": [{"step": 2, "val_seq_acc": 0.3}, {"step": 4, "val_seq_acc": 1.0}],
        }
        return {
            "status": "done",
            "metrics": metrics,
            "state_size_bytes": 8,
            "n_params": 1,
            "wall_time_s": 0.1,
        }

    monkeypatch.setattr(runner_mod, "run_one", run_one)
    monkeypatch.setattr("mnemo.sweep.spec.build_config", lambda *a, **k: None)  # label_hint is no model field
    models = [
        {"label": "yarn", "model": "transformer", "model_overrides": {"label_hint": "yarn"}},
        {"label": "pi", "model": "transformer", "model_overrides": {"label_hint": "pi"}},
    ]
    base = {**BASE, "task": "passkey", "task_options": {}, "eval_lengths": [64]}
    spec = _spec(
        base=base,
        models=models,
        metric="val_seq_acc",
        claims=[{"name": "yarn", "better": "yarn", "than": "pi"}],
    )
    db = tmp_path / "s.sqlite"
    run_sweep(spec, db, tmp_path / "runs", progress=False, log=lambda s: None)
    res = write_report(db, tmp_path / "rep", plots=False)["recipe"]
    assert "| seq_acc@64 |" in res["markdown"].replace(" | runs", " |")
    saved = json.loads((tmp_path / "rep" / "recipe.json").read_text())
    (at_train,) = saved["claims"]
    assert at_train["verdict"] == "not testable here" and "cannot separate them" in at_train["why"]
    (longer,) = saved["claims_at_lengths"]
    assert longer["length"] == 64 and longer["claim"] == "yarn (at 64 tokens)"
    assert longer["seeds"] == [1, 2, 3] and longer["differences"] == pytest.approx([0.2, 0.25, 0.3])
    half = t_quantile(0.975, 2) * 0.05 / math.sqrt(3)  # s = 0.05
    assert (longer["low"], longer["high"]) == pytest.approx((0.25 - half, 0.25 + half))
    assert longer["verdict"] == "reproduced" and "(at 64 tokens)" in res["markdown"]


def test_a_fine_tuning_run_has_no_initial_plateau_to_leave(tmp_path, monkeypatch):
    """A run that starts at 0.92 and ends at 0.95 (below the 0.99 threshold): started from another
    run's weights (``init_from``) it is a fine-tune near the ceiling, and the rule is not applied
    (``None``); from scratch it left its plateau (an untrained model's guessing) before its first
    evaluation (``True``: within ``ACC_RISE`` of the threshold a rise could only be the threshold
    reached). Both get a verdict. The same run starting at 0.42 from scratch is stuck (``False``)."""
    at = {"start": 0.92}

    def run_one(config, run_dir, threads=None):
        start = at["start"]
        a = start + (0.03 if config["model"] == "gla" else -0.02)
        curve = [
            {"step": 2, "val_acc": start},
            {"step": 4, "val_acc": start + 0.01},
            {"step": 6, "val_acc": a},
        ]
        return {
            "status": "done",
            "metrics": {"val_acc": a, "val_loss": 1 - a, "curve": curve},
            "state_size_bytes": 8,
            "n_params": 1,
            "wall_time_s": 0.1,
        }

    monkeypatch.setattr(runner_mod, "run_one", run_one)
    claims = [{"name": "c", "better": "gla", "than": "retnet"}]
    fine_tune = {**BASE, "init_from": "runs/pre/seed{seed}"}
    for i, (base, at["start"], plateau) in enumerate(
        ((BASE, 0.92, True), (fine_tune, 0.92, None), (BASE, 0.42, False))
    ):
        db = tmp_path / f"{i}.sqlite"
        run_sweep(_spec(base=base, claims=claims), db, tmp_path / "runs", progress=False, log=lambda s: None)
        res = json.loads(
            (
                write_report(db, tmp_path / f"rep{i}", plots=False) and tmp_path / f"rep{i}" / "recipe.json"
            ).read_text()
        )
        assert [c["plateau"] for c in res["cells"]] == [[plateau] * 3] * 2
        (claim,) = res["claims"]
        if plateau is not False:
            assert claim["verdict"] == "reproduced" and claim["differences"] == pytest.approx([0.05] * 3)
        else:
            assert (
                claim["verdict"] == "not testable here"
                and "did not leave the initial plateau" in claim["why"]
            )
