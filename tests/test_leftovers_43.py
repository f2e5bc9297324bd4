"""Session 43, the lead's own: the tracker's spectrum burn-in is checked before the first step."""

from __future__ import annotations

import pytest

from mnemo.interp import circuit_callbacks
from mnemo.train import TrainConfig, Trainer


def test_a_burn_in_the_model_cannot_average_fails_when_the_trainer_is_built(tmp_path):
    """ttt_linear's memory steps in chunks of 16: of the spectrum's 256 tokens a burn-in of at most
    16 · (256/16 − 1) = 240 leaves it a whole chunk. 250 is refused by ``Trainer(...)`` itself, before
    any step or log line (it was refused at the first evaluation, ``eval_interval`` steps later)."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    kw = dict(model="ttt_linear", data=str(text), steps=2, seq_len=32, batch_size=2)
    kw["model_overrides"] = {"d_model": 16, "n_layers": 1}
    kw.update(track_spectrum=True, sample_tokens=0, eval_interval=1, eval_batches=1)
    with pytest.raises(ValueError, match=r"spectrum_burn_in: 250 of the spectrum's 256 tokens.* 240"):
        Trainer(
            TrainConfig(**kw, spectrum_burn_in=250),
            tmp_path / "a",
            progress=False,
            callbacks=circuit_callbacks,
        )
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    t = Trainer(
        TrainConfig(**kw, spectrum_burn_in=240), tmp_path / "b", progress=False, callbacks=circuit_callbacks
    )
    assert t.step == 0  # the largest value is accepted


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_a_float64_state_into_a_float32_mamba_is_refused_by_name(name):
    """The state a ``.double()`` layer made, fed to the float32 layer (and the reverse), was read in
    float64 and came back float64 (the ssm state; ``y`` rounded back): now a ``ValueError`` naming
    the entry, as the other mixers and the CMS levels do. The layer's own state still decodes on
    (the step after 3 tokens equals the 4th position of one pass)."""
    import torch

    from mnemo.layers.registry import MIXERS
    from mnemo.layers.state import to

    torch.manual_seed(0)
    layer = MIXERS[name](16)
    x = torch.randn(1, 4, 16)
    _, state = layer(x[:, :3])
    with pytest.raises(ValueError, match=r"state\.\w+.*expected dtype torch.float32.*got torch.float64"):
        layer(x[:, 3:], to(state, torch.float64))
    with pytest.raises(ValueError, match=r"expected dtype torch.float64.*got torch.float32"):
        MIXERS[name](16).double()(x[:, 3:].double(), state)
    y_full, _ = layer(x)
    y_step, _ = layer(x[:, 3:], state)
    assert torch.allclose(y_step, y_full[:, 3:], atol=1e-5)
