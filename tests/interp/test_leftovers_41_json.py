"""The probe commands' JSON files (circuits.json, ablate-topK.json, timescales.json) follow the
strict-JSON convention of every command (mnemo.train.sinks.dumps_record): a non-finite value is
``null`` and the record's ``"nonfinite"`` map says where and which, so ``loads_record`` restores it
(before, circuits/ablate/timescales wrote a bare ``null``: NaN, inf and "missing" read the same)."""

from __future__ import annotations

import json
import math

import pytest

from mnemo.cli import main
from mnemo.train.sinks import loads_record

FAST = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1"]
FAST += ["--d-model", "16", "--n-layers", "1", "--sample-tokens", "0", "--no-progress"]


@pytest.fixture(scope="module")
def gla_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("json41") / "run"
    assert main(["train", "--model", "gla", "--out", str(out), *FAST]) == 0
    return out


def _both(capsys, path):
    """The record as written to ``path`` and as printed on stdout, each read with loads_record."""
    printed = capsys.readouterr().out
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    return loads_record(text), loads_record(printed)


def test_probe_circuits_nan_score_round_trips(gla_run, tmp_path, capsys, monkeypatch):
    import mnemo.commands.probe as probe

    real = probe.circuit_scores

    def scores(*a, **k):
        out = real(*a, **k)
        out["0"]["induction"][0] = math.nan  # an undefined score
        return out

    monkeypatch.setattr(probe, "circuit_scores", scores)
    argv = ["probe", "circuits", "--checkpoint", str(gla_run), "--length", "6", "--batch", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    for record in _both(capsys, tmp_path / "circuits.json"):
        assert math.isnan(record["layers"]["0"]["induction"][0]) and "nonfinite" not in record


def test_probe_ablate_nonfinite_values_round_trip(gla_run, tmp_path, capsys, monkeypatch):
    import mnemo.interp.interventions as interventions

    real = interventions.induction_ablation

    def ablation(*a, **k):
        out = real(*a, **k)
        out["nan_field"], out["inf_field"] = math.nan, -math.inf
        return out

    monkeypatch.setattr(interventions, "induction_ablation", ablation)
    path = tmp_path / "ablate.json"
    argv = ["probe", "ablate", "--checkpoint", str(gla_run), "--top-induction", "1", "--draws", "1"]
    assert main([*argv, "--length", "6", "--batch", "1", "--out", str(path)]) == 0
    for record in _both(capsys, path):
        assert math.isnan(record["nan_field"]) and record["inf_field"] == -math.inf
        assert "nonfinite" not in record


def test_probe_timescales_infinite_half_life_round_trips(gla_run, tmp_path, capsys, monkeypatch):
    import mnemo.interp.timescales as ts

    real = ts.timescales

    def scales(*a, **k):
        out = real(*a, **k)
        key = next(iter(out["0"]["half_life"]))
        out["0"]["half_life"][key] = math.inf  # a direction never forgotten
        return out

    monkeypatch.setattr(ts, "timescales", scales)
    monkeypatch.setattr(ts, "plot", lambda result, path, title=None: path)  # the JSON is what is tested
    argv = ["probe", "timescales", "--checkpoint", str(gla_run), "--tokens", "32", "--out", str(tmp_path)]
    assert main(argv) == 0
    for record in _both(capsys, tmp_path / "timescales.json"):
        half_life = record["layers"]["0"]["half_life"]
        assert half_life[next(iter(half_life))] == math.inf and "nonfinite" not in record
