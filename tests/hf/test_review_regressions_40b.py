"""Regression review of ffe1333 (MnemoForCausalLM, review 5-Q): what the fix refused too much or left
out on a sibling path."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402

VOCAB = 40


def test_a_padded_row_that_only_takes_more_pads_may_continue():
    """Step-by-step decoding that masks a finished row (its next tokens are pads, mask 0) worked before
    ffe1333: the pads sit at the row's end, never inside it. The right-padded-cache refusal caught
    it too. Refused only where a real token (mask 1, or no mask) would follow the pads."""
    m = tiny_mnemo_for_causal_lm("mamba", 0, VOCAB).double()  # (float32 rows of a batch differ by 1e-8)
    out = m(torch.tensor([[1, 5, 7, 2], [3, 4, 8, 1]]))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # row 1 finished: a pad
    s1 = m(torch.tensor([[6], [0]]), attention_mask=mask, cache=out.cache)
    assert s1.cache.padded_rows == [1]
    mask2 = torch.cat([mask, torch.tensor([[1], [0]])], 1)
    s2 = m(torch.tensor([[9], [0]]), attention_mask=mask2, cache=s1.cache)  # was: ValueError
    assert s2.cache.padded_rows == [1]
    alone = m(torch.tensor([[1, 5, 7, 2, 6, 9]])).logits[0, -1]
    torch.testing.assert_close(s2.logits[0, -1], alone, rtol=1e-12, atol=1e-12)
    s3 = m(torch.tensor([[2], [0]]), attention_mask=torch.tensor([[1], [0]]), cache=s2.cache)  # [B, T]
    assert s3.cache.padded_rows == [1]
    # a real token after the pads: still refused, naming the row
    for kw in ({}, {"attention_mask": torch.cat([mask2, torch.ones(2, 1, dtype=torch.long)], 1)}):
        with pytest.raises(ValueError, match=r"cache: rows \[1\] of this cache took in right padding"):
            m(torch.tensor([[9], [3]]), cache=s2.cache, **kw)


def test_special_ids_of_a_config_given_to_from_pretrained_survive_save_and_reload(tmp_path):
    """ffe1333 saves the special ids a ``MnemoConfig`` gives (``MnemoForCausalLM(config)``), but
    ``from_pretrained(path, config=that config)`` counted them as derived again: the saved folder had
    no ``generation_config.json`` and the reloaded model no end id."""
    t = tiny_mnemo_for_causal_lm("mamba", 0, VOCAB)
    t.save_pretrained(tmp_path / "m")
    cfg = MnemoConfig.from_model_config(t.model.config, pad_token_id=3, eos_token_id=5)
    m = MnemoForCausalLM.from_pretrained(tmp_path / "m", config=cfg)
    assert (m.generation_config.pad_token_id, m.generation_config.eos_token_id) == (3, 5)
    m.save_pretrained(tmp_path / "s")
    back = MnemoForCausalLM.from_pretrained(tmp_path / "s")
    assert (back.generation_config.pad_token_id, back.generation_config.eos_token_id) == (3, 5)
    # the twin path (ffe1333's fix) agrees
    MnemoForCausalLM(cfg).save_pretrained(tmp_path / "d")
    assert (tmp_path / "d" / "generation_config.json").is_file()
    # a plain folder loaded and saved again still writes none
    MnemoForCausalLM.from_pretrained(tmp_path / "m").save_pretrained(tmp_path / "p")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["config.json", "model.safetensors"]
