"""Regressions of cb30448 (HF review 4): what the fixes broke or left out."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402

VOCAB = 40


def _old_retnet_folder(tmp_path):
    """A ``retnet`` checkpoint saved before the preset's ``expand_v`` became 2.0: its config.json
    names no ``expand_v`` and its weights have the old width (``LanguageModel.from_pretrained`` reads
    it with ``expand_v = 1.0``)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=2,
        mixer="retnet",
        mixer_options={"retnet": {"n_heads": 4, "expand_v": 1.0}},
    )
    lm = LanguageModel(cfg).eval()
    lm.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["mixer_options"]["retnet"]["expand_v"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return lm


@pytest.mark.parametrize("how", ["auto", "auto_config"])
def test_auto_model_loads_a_folder_whose_config_the_loader_completes(how, tmp_path):
    """cb30448 refuses a ``config`` whose model fields differ from the loaded model's. The loader
    completes some config.json files (an old ``retnet`` folder gets ``expand_v = 1.0`` from its
    weights), so ``AutoModelForCausalLM.from_pretrained(folder)`` — which passes the ``AutoConfig``
    of that very config.json — was refused, naming config.json as disagreeing with itself. It loads,
    and ``model.config`` says the model that computes."""
    lm = _old_retnet_folder(tmp_path)
    if how == "auto":
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    else:
        cfg = transformers.AutoConfig.from_pretrained(tmp_path)
        m = MnemoForCausalLM.from_pretrained(tmp_path, config=cfg)
    assert m.config.mixer_options == {"retnet": {"n_heads": 4, "expand_v": 1.0}}
    assert m.config.to_model_config() == m.model.config
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, lm(ids)[0])
    # a field that really differs from config.json is still refused
    with pytest.raises(ValueError, match=r"^norm_eps: "):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, norm_eps=0.5)


def test_end_ids_taken_from_the_source_survive_save_pretrained(tmp_path):
    """cb30448 sets ``generation_config``'s special ids from ``hf_config_carried.json`` (or a foreign
    config.json) but counts them as derived, so ``save_pretrained`` wrote them nowhere: the model
    saved and loaded again no longer stopped at the EOS it stopped at before saving."""
    from mnemo.hf.convert import convert

    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4)
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = 7, 1, 0
    transformers.MambaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "hf", tmp_path / "mn")
    for folder in ("mn", "hf"):
        m = MnemoForCausalLM.from_pretrained(tmp_path / folder)
        assert m.generation_config.eos_token_id == 7
        m.save_pretrained(tmp_path / f"re_{folder}")
        back = MnemoForCausalLM.from_pretrained(tmp_path / f"re_{folder}")
        got = (back.generation_config.bos_token_id, back.generation_config.eos_token_id)
        assert got + (back.generation_config.pad_token_id,) == (1, 7, 0), folder


@pytest.mark.parametrize("key", ["output_hidden_states", "output_attentions"])
def test_hidden_states_asked_for_through_the_config_are_refused_too(key, tmp_path):
    """cb30448 refuses ``output_hidden_states=True`` given to ``forward`` / ``generate``; the same
    request through the config (``from_pretrained(path, output_hidden_states=True)``, or
    ``model.config.output_hidden_states = True``, which ``transformers``' models follow when the
    argument is not given) still came back as ``None``, silently."""
    torch.manual_seed(0)
    lm = LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, mixer="mamba")).eval()
    lm.save_pretrained(tmp_path)
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    m = MnemoForCausalLM.from_pretrained(tmp_path, **{key: True})
    with pytest.raises(ValueError, match=rf"^{key}: not supported"), torch.no_grad():
        m(ids)
    with torch.no_grad():  # the argument False wins over the config, as in transformers
        assert torch.equal(m(ids, **{key: False}).logits, lm(ids)[0])
    m = MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm)
    setattr(m.config, key, True)
    with pytest.raises(ValueError, match=rf"^{key}: not supported"):
        m.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)


def test_convert_docstring_no_longer_says_the_hf_class_ignores_the_source_eos():
    """cb30448 makes ``MnemoForCausalLM.from_pretrained`` set the source's end id; ``convert``'s
    docstring still said ``MnemoForCausalLM.generate`` stops only when passed ``eos_token_id=``."""
    from mnemo.hf.convert import convert

    doc = " ".join(convert.__doc__.split())
    assert "only when ``transformers``' ``generate`` is passed ``eos_token_id=``" not in doc


def test_a_damaged_carried_file_is_named_not_a_bare_json_error(tmp_path):
    """cb30448 made ``from_pretrained`` read ``hf_config_carried.json``; a damaged one raised a bare
    ``JSONDecodeError`` naming no file (``mnemo generate`` and ``export_hf`` name it)."""
    torch.manual_seed(0)
    LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=1, mixer="mamba")).save_pretrained(
        tmp_path
    )
    (tmp_path / "hf_config_carried.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"corrupt file .*hf_config_carried\.json"):
        MnemoForCausalLM.from_pretrained(tmp_path)
