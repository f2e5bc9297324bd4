"""Regression review 38e of 6a27846 (HF generate / cache padding) and faae806 (interp layer indices,
next_token_loss, mean ablation of integer hooks, ``DeltaNet.map_heads``)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402

VOCAB = 40


def _learned(max_position: int = 30) -> MnemoForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=1,
        mixer="gla",
        pos_embedding="learned",
        max_position=max_position,
    )
    lm = LanguageModel(cfg).eval()
    return MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm).eval()


def test_generate_length_check_reads_the_models_max_new_tokens_under_a_given_generation_config():
    """transformers fills a ``generation_config`` argument's unset fields from the model's
    ``generation_config``: its ``max_new_tokens=5`` bounds the run (25 + 5 - 1 = 29 positions of 30).
    The up-front check took the default 20 new tokens instead and refused a valid call."""
    m = _learned()
    m.generation_config.max_new_tokens = 5
    ids = torch.randint(1, VOCAB, (1, 25), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = m.generate(
            ids, generation_config=transformers.GenerationConfig(do_sample=False, pad_token_id=0)
        )
    assert out.shape == (1, 30)
    # and the same setting still refuses what runs past the positions, before any work
    m.generation_config.max_new_tokens = 7
    with pytest.raises(ValueError, match="max_position"):
        m.generate(ids, generation_config=transformers.GenerationConfig(do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("bad", [torch.tensor(True), torch.tensor(1.0), 1.5, 7])
def test_state_patch_layers_not_an_index_in_range_raise_value_error_naming_layers(bad):
    """faae806 gave capture_maps / memory_spectrum one layer parser (``maps.layer_indices``);
    ``state_patch``'s twin kept its own and raised ``TypeError`` (iteration over a 0-d tensor, a float
    not iterable) where its docstring and the twins raise ``ValueError`` naming ``layers``."""
    from mnemo.interp.interventions import state_patch

    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, mixer="gla")).eval()
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="layers"):
        state_patch(m, ids, ids, 3, bad)
    # numpy / 0-d tensor integers and sequences of them still select layers
    want = state_patch(m, ids, ids[:, torch.arange(7, -1, -1)], 3, [1])[0]
    for ok in (torch.tensor(1), [torch.tensor(1)], (i for i in [1])):
        got = state_patch(m, ids, ids[:, torch.arange(7, -1, -1)], 3, ok)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
