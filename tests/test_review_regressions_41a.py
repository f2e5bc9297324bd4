"""Regression review of c929cfd (MnemoForCausalLM special ids, logits_to_keep, save_pretrained) and
c811b8f (refill_meta_constants): what the fixes broke or left out."""

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


def test_from_pretrained_leaves_the_given_config_alone(tmp_path):
    """c929cfd fills the config's special ids that it leaves ``None`` from the folder, on the
    ``config=`` object the caller passed: a config reused for a second folder (one without ids) then
    carried the first folder's end id into that model's config and, derived from it, its
    ``generation_config`` (its ``generate`` stopped at another folder's EOS, and ``save_pretrained``
    wrote it). ``transformers`` copies the config it is given ("we do not want to modify the config
    inplace in from_pretrained")."""
    tiny_mnemo_for_causal_lm("mamba", 0, VOCAB).save_pretrained(tmp_path / "b")
    MnemoForCausalLM.from_pretrained(tmp_path / "b", eos_token_id=5).save_pretrained(tmp_path / "a")
    # (config.json now holds the ids save_pretrained had: test_leftovers_42 — a config without them,
    # whose None ids from_pretrained fills, is the one read from "b")
    assert MnemoConfig.from_pretrained(tmp_path / "a").eos_token_id == 5
    cfg = MnemoConfig.from_pretrained(tmp_path / "b")
    a = MnemoForCausalLM.from_pretrained(tmp_path / "a", config=cfg, use_cache=False)
    assert (a.config.eos_token_id, a.generation_config.eos_token_id, a.config.use_cache) == (5, 5, False)
    assert (cfg.eos_token_id, cfg.use_cache) == (None, True)  # the caller's object, unchanged
    b = MnemoForCausalLM.from_pretrained(tmp_path / "b", config=cfg)
    assert (b.config.eos_token_id, b.generation_config.eos_token_id) == (None, None)


def test_save_pretrained_takes_its_own_state_dict_with_a_nan_weight(tmp_path):
    """c929cfd refuses a ``state_dict`` that is not the model's own, comparing with ``torch.equal``; a
    NaN never equals itself, so the model's own weights were refused as "differing" once any was NaN
    (a diverged run saved for inspection; ``Trainer`` passes ``model.state_dict()`` for a compiled
    model). It wrote them before; it writes them now, and still refuses another state dict."""
    m = tiny_mnemo_for_causal_lm("mamba", 0, VOCAB)
    with torch.no_grad():
        m.model.embed.weight[3, 0] = float("nan")
    own = m.state_dict()
    m.save_pretrained(tmp_path / "own", state_dict=own)
    m.save_pretrained(tmp_path / "compiled", state_dict={f"_orig_mod.{k}": v for k, v in own.items()})
    back = MnemoForCausalLM.from_pretrained(tmp_path / "own")
    assert torch.equal(back.model.embed.weight.isnan(), m.model.embed.weight.isnan())
    edited = {k: v.clone() for k, v in own.items()}
    edited["model.embed.weight"][3, 1] += 1
    with pytest.raises(NotImplementedError, match=r"state_dict: .*differs in \['model.embed.weight'"):
        m.save_pretrained(tmp_path / "edited", state_dict=edited)


def test_meta_constants_wait_for_the_weights_a_strict_false_load_left_on_meta():
    """c811b8f's hook recomputes the constants (rotary frequencies) once any weight of the mixer is
    real: after ``load_state_dict(sd, strict=False, assign=True)`` without ``q_proj`` the first forward,
    which failed on the meta frequencies before, ran and returned numbers computed with the meta
    ``q_proj`` (a CPU product with a meta weight is uninitialised memory): garbage, silently. The
    constants now wait for the mixer's weights; the load that brings the rest (a next shard) fills
    them, and the model equals an eager one."""
    from mnemo.models import LanguageModel, build_config

    cfg = build_config("transformer", vocab_size=13, d_model=16, n_layers=1)
    torch.manual_seed(0)
    ref = LanguageModel(cfg)
    with torch.device("meta"):
        lazy = LanguageModel(cfg)
    sd = ref.state_dict()
    first = {k: v for k, v in sd.items() if "q_proj" not in k}
    assert lazy.load_state_dict(first, strict=False, assign=True).missing_keys == [
        "blocks.0.mixer.q_proj.weight"
    ]
    assert lazy.blocks[0].mixer.rotary.inv_freq.is_meta
    ids = torch.randint(0, 13, (2, 7))
    with pytest.raises((RuntimeError, NotImplementedError)):
        lazy(ids)
    rest = {k: v for k, v in sd.items() if k not in first}
    lazy.load_state_dict(rest, strict=False, assign=True)
    assert not any(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    with torch.no_grad():
        assert torch.equal(lazy(ids)[0], ref(ids)[0])
