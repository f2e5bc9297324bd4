"""Fifth review, a new user's first day: what the README and the guides lead to."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp import steer
from mnemo.models import LanguageModel, build_config


@pytest.mark.parametrize("name", ["hope", "gated_deltanet"])
def test_a_per_position_steering_scale_reads_the_calls_tokens_on_a_model_read_in_pieces(name):
    # steer's scale may be a tensor "per row or position"; HOPE passes its residual hooks the call
    # in pieces (segments of 8 tokens), where a [1, T, 1] scale over the call's T tokens was
    # refused, naming a piece's shape the user never chose (it works on one-pass models)
    torch.manual_seed(0)
    model = LanguageModel(build_config(name, vocab_size=40, d_model=32, n_layers=2)).double().eval()
    ids = torch.randint(0, 40, (2, 20))
    d = torch.randn(32, dtype=torch.float64)
    hook = "blocks.0.hook_resid_post"
    scale = torch.zeros(1, 20, 1, dtype=torch.float64)
    scale[0, [3, 11, 17]] = 1.5
    with torch.no_grad():
        per_position, _ = model.run_with_hooks(ids, steer(model, hook, d, scale=scale))
        # the same steering by the positions argument (the call's tokens, also in pieces)
        by_positions, _ = model.run_with_hooks(ids, steer(model, hook, d, scale=1.5, positions=[3, 11, 17]))
        clean, _ = model(ids)
    assert (per_position - clean).abs().max() > 1e-3
    torch.testing.assert_close(per_position, by_positions, rtol=0, atol=1e-12)


def test_probe_spectrum_help_states_the_defaults_it_runs_with(capsys):
    # --tokens said its default; --directions (32) and --irrelevant-half-life (4) did not
    from mnemo.cli import main

    assert main(["probe", "spectrum", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(JVP) (default 32)" in text
    assert "irrelevant (default 4)" in text
    from mnemo.cli import build_parser

    args = build_parser().parse_args(["probe", "spectrum", "--checkpoint", "."])
    assert (args.directions, args.irrelevant_half_life) == (32, 4.0)
