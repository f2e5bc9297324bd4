"""mnemo probe: circuits / timescales / plot-training on small checkpoints; the training tracker."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.cli import main
from mnemo.interp.probe import circuit_scores
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


@pytest.fixture
def saved_figures(monkeypatch):
    """Every matplotlib Figure saved while the test runs (the objects, to read titles and axes)."""
    from matplotlib.figure import Figure

    saved, original = [], Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _title(fig) -> str:
    """All title text of a figure: its suptitle and its axes' titles, one line."""
    parts = [t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes]
    return " ".join(" ".join(parts).split())


def _panel(fig, title):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def _texts_inside_figure(fig) -> None:
    """No text of the figure (titles included) is cut by its edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # a closed figure has lost its canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    texts = list(fig.texts) + [ax.title for ax in fig.axes]
    for t in texts:
        if t.get_text():
            e = t.get_window_extent(renderer)
            assert e.x0 >= box.x0 - 1 and e.x1 <= box.x1 + 1 and e.y1 <= box.y1 + 1, t.get_text()


def test_probe_circuits_prints_scores_and_writes_heatmaps(hybrid_run, capsys, saved_figures):
    assert main(["probe", "circuits", "--checkpoint", str(hybrid_run), "--length", "12", "--batch", "2"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # stdout is the JSON alone; where the figure went is on stderr
    layers = result["layers"]
    assert set(layers) == {"0", "1", "2", "3"}
    assert len(layers["3"]["induction"]) == 4 and "copying" in layers["3"]  # the attention layer
    assert all(0 <= s <= 1 for s in layers["0"]["induction"])
    png = hybrid_run / "probes" / "ckpt-000004" / "circuits.png"  # beside the checkpoint, not in it
    saved = png.with_suffix(".json")  # the scores kept beside the figure, as printed
    assert png.exists() and f"wrote {saved} and {png}" in captured.err.splitlines()
    assert json.loads(saved.read_text()) == result
    (fig,) = saved_figures
    title = _title(fig)
    assert "gla_hybrid (4 layers)" in title and "ckpt-000004 (step 4)" in title
    copying = _panel(fig, "copying")  # the gla layers 0-2 have no copying score: their rows say so
    assert sorted(t.get_position()[1] for t in copying.texts if t.get_text() == "n/a") == [0, 1, 2]
    assert not _panel(fig, "induction").texts  # every layer has an induction score


def test_probe_circuits_without_softmax_heads_says_na(tmp_path, capsys, saved_figures):
    """A model without softmax heads has no copying score at all: the panel reads "n/a", not blank;
    a checkpoint without train_config.json is named by its mixers."""
    torch.manual_seed(0)
    LanguageModel(build_config("gla", vocab_size=20, d_model=16, n_layers=1)).save_pretrained(
        tmp_path / "gla"
    )
    out = tmp_path / "figs"
    argv = ["probe", "circuits", "--checkpoint", str(tmp_path / "gla"), "--length", "6", "--batch", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    assert f"wrote {out / 'circuits.json'} and {out / 'circuits.png'}" in capsys.readouterr().err
    (fig,) = saved_figures
    assert "gla (1 layer)" in _title(fig) and "gla" in fig.texts[0].get_text()
    assert [t.get_text().split()[0] for t in _panel(fig, "copying").texts] == ["n/a"]


def test_probe_timescales(hybrid_run, capsys, saved_figures):
    assert main(["probe", "timescales", "--checkpoint", str(hybrid_run), "--tokens", "64"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["layers"]["0"]["kind"] == "per-channel" and result["layers"]["0"]["half_life"]["median"] > 0
    assert result["layers"]["3"]["kind"] == "no decay"
    png = hybrid_run / "probes" / "ckpt-000004" / "timescales.png"
    saved = png.with_suffix(".json")
    assert png.exists() and f"wrote {saved} and {png}" in captured.err.splitlines()
    assert json.loads(saved.read_text()) == result
    (fig,) = saved_figures
    assert "gla_hybrid (4 layers)" in _title(fig) and "ckpt-000004 (step 4)" in _title(fig)
    _texts_inside_figure(fig)  # the title used to run off both edges
    (ax,) = fig.axes
    assert "no decay" in [t.get_text() for t in ax.texts]  # the attention layer


def test_timescales_plot_shows_half_lives_below_one_token(tmp_path, saved_figures):
    """Half-lives under one token are drawn at their value on a log axis that reaches them (they
    used to be drawn at log10(1) = 0), next to a "1 token" mark."""
    from mnemo.interp.timescales import plot

    hl = {"count": 5, "never_decays": 0, "min": 0.2, "p10": 0.5, "median": 3.0, "p90": 40.0, "max": 900.0}
    result = {"0": {"mixer": "Mamba", "kind": "per-channel-state", "half_life": hl}}
    result["1"] = {"mixer": "Attention", "kind": "no decay"}
    plot(result, tmp_path / "t.png")
    (fig,) = saved_figures
    (ax,) = fig.axes
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if y == y]
    assert ax.get_yscale() == "log" and min(ys) == pytest.approx(0.2) and max(ys) == pytest.approx(900.0)
    lo, hi = ax.get_ylim()
    assert lo < 0.2 and hi > 900.0
    assert "1 token" in [t.get_text() for t in ax.texts]
    _texts_inside_figure(fig)


def test_plot_training(hybrid_run, capsys, saved_figures):
    """A run without tracked scores: loss only, no empty right axis; the title names model and run."""
    assert main(["probe", "plot-training", str(hybrid_run)]) == 0
    assert f"wrote {hybrid_run / 'training.png'}" in capsys.readouterr().out.splitlines()
    (fig,) = saved_figures
    assert len(fig.axes) == 1 and fig.axes[0].get_ylabel() == "loss (nats/token)"
    title = _title(fig)
    assert "gla_hybrid (4 layers) on tinyshakespeare" in title and "run (4 steps)" in title
    _texts_inside_figure(fig)


def test_plot_training_scores_on_a_labelled_right_axis(tmp_path, saved_figures):
    from mnemo.commands.probe import plot_training

    rows = [{"step": s, "train_loss": 3.0 / s, "induction_max": 0.1 * s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_training(tmp_path) == tmp_path / "training.png"
    (fig,) = saved_figures
    loss, scores = fig.axes
    assert "circuit score" in scores.get_ylabel()
    assert [line.get_label() for line in scores.get_lines()] == ["induction max"]
    assert f"{tmp_path.name} (3 steps)" in _title(fig)  # no checkpoint: the run directory alone


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
    from mnemo.interp import CircuitTracker
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
    assert "argument --circuit-length: expected an int >= 2, got '1'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["titans_mac", "titans_mag", "titans_mal"])
def test_timescales_read_the_titans_memorys_gate(name):
    """MAC/MAG/MAL keep their decay in the memory inside them (``memory.hook_g``): timescales reads
    it (naming the hook) and its half-lives are ``−ln 2 / g`` of that hook's rows of the 24 input
    tokens, by hand (MAG's and MAL's memory reads its 4 persistent tokens first: not the input's;
    MAC's persistent tokens are the attention's alone)."""
    torch.manual_seed(0)
    m = LanguageModel(build_config(name, vocab_size=20, d_model=16, n_layers=1))
    ids = torch.randint(0, 20, (1, 24))
    e = timescales(m, ids)["0"]
    _, cache = m.run_with_cache(ids, names="blocks.0.mixer.memory.hook_g")
    g = cache["blocks.0.mixer.memory.hook_g"].double()
    persistent = m.blocks[0].mixer.memory.persistent
    prefix = 0 if persistent is None else persistent.shape[0]
    assert prefix == (0 if name == "titans_mac" else 4)
    assert g.shape[1] == prefix + 24
    g = g[:, prefix:]
    hl = (-0.6931471805599453 / g).flatten()
    assert e["kind"] == "per-head" and e["hook"] == "blocks.0.mixer.memory.hook_g"
    assert e["half_life"]["count"] == hl.numel()
    assert e["half_life"]["median"] == pytest.approx(hl.median().item(), rel=1e-3)
    assert e["half_life"]["min"] == pytest.approx(hl.min().item(), rel=1e-5)


def test_timescales_labels_a_gate_per_token():
    """HOPE's self-modifying Titans: one retention gate for its whole memory per token ([B, T])."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope_reconstruction", vocab_size=20, d_model=16, n_layers=1))
    e = timescales(m, torch.randint(0, 20, (1, 12)))["0"]
    assert e["kind"] == "per-token" and e["hook"] == "blocks.0.mixer.hook_g"


def test_a_layer_whose_map_is_zero_on_the_scored_tokens_says_why():
    """HOPE reads each memory chunk (16 tokens) at its start weights: on 2 · 8 tokens its map is
    zero and so is every score — the entry says so; on 2 · 9 it is not and carries no note."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope_reconstruction", vocab_size=20, d_model=16, n_layers=1)).eval()
    assert m.blocks[0].mixer.chunk_size == 16
    zero = circuit_scores(m, length=8, batch=1)["0"]
    assert zero["induction"] == [0.0] and zero["previous_token"] == [0.0]
    assert zero["note"] == (
        "the map of SelfModifyingTitans is exactly zero on these 16 tokens, so every score is 0: it reads "
        "each memory chunk (16 tokens) with the weights of the chunk's start, and all 16 tokens lie in the "
        "first chunk; a length > 8 reaches the next one"
    )
    assert "note" not in circuit_scores(m, length=9, batch=1)["0"]


def test_probe_circuits_covers_titans_mac_segments_and_names_length_where_a_map_cannot(tmp_path, capsys):
    """Titans MAC's map joins its segments (64 tokens): ``--length 40`` (80 tokens) scores as the
    library does; a mixer whose map spans one chunk (the self-modifying projections, 64 tokens) is
    refused in one line naming ``--length`` and the limit."""
    torch.manual_seed(0)
    mac = LanguageModel(build_config("titans_mac", vocab_size=20, d_model=16, n_layers=1)).eval()
    mac.save_pretrained(tmp_path / "mac")
    argv = ["probe", "circuits", "--checkpoint", str(tmp_path / "mac"), "--length", "40", "--batch", "1"]
    assert main([*argv, "--out", str(tmp_path / "p1")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["layers"]
    want = json.loads(json.dumps(circuit_scores(mac, 40, 1, 0)))
    assert got == want and len(got["0"]["induction"]) == 4
    smp = LanguageModel(build_config("self_modifying_projections", vocab_size=20, d_model=16, n_layers=1))
    smp.eval().save_pretrained(tmp_path / "smp")
    argv = ["probe", "circuits", "--checkpoint", str(tmp_path / "smp"), "--length", "40", "--batch", "1"]
    assert main([*argv, "--out", str(tmp_path / "p2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        "mnemo probe circuits: error: --length 40: 2 × --length = 80 tokens are more than a layer's"
    )
    assert "a map needs a stream of at most one chunk (64 tokens)" in err
