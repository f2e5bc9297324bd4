"""Helper 48c: ``mnemo probe ablate`` on a model whose attention window is shorter than ``--length``
says that the induction target lies outside it, as ``probe circuits`` does (one helper for both)."""

from __future__ import annotations

import json

import pytest

from mnemo.cli import main
from mnemo.models import LanguageModel, ModelConfig


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny two-layer attention model with a window of 3 keys, saved as a checkpoint folder."""
    import torch

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=24, d_model=16, n_layers=2, mixer="attention",
                      mixer_options={"attention": {"n_heads": 2, "window": 3}})  # fmt: skip
    folder = tmp_path_factory.mktemp("windowed") / "ck"
    LanguageModel(cfg).save_pretrained(folder)
    return folder


def test_probe_ablate_says_when_the_induction_target_lies_outside_the_window(windowed, tmp_path, capsys):
    """``probe ablate --length 6`` on a window of 3: every induction score is 0 by construction and
    the top-K heads were ranked by those zeros, without a word. Now each such layer's note (the
    one ``probe circuits`` writes) is on stderr and in the JSON (``induction_out_of_window``: layer
    -> note); at ``--length 3`` (the target 2 tokens back, inside the window) there is none."""
    argv = ["probe", "ablate", "--checkpoint", str(windowed), "--top-induction", "1", "--draws", "1",
            "--batch", "1"]  # fmt: skip
    assert main([*argv, "--length", "6", "--out", str(tmp_path / "a6.json")]) == 0
    err = capsys.readouterr().err
    note = (
        "the induction target lies 5 tokens back (--length 6 − 1), outside this layer's window of 3 keys "
        "(the last 2 and the query): its induction scores are 0 by construction, not measured; "
        "--length 3 or less measures them"
    )
    for layer in ("0", "1"):
        assert f"note: layer {layer}: {note}; --top-induction ranks its heads by those zeros" in err
    record = json.loads((tmp_path / "a6.json").read_text())
    assert record["induction_out_of_window"] == {"0": note, "1": note}
    assert [h[2] for h in record["top_k"]["heads"]] == [0.0]  # (the zero it was ranked by)
    # (probe circuits writes the same note, from the same helper, into its layer entries:
    # tests/hf/test_llama_trial_47e.py; not run again here, its heatmap costs seconds)
    from mnemo.commands.probe import _induction_out_of_window

    assert _induction_out_of_window(LanguageModel.from_pretrained(windowed), 6) == {"0": note, "1": note}
    assert main([*argv, "--length", "3", "--out", str(tmp_path / "a3.json")]) == 0
    assert "induction target" not in capsys.readouterr().err
    assert "induction_out_of_window" not in json.loads((tmp_path / "a3.json").read_text())
