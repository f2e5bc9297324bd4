"""Leftovers of today's reviews, second batch (42b): ``mnemo train --spectrum-burn-in``; the
tracker's non-finite half-lives kept as floats and read back by the flow figure; a state of
another dtype into CMS / self-modifying mixers named."""

from __future__ import annotations

import json

import pytest
import torch


def _argv(data, out, steps, *extra):
    argv = ["train", "--model", "gla", "--data", str(data), "--steps", str(steps), "--seq-len", "32"]
    argv += ["--d-model", "16", "--n-layers", "1", "--batch-size", "2", "--eval-interval", "1"]
    argv += [
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--warmup-steps",
        "0",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]
    return argv


def _tracked(ckpt, burn_in):
    """What :class:`CircuitTracker` records for the checkpoint's model, called directly."""
    from mnemo.interp import CircuitTracker
    from mnemo.models import LanguageModel

    model = LanguageModel.from_pretrained(ckpt)
    tracker = CircuitTracker(spectrum=True, spectrum_burn_in=burn_in)
    return json.loads(json.dumps(tracker._spectrum(model)))


def test_train_spectrum_burn_in_flag_records_the_burned_in_spectrum_and_resumes_changed(tmp_path, capsys):
    """``--track-spectrum --spectrum-burn-in 1`` records the spectrum ``CircuitTracker(spectrum=True,
    spectrum_burn_in=1)`` gives for the step's weights (not the burn-in-0 one); a resume may change
    the value, as ``circuit_length``, and its records then follow the new value."""
    from mnemo.cli import main

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    assert main(_argv(text, out, 1, "--track-spectrum", "--spectrum-burn-in", "1")) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ckpt1 = out / "ckpt-000001"
    assert json.loads((ckpt1 / "train_config.json").read_text())["spectrum_burn_in"] == 1
    want = _tracked(ckpt1, 1)
    assert want != _tracked(ckpt1, 0)  # the burn-in changes the reading here
    assert rows[-1]["spectrum_by_memory"] == want["spectrum_by_memory"]
    capsys.readouterr()
    more = ["--track-spectrum", "--spectrum-burn-in", "5", "--resume", "--reschedule", "stretch"]
    assert main(_argv(text, out, 2, *more)) == 0, capsys.readouterr()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ckpt2 = out / "ckpt-000002"
    assert json.loads((ckpt2 / "train_config.json").read_text())["spectrum_burn_in"] == 5
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["spectrum_by_memory"] == _tracked(ckpt2, 5)["spectrum_by_memory"]


@pytest.mark.parametrize("bad", [-1, 256, 1.5, True, "3"])
def test_trainconfig_spectrum_burn_in_is_validated_naming_the_field(bad):
    from mnemo.train import TrainConfig

    with pytest.raises(ValueError, match=r"TrainConfig\.spectrum_burn_in: expected an int in \[0, 256\)"):
        TrainConfig(model="gla", track_spectrum=True, spectrum_burn_in=bad).validate()


def test_trainconfig_spectrum_burn_in_without_track_spectrum_is_refused():
    from mnemo.train import TrainConfig

    assert TrainConfig(model="gla", track_spectrum=True, spectrum_burn_in=255).validate()
    assert TrainConfig(model="gla").spectrum_burn_in == 0
    with pytest.raises(ValueError, match=r"TrainConfig\.spectrum_burn_in \(3\).*track_spectrum"):
        TrainConfig(model="gla", spectrum_burn_in=3).validate()


# --- 2: the tracker keeps an infinite half-life a float; the flow figure reads old and new ------


def test_tracker_keeps_a_never_halving_median_as_inf_and_metrics_jsonl_maps_it(tmp_path):
    """A GLA whose log-gates are all 0 never forgets: every half-life is infinite. The tracker's
    record holds ``inf`` (a float, not ``None``, so that it stays apart from a NaN); metrics.jsonl's
    writer writes it as ``null`` named under ``"nonfinite"`` and ``loads_record`` restores it."""
    import math

    from mnemo.interp import CircuitTracker
    from mnemo.models import LanguageModel, build_config
    from mnemo.train.sinks import MetricsFile, loads_record

    torch.manual_seed(0)
    model = LanguageModel(build_config("gla", vocab_size=20, d_model=16, n_layers=1)).double().eval()
    h = dict(model.named_modules())["blocks.0.mixer.hook_g"].add(lambda g, name: torch.zeros_like(g))
    try:
        extra = CircuitTracker(length=4, batch=1, spectrum=True, spectrum_tokens=10)._spectrum(model)
    finally:
        h.remove()
    assert extra["spectrum_median_half_life_by_layer"] == [math.inf]
    assert extra["spectrum_by_memory"]["0"]["median_half_life"] == math.inf
    MetricsFile(tmp_path).log({"step": 1, **extra})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    raw = json.loads(line)
    assert raw["spectrum_by_memory"]["0"]["median_half_life"] is None
    assert raw["nonfinite"]["spectrum_by_memory/0/median_half_life"] == "Infinity"
    back = loads_record(line)
    assert back["spectrum_by_memory"]["0"]["median_half_life"] == math.inf
    assert back["spectrum_median_half_life_by_layer"] == [math.inf]


def test_spectrum_flow_figure_reads_old_null_and_new_inf_and_keeps_nan_a_gap():
    """The figure's left panel: a finite median as it is, ``inf`` (new records) and ``None`` (records
    of before) at the top (4 × the largest finite median), a NaN as a gap (not "never halves")."""
    import math

    from mnemo.interp.probe import spectrum_flow_figure

    def rec(step, hl):
        shares = {"irrelevant": 0.5, "intermediate": 0.25, "marginal": 0.25, "relevant": 0.0}
        return {"step": step, "spectrum_by_memory": {"0": {**shares, "median_half_life": hl}}}

    rows = [rec(1, 3.0), rec(2, math.inf), rec(3, None), rec(4, math.nan), rec(5, 5.0)]
    fig = spectrum_flow_figure(rows)
    y = list(fig.axes[0].get_lines()[0].get_ydata())
    assert y[0] == 3.0 and y[1] == 20.0 and y[2] == 20.0 and math.isnan(y[3]) and y[4] == 5.0
    import matplotlib.pyplot as plt

    plt.close(fig)


# --- 3: a state of another dtype into CMS / the self-modifying mixers is named -------------------


def _lm(name, **kw):
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=20, d_model=16, n_layers=1, **kw)).eval()


@pytest.mark.parametrize(
    "name, kw, entry",
    [
        ("hope_attention_reconstruction", {}, r"state\.levels\[0\]\.weights\[0\]"),  # CMSLevel.check_state
        ("hope_reconstruction", {}, r"state\.proj\[0\]"),  # SelfModifyingTitans
        ("hope_reconstruction", {"mixer": "self_modifying_projections"}, r"state\.proj\['k'\]"),
        ("hope", {}, r"state\[0\]\.mixer\.proj\[0\]"),  # the task-signal model's segment loop
    ],
)
@pytest.mark.parametrize("before, after", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_a_state_kept_from_before_a_cast_is_named_with_expected_and_received_dtype(
    name, kw, entry, before, after
):
    """A state made by the model in ``before``, passed into the same model after ``.to(after)``,
    raised torch's unnamed "expected scalar type Double but found Float" deep inside; now a
    ``ValueError`` names the entry, the expected and the received dtype (as ``check_dtype`` does for
    the input); the state cast to the model's dtype runs."""
    from mnemo.layers.state import to

    model = _lm(name, **kw).to(before)
    ids = torch.randint(0, 20, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, st = model(ids)
        model.to(after)
        msg = rf"{entry}: expected dtype {after} \(the state \w+ makes for its {after} parameters\), "
        msg += f"got {before}"
        with pytest.raises(ValueError, match=msg):
            model(ids, st)
        logits, _ = model(ids, to(st, after))
    assert logits.dtype == after and torch.isfinite(logits).all()


def test_a_state_from_a_bf16_autocast_forward_still_continues_outside_autocast():
    """A float32 model's state from a bf16 autocast forward holds bf16 activations (the conv tail of
    the self-modifying projections); it continues outside autocast as before (not refused)."""
    model = _lm("hope_reconstruction", mixer="self_modifying_projections")
    ids = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            _, st = model(ids[:, :7])
        assert st[0].mixer.conv.dtype == torch.bfloat16
        logits, _ = model(ids[:, 7:], st)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
