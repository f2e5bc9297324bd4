"""mnemo probe: circuits / timescales / plot-training on small checkpoints; the training tracker."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.cli import main
from mnemo.interp.timescales import timescales
from mnemo.models import LanguageModel, build_config

FAST = [
    "--steps",
    "4",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-interval",
    "2",
    "--eval-batches",
    "1",
    "--d-model",
    "32",
    "--n-layers",
    "2",
    "--sample-tokens",
    "0",
    "--no-progress",
]


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "run"
    args = ["--n-layers" if a == "--n-layers" else a for a in FAST]
    args[args.index("--n-layers") + 1] = "4"  # one full gla, gla, gla, attention pattern
    assert main(["train", "--model", "gla_hybrid", "--out", str(out), *args]) == 0
    return out


def test_probe_circuits_prints_scores_and_writes_heatmaps(hybrid_run, capsys):
    assert main(["probe", "circuits", "--checkpoint", str(hybrid_run), "--length", "12", "--batch", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    layers = result["layers"]
    assert set(layers) == {"0", "1", "2", "3"}
    assert len(layers["3"]["induction"]) == 4 and "copying" in layers["3"]  # the attention layer
    assert all(0 <= s <= 1 for s in layers["0"]["induction"])
    assert (hybrid_run / "ckpt-000004" / "circuits.png").exists()


def test_probe_timescales(hybrid_run, capsys):
    assert main(["probe", "timescales", "--checkpoint", str(hybrid_run), "--tokens", "64"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["layers"]["0"]["kind"] == "per-channel" and result["layers"]["0"]["half_life"]["median"] > 0
    assert result["layers"]["3"]["kind"] == "no decay"
    assert (hybrid_run / "ckpt-000004" / "timescales.png").exists()


def test_plot_training(hybrid_run, capsys):
    assert main(["probe", "plot-training", str(hybrid_run)]) == 0
    assert (hybrid_run / "training.png").exists()


@pytest.mark.parametrize("name", ["retnet", "gla", "gated_deltanet", "mamba", "mamba2", "titans_lmm", "hope"])
def test_timescales_for_every_decaying_memory(name):
    torch.manual_seed(0)
    m = LanguageModel(build_config(name, vocab_size=20, d_model=16, n_layers=1))
    r = timescales(m, torch.randint(0, 20, (1, 30)))
    hl = r["0"]["half_life"]
    assert hl["count"] > 0 and 0 < hl["median"] < float("inf")
    if name == "retnet":  # fixed decays 1 - 2^(-5-h): half-lives ln 2 / -ln(1 - 2^-5) ≈ 22 tokens and up
        assert abs(hl["min"] - (-0.6931471805599453 / torch.log(torch.tensor(1 - 2**-5)).item())) < 1e-3
    if name == "hope":
        assert r["0"]["cms_periods"] == [8, 16, 32]


def test_circuit_tracker_adds_scores(tmp_path):
    from mnemo.interp.probe import CircuitTracker
    from mnemo.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model="transformer",
        model_overrides={"d_model": 16, "n_layers": 2},
        seq_len=16,
        batch_size=2,
        steps=2,
        eval_interval=2,
        eval_batches=1,
        sample_tokens=0,
    )
    Trainer(cfg, tmp_path, progress=False, callbacks=[CircuitTracker(length=6, batch=2)]).fit()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= rec["induction_max"] <= 1 and len(rec["induction_by_layer"]) == 2


def test_track_circuits_flag_and_shipped_phase_change_configs(tmp_path, capsys):
    """`mnemo train --track-circuits` records the scores at every evaluation; the shipped
    phase-change configs (2-layer and 1-layer control) are valid and run (here for 4 steps)."""
    from pathlib import Path

    from mnemo.cli import main

    root = Path(__file__).resolve().parents[2] / "configs" / "circuits"
    for layers in (2, 1):
        out = tmp_path / f"pc{layers}"
        argv = ["train", "--config", str(root / f"phase_change_{layers}layer.yaml"), "--out", str(out)]
        argv += ["--steps", "4", "--eval-interval", "2", "--eval-batches", "1", "--no-progress"]
        assert main(argv) == 0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [2, 4]
        assert all(len(r["induction_by_layer"]) == layers and 0 <= r["induction_max"] <= 1 for r in rows)
    out = tmp_path / "flag"
    argv = ["train", "--model", "transformer", "--task", "repeat_segment", "--steps", "2", "--seq-len", "32"]
    argv += ["--d-model", "16", "--n-layers", "2", "--batch-size", "2", "--eval-interval", "2"]
    argv += [
        "--eval-batches",
        "1",
        "--track-circuits",
        "--circuit-length",
        "8",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "previous_token_max" in rec and len(rec["duplicate_token_by_layer"]) == 2
    capsys.readouterr()
    assert main(argv[:-3] + ["--circuit-length", "1", "--out", str(tmp_path / "bad"), "--no-progress"]) != 0
    assert "TrainConfig.circuit_length: expected an int >= 2, got 1" in capsys.readouterr().err
