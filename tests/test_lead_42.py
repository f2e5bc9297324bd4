"""The lead's own checks of session 42's loose ends."""

import json
import math

import pytest

from mnemo.cli import main
from mnemo.train import trainer as trainer_module
from mnemo.train.sinks import loads_record


def test_train_prints_its_final_record_as_strict_json(tmp_path, capsys, monkeypatch):
    # a tracked spectrum's never-halving median is inf and a diverged loss NaN: the last line
    # printed must stay strict JSON (null + "nonfinite"), as metrics.jsonl is
    real_fit = trainer_module.Trainer.fit

    def fit(self):
        record = real_fit(self)
        return {**record, "spectrum_median_half_life_by_layer": [math.inf], "probe": math.nan}

    monkeypatch.setattr(trainer_module.Trainer, "fit", fit)
    argv = ["train", "--model", "gla", "--out", str(tmp_path / "run"), "--steps", "1"]
    argv += ["--seq-len", "16", "--batch-size", "2", "--d-model", "16", "--n-layers", "1"]
    argv += ["--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    assert main(argv) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{") and '"probe"' in ln)

    def refuse(token):
        raise AssertionError(f"bare {token} in {line}")

    json.loads(line, parse_constant=refuse)  # no NaN / Infinity tokens
    record = loads_record(line)
    assert record["spectrum_median_half_life_by_layer"] == [math.inf] and math.isnan(record["probe"])


def test_t_quantile_near_the_median_keeps_its_relative_precision():
    # F(t) = ½ + f(0)·t·(1 − (ν+1)/(6ν)·t² + …) near 0, with f(0) = Γ((ν+1)/2) / (√(νπ) Γ(ν/2)):
    # t = ε / f(0) · (1 + (ν+1)/(6ν)·t²) to relative 1e-27 at ε = 1e-7 (the bisection on φ lost 1e-9)
    from mnemo.sweep.stats import t_quantile

    for nu in (3, 4, 30, 101):
        p = 0.5 + 1e-7
        eps = p - 0.5  # exact (Sterbenz)
        f0 = math.gamma((nu + 1) / 2) / math.gamma(nu / 2) / math.sqrt(nu * math.pi)
        t = eps / f0
        t *= 1 + (nu + 1) / (6 * nu) * t * t
        assert t_quantile(p, nu) == pytest.approx(t, rel=1e-14, abs=0)
        assert t_quantile(1 - p, nu) == -t_quantile(p, nu)
