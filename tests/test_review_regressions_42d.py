"""Regression review 42-D of 2249b96 (MnemoForCausalLM: a converted folder's hf_config_carried.json
written again by save_pretrained) and 959da08 (steer: a per-position scale over a learned prefix)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

VOCAB = 40


def _converted_mamba(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mnemo.hf.convert import convert

    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        state_size=4,
        num_hidden_layers=1,
        expand=2,
        conv_kernel=4,
        bos_token_id=3,
        eos_token_id=5,
        pad_token_id=7,
    )
    transformers.MambaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "generation_config.json").unlink()  # the ids in config.json alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no tokenizer)
        convert(tmp_path / "src", tmp_path / "conv")
    return tmp_path / "conv"


def test_an_id_given_to_from_pretrained_of_a_converted_folder_survives_save_and_reload(tmp_path):
    """2249b96 writes the converted folder's hf_config_carried.json again on save_pretrained, verbatim:
    an ``eos_token_id`` given to ``from_pretrained`` (documented to survive save_pretrained and a
    reload, config included) came back as the source's stale id in the reloaded config (and in the
    export's config.json), while config.json (AutoConfig) and generation_config.json said the new
    one. Likewise an id set on ``model.config`` after loading. The saved record now holds the
    config's special ids."""
    transformers = pytest.importorskip("transformers")
    from mnemo.hf.convert import export_hf
    from mnemo.hf.modeling import MnemoForCausalLM

    conv = _converted_mamba(tmp_path)
    m = MnemoForCausalLM.from_pretrained(conv, eos_token_id=9)
    m.save_pretrained(tmp_path / "a")
    m2 = MnemoForCausalLM.from_pretrained(tmp_path / "a")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "a").eos_token_id == 9
    assert (m2.config.eos_token_id, m2.generation_config.eos_token_id) == (9, 9)
    assert (m2.config.bos_token_id, m2.config.pad_token_id) == (3, 7)  # the others stay the source's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(tmp_path / "a", tmp_path / "exp")
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["eos_token_id"] == 9

    # an id set on the config alone: the config's (as config.json says), the generation config keeps its own
    m = MnemoForCausalLM.from_pretrained(conv)
    m.config.eos_token_id = 11
    m.save_pretrained(tmp_path / "b")
    m3 = MnemoForCausalLM.from_pretrained(tmp_path / "b")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "b").eos_token_id == 11
    assert (m3.config.eos_token_id, m3.generation_config.eos_token_id) == (11, 5)

    # unchanged: the record is written as it was read (2249b96's own test: save -> reload -> save)
    m = MnemoForCausalLM.from_pretrained(conv)
    m.save_pretrained(tmp_path / "c")
    name = "hf_config_carried.json"
    assert json.loads((tmp_path / "c" / name).read_text()) == json.loads((conv / name).read_text())
    assert not (tmp_path / "c" / "generation_config.json").exists()


def test_a_per_row_scale_on_a_one_token_call_with_a_learned_prefix_steers_as_on_longer_calls():
    """959da08 takes a tensor scale whose position axis equals the call's length as per-position and
    zeroes the learned prefix's rows. For a one-token call that axis is 1, so a per-row scale
    ``[B, 1, 1, 1]`` (documented: per row) was read as per-position and left Titans' persistent rows
    unsteered, unlike the same scale on a longer call, a float scale, or each row steered alone
    (before 959da08 it steered them). A length-1 axis broadcasts again."""
    from mnemo.interp import steer
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("titans_lmm", vocab_size=20, d_model=16, n_layers=1)).double().eval()
    hook = "blocks.0.mixer.hook_v"  # (the prefix's values are written into the memory: visible)
    d = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = torch.randint(0, 20, (2, 2), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([2.0, 3.0], dtype=torch.float64).view(2, 1, 1, 1)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # (steered gates may be > 0: RangeWarning)
        for T in (1, 2):
            x = ids[:, :T]
            got = model.run_with_hooks(x, steer(model, hook, d, scale=rows))[0]
            alone = [
                model.run_with_hooks(x[b : b + 1], steer(model, hook, d, scale=float(rows[b])))[0]
                for b in (0, 1)
            ]
            torch.testing.assert_close(got, torch.cat(alone), rtol=0, atol=1e-12)
        # a per-position scale over a longer call still leaves the prefix (959da08's fix)
        s = torch.tensor([1.5, -0.5], dtype=torch.float64)
        got = model.run_with_hooks(ids, steer(model, hook, d, scale=s.view(1, 2, 1, 1)))[0]
        from mnemo.interp import compose

        hand = model.run_with_hooks(
            ids, compose(*[steer(model, hook, d, scale=float(s[t]), positions=[t]) for t in (0, 1)])
        )[0]
        torch.testing.assert_close(got, hand, rtol=0, atol=1e-12)
