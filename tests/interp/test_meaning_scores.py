"""Circuit scores and probe figures on hand-made inputs whose answers are known in closed form."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from mnemo.interp import duplicate_token_score, induction_score, normalise, previous_token_score


def test_normalise_is_the_share_of_absolute_weight_per_row():
    m = torch.tensor([[[[2.0, 0.0, 0.0], [1.0, -3.0, 0.0], [0.5, 0.5, -1.0]]]])
    expected = torch.tensor([[[[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.25, 0.25, 0.5]]]])
    assert torch.allclose(normalise(m), expected)
    assert torch.equal(normalise(torch.zeros(1, 1, 2, 2)), torch.zeros(1, 1, 2, 2))  # no 0/0


def test_previous_token_score_reads_the_normalised_subdiagonal():
    T = 4
    m = torch.zeros(1, 2, T, T)
    m[0, 0, 0, 0] = 5.0
    for t in range(1, T):
        m[0, 0, t, t - 1] = 3.0  # head 0: 3/4 of each row's weight on t − 1
        m[0, 0, t, t] = -1.0
    m[0, 1] = -2.0 * torch.eye(T)  # head 1: only the diagonal
    assert torch.allclose(previous_token_score(m), torch.tensor([0.75, 0.0]))


def test_duplicate_token_score_averages_over_positions_with_an_earlier_copy():
    ids = torch.tensor([[0, 1, 0, 1, 2]])  # earlier duplicates: t=2 -> s=0, t=3 -> s=1; none at t=4
    p = torch.zeros(1, 1, 5, 5)
    p[0, 0, 0, 0] = 1.0
    p[0, 0, 1, 0] = 1.0  # t=1 has no earlier copy: ignored
    p[0, 0, 2, 0], p[0, 0, 2, 1] = 0.6, 0.4
    p[0, 0, 3, 1], p[0, 0, 3, 3] = 0.2, 0.8
    p[0, 0, 4, 2] = 1.0
    assert duplicate_token_score(p, ids).item() == pytest.approx((0.6 + 0.2) / 2)


def test_induction_score_reads_the_token_after_the_previous_occurrence():
    L = 3
    p = torch.eye(2 * L)[None, None].clone()
    # every position i = 3, 4, 5 of the second copy: the token after the earlier occurrence is at
    # i − L + 1 (for the last, 5, that is the second copy's first token, 3)
    p[0, 0, 3] = 0.0
    p[0, 0, 3, 1], p[0, 0, 3, 3] = 0.5, 0.5
    p[0, 0, 4] = 0.0
    p[0, 0, 4, 2] = 1.0
    p[0, 0, 5] = 0.0
    p[0, 0, 5, 3], p[0, 0, 5, 5] = 0.25, 0.75
    assert induction_score(p, L).item() == pytest.approx((0.5 + 1.0 + 0.25) / 3)


def test_circuit_tracker_defaults_score_tokens_of_the_whole_vocabulary():
    from mnemo.interp.probe import CircuitTracker, circuit_scores
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("transformer", vocab_size=6, d_model=16, n_layers=1))
    record = CircuitTracker()(SimpleNamespace(model=model), {})
    # documented defaults: 32 tokens repeated twice, batch 8, seed 1234, ids 0 … V − 1
    expected = circuit_scores(model, length=32, batch=8, seed=1234, vocab_offset=0)["0"]
    assert record["induction_by_layer"] == [max(expected["induction"])]
    assert record["duplicate_token_by_layer"] == [max(expected["duplicate_token"])]


def test_circuit_heatmaps_colour_scales_span_each_scores_range():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.interp.probe import circuits_figure

    scores = {
        "0": {
            "previous_token": [0.1, 0.2],
            "duplicate_token": [0.0, 0.3],
            "induction": [0.5, 0.9],
            "copying": [-0.5, 0.7],
        }
    }
    fig = circuits_figure(scores)
    clims = {ax.get_title(): ax.images[0].get_clim() for ax in fig.axes if ax.images and ax.get_title()}
    plt.close(fig)
    # shares of attention lie in [0, 1]; the copying score Σλ / Σ|λ| in [−1, 1]
    assert clims == {
        "previous token": (0.0, 1.0),
        "duplicate token": (0.0, 1.0),
        "induction": (0.0, 1.0),
        "copying": (-1.0, 1.0),
    }


def test_timescales_figure_shows_the_one_token_line_and_every_half_life():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.interp.timescales import figure

    hl = {"min": 3.0, "p10": 4.0, "median": 10.0, "p90": 50.0, "max": 100.0}
    fig = figure({"0": {"mixer": "GatedLinearAttention", "half_life": hl}})
    lo, hi = fig.axes[0].get_ylim()
    plt.close(fig)
    assert 0 < lo < 1.0 and hi > 100.0  # the dotted 1-token line and the largest half-life are in view


def test_half_life_summary_counts_every_finite_value_in_log_bins():
    from mnemo.interp.timescales import summarize

    hl = torch.tensor([0.5, 1.0, 3.0, 10.0, 2e6, math.inf])
    s = summarize(hl)
    assert (s["count"], s["never_decays"], s["min"], s["max"]) == (6, 1, 0.5, 2e6)
    edges, counts = s["histogram"]["edges"], s["histogram"]["counts"]
    assert len(edges) == 29 and edges[0] == pytest.approx(1.0) and edges[-1] == pytest.approx(1e7)
    assert edges[4] == pytest.approx(10.0)  # four bins per decade, 1 token to 1e7 tokens
    assert sum(counts) == 5  # half-lives under one token land in the first bin
    assert counts[0] == 2 and counts[1] == 1 and counts[4] == 1 and counts[25] == 1


def test_training_figure_plots_losses_against_steps():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.interp.probe import training_figure

    rows = [
        {"step": 10, "train_loss": 3.0, "val_loss": 3.5},
        {"step": 20, "train_loss": 2.0, "val_loss": 2.5},
    ]
    fig = training_figure(rows)
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}
    plt.close(fig)
    assert lines["train loss"] == ([10, 20], [3.0, 2.0])
    assert lines["val loss"] == ([10, 20], [3.5, 2.5])


def _text_checkpoint(path):
    """A checkpoint of an untrained GLA model on the bundled text (no training run needed)."""
    from mnemo.data import build_tokenizer, load_text
    from mnemo.data.tokenizer import save_tokenizer
    from mnemo.models import LanguageModel, build_config

    tok = build_tokenizer("char", load_text("tinyshakespeare"))
    torch.manual_seed(0)
    model = LanguageModel(build_config("gla", vocab_size=tok.vocab_size, d_model=16, n_layers=1))
    model.save_pretrained(path)
    save_tokenizer(tok, path)
    (path / "train_config.json").write_text(json.dumps({"model": "gla", "data": "tinyshakespeare"}))
    return model.eval(), tok


def test_probe_timescales_measures_the_training_text_and_creates_the_output_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from mnemo.cli import main
    from mnemo.data import load_text
    from mnemo.interp.timescales import timescales

    ckpt = tmp_path / "ckpt"
    model, tok = _text_checkpoint(ckpt)
    out = tmp_path / "new" / "nested"
    assert main(["probe", "timescales", "--checkpoint", str(ckpt), "--tokens", "64", "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = timescales(model, tok.encode(load_text("tinyshakespeare")[:64])[None])
    assert got["tokens"] == 64 and got["layers"] == json.loads(json.dumps(expected))
    assert (out / "timescales.png").is_file()


def test_probe_circuits_needs_a_checkpoint(capsys):
    from mnemo.cli import main

    assert main(["probe", "circuits"]) == 2  # the usage error is returned as the exit status
    assert "--checkpoint" in capsys.readouterr().err


def test_training_figure_shows_scores_on_a_right_axis_from_zero():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.interp.probe import training_figure

    rows = [
        {"step": 1, "train_loss": 3.0, "induction_max": 0.2},
        {"step": 2, "train_loss": 2.0, "induction_max": 0.9},
    ]
    fig = training_figure(rows)
    lo, hi = fig.axes[1].get_ylim()
    (line,) = fig.axes[1].get_lines()
    plt.close(fig)
    assert lo == 0.0 and 1.0 < hi <= 1.1  # scores lie in [0, 1]: the whole range, a little headroom
    assert (list(line.get_xdata()), list(line.get_ydata())) == ([1, 2], [0.2, 0.9])


def test_copying_score_of_a_head_that_writes_nothing_is_zero():
    from mnemo.interp import copying_score
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("transformer", vocab_size=8, d_model=16, n_layers=1))
    with torch.no_grad():
        m.blocks[0].mixer.o_proj.weight.zero_()  # every OV eigenvalue is 0
    assert torch.equal(copying_score(m, 0), torch.zeros(m.blocks[0].mixer.n_heads))


def test_timescales_figure_widens_with_the_number_of_layers():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mnemo.interp.timescales import figure

    entry = {"mixer": "Attention", "kind": "no decay"}
    widths = []
    for n in (1, 10):
        fig = figure({str(i): entry for i in range(n)})
        widths.append(fig.get_size_inches()[0])
        plt.close(fig)
    assert widths == [5.5, pytest.approx(10.0)]  # at least 5.5 in, 0.8 in per layer + 2 in


def test_a_vocabulary_offset_past_the_end_draws_the_last_token():
    from mnemo.interp.probe import circuit_scores
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("transformer", vocab_size=6, d_model=16, n_layers=1))
    past = circuit_scores(model, length=4, batch=2, vocab_offset=50)
    assert past == circuit_scores(model, length=4, batch=2, vocab_offset=5)  # ids all 5 = V − 1


def test_repeated_random_tokens_cover_the_whole_vocabulary_by_default():
    from mnemo.interp import repeated_random_tokens

    ids = repeated_random_tokens(16, 40, 5, torch.Generator().manual_seed(0))
    assert ids.shape == (16, 80) and torch.equal(ids[:, :40], ids[:, 40:])
    assert set(ids.unique().tolist()) == {0, 1, 2, 3, 4}
    shifted = repeated_random_tokens(16, 40, 5, torch.Generator().manual_seed(0), offset=3)
    assert set(shifted.unique().tolist()) == {3, 4}


def test_half_lives_beyond_ten_million_tokens_fall_in_the_last_bin():
    from mnemo.interp.timescales import summarize

    counts = summarize(torch.tensor([5e7, 2.0]))["histogram"]["counts"]
    assert counts[-1] == 1 and sum(counts) == 2


def test_circuit_scores_move_the_tokens_to_the_models_device(monkeypatch):
    """The tokens are drawn on the CPU (same on every device) and then moved to the device of the
    model's parameters, so the maps and the ids the scores compare live on one device. A model on
    the ``meta`` device (no CUDA needed) shows the move: the capture gets ids on ``meta``."""
    import mnemo.interp.probe as probe
    from mnemo.models import LanguageModel, build_config

    model = LanguageModel(build_config("transformer", vocab_size=6, d_model=16, n_layers=1)).to("meta")
    seen = []

    class Stop(Exception):
        pass

    def spy(m, ids, layers=None):
        seen.append(ids)
        raise Stop  # the scores themselves cannot be read off meta tensors

    monkeypatch.setattr(probe, "capture_maps", spy)
    with pytest.raises(Stop):
        probe.circuit_scores(model, length=4, batch=2)
    (ids,) = seen
    assert ids.device == torch.device("meta") and ids.shape == (2, 8) and ids.dtype == torch.long
