"""Regression review 42h: the special ids ``MnemoForCausalLM.save_pretrained`` now writes to a
mnemo ``config.json`` (6f83dd3), read by every mnemo reader of the folder as ``AutoConfig`` and
``MnemoForCausalLM.from_pretrained`` read them."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _saved(path, pad=None, eos=None, tokenizer=True):
    """A ``MnemoForCausalLM`` folder whose special ids were set on the config after the model was
    built (``save_pretrained`` then writes them to ``config.json`` and no ``generation_config.json``),
    with a byte-level BPE tokenizer (``<|endoftext|>`` = 0) when ``tokenizer``."""
    pytest.importorskip("transformers")
    from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM
    from tests.test_leftovers_42 import _bpe_folder

    tok, lm = _bpe_folder(path.parent / "src")
    m = MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm)
    m.config.pad_token_id, m.config.eos_token_id = pad, eos
    m.save_pretrained(path)
    if tokenizer:
        tok.save(path)
    assert not (path / "generation_config.json").exists()
    return tok


def test_generate_and_the_harness_read_the_eos_id_of_a_mnemo_config_json(tmp_path):
    """``checkpoint_eos`` (``mnemo generate``, ``mnemo eval``'s harness) read no id from a mnemo
    ``config.json``, which now holds the ids ``save_pretrained`` had: ``from_pretrained`` and
    ``AutoConfig`` stop at eos 5 while ``mnemo generate`` ran past it."""
    from mnemo.hf.modeling import MnemoForCausalLM
    from mnemo.hf.special_ids import checkpoint_eos

    _saved(tmp_path / "a", eos=5, tokenizer=False)
    assert MnemoForCausalLM.from_pretrained(tmp_path / "a").generation_config.eos_token_id == 5
    assert checkpoint_eos(tmp_path / "a") == 5


def test_a_config_json_with_a_pad_id_alone_keeps_the_tokenizers_eos(tmp_path):
    """A mnemo folder whose ``config.json`` holds only ``pad_token_id`` lost the end-of-text token of
    its tokenizer as ``eos_token_id`` (before 6f83dd3 such a folder had no ids in ``config.json`` and
    got it), while ``export_hf`` and ``mnemo generate`` still stop there."""
    from mnemo.hf.modeling import MnemoForCausalLM

    tok = _saved(tmp_path / "a", pad=3)
    m = MnemoForCausalLM.from_pretrained(tmp_path / "a")
    assert (m.config.eos_token_id, m.generation_config.eos_token_id) == (tok.eot_id, tok.eot_id)
    assert (m.config.pad_token_id, m.generation_config.pad_token_id) == (3, 3)


def test_export_writes_the_ids_of_a_mnemo_config_json(tmp_path):
    """``export_hf`` of a mnemo folder wrote its tokenizer's eos and null for the others, dropping the
    ids its ``config.json`` now holds (``AutoConfig`` of the source said pad 3, eos 5)."""
    import warnings

    from mnemo.hf.convert import export_hf

    _saved(tmp_path / "a", pad=3, eos=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(tmp_path / "a", tmp_path / "exp")
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, 5, 3)
    # a pad id alone: the tokenizer's end-of-text token is still the eos
    _saved(tmp_path / "b", pad=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(tmp_path / "b", tmp_path / "exp-b")
    cfg = json.loads((tmp_path / "exp-b" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, 0, 3)


def test_a_config_json_id_leaves_the_others_to_generation_config_json(tmp_path):
    """A mnemo folder whose ``config.json`` holds a pad id and whose ``generation_config.json`` holds
    the eos: ``from_pretrained``'s config took no eos (any id in ``config.json`` made it read that file
    alone), where the docstring (and the code before 6f83dd3) fill each id it leaves None from
    ``generation_config.json``."""
    from mnemo.hf.modeling import MnemoForCausalLM

    _saved(tmp_path / "src-a", tokenizer=False)
    m = MnemoForCausalLM.from_pretrained(tmp_path / "src-a")
    m.config.pad_token_id = 3
    m.generation_config.eos_token_id = 7
    m.save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "generation_config.json").read_text())["eos_token_id"] == 7
    back = MnemoForCausalLM.from_pretrained(tmp_path / "a")
    assert (back.config.pad_token_id, back.config.eos_token_id) == (3, 7)
    assert back.generation_config.eos_token_id == 7
