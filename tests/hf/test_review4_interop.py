"""Fourth review of the Hugging Face interop: ``generate``'s length with learned positions as
``transformers`` sets it for its own models (``config.max_position_embeddings``), the refusal naming
the argument that was set, and the defects found by the break-it pass."""

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
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402

VOCAB = 40


def _mnemo(mixer: str = "mamba", seed: int = 0, **over) -> MnemoForCausalLM:
    return tiny_mnemo_for_causal_lm(mixer, seed, VOCAB, **over)


def _gpt2(n_positions: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg).eval()


# ---------------------------------------------------------------------------------------------
# part 1: max_position_embeddings and generate's default length


def test_config_carries_max_position_embeddings_derived_from_the_position_limit(tmp_path):
    """``max_position_embeddings`` is ``max_position`` with learned positions and ``None`` where
    positions are unbounded; it is not written (mnemo's config.json keeps its fields), so a config
    saved before it existed loads through ``AutoConfig`` / ``from_pretrained`` with the same value; a
    disagreeing value is refused by name."""
    learned = _mnemo("gla", pos_embedding="learned", max_position=12)
    assert learned.config.max_position_embeddings == 12
    assert _mnemo("gla").config.max_position_embeddings is None
    learned.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "max_position_embeddings" not in saved and saved["max_position"] == 12
    assert transformers.AutoConfig.from_pretrained(tmp_path).max_position_embeddings == 12
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.config.max_position_embeddings == 12
    assert MnemoConfig(max_position_embeddings=None).max_position_embeddings is None
    with pytest.raises(ValueError, match=r"max_position_embeddings: .*expected 12\), got 30"):
        MnemoConfig(pos_embedding="learned", max_position=12, max_position_embeddings=30)


@pytest.mark.parametrize("prompt", [3, 6, 11])
def test_default_generate_is_capped_at_max_position_embeddings_as_transformers_does(prompt):
    """Without ``max_new_tokens`` / ``max_length``, ``transformers`` generates 20 new tokens capped
    at ``config.max_position_embeddings`` (GPT-2 with ``n_positions=12`` as the witness); a mnemo
    model with learned positions was refused up front instead."""
    m = _mnemo("gla", pos_embedding="learned", max_position=12)
    ids = torch.randint(1, VOCAB, (2, prompt), generator=torch.Generator().manual_seed(prompt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_len = _gpt2(12).generate(ids, do_sample=False, pad_token_id=0).shape[1]
        out = m.generate(ids, do_sample=False, pad_token_id=0)
    assert want_len == 12 and out.shape == (2, want_len)
    assert torch.equal(out, m.generate(ids, do_sample=False, pad_token_id=0, max_new_tokens=12 - prompt))
    assert torch.equal(out, m.model.generate(ids, max_new_tokens=12 - prompt, temperature=0))


def test_default_generate_with_a_prompt_that_fills_the_positions_is_refused_by_name():
    """A prompt of ``max_position`` tokens leaves the capped default no new token (``transformers``
    refuses it for GPT-2 too); refused before any work, naming ``input_ids`` and the lengths; an
    explicit ``max_new_tokens=1`` still fits."""
    m = _mnemo("gla", pos_embedding="learned", max_position=12)
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _gpt2(12).generate(ids, do_sample=False, pad_token_id=0)
    calls = []
    m.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"input_ids: a prompt of 12 tokens.*max_position = 12"):
        m.generate(ids, do_sample=False, pad_token_id=0)
    assert calls == []
    assert m.generate(ids, do_sample=False, pad_token_id=0, max_new_tokens=1).shape == (1, 13)


@pytest.mark.parametrize("where", ["argument", "generation_config", "model_generation_config"])
def test_refusal_past_the_positions_names_max_length_when_max_length_was_set(where):
    """The refusal named ``max_new_tokens`` when ``max_length`` (the argument, a given generation
    config's or the model's) was the bound; it names ``max_length`` with its value and the most
    that fits (``max_position + 1``: the last token is not read)."""
    m = _mnemo("gla", pos_embedding="learned", max_position=12)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    kw = {}
    if where == "argument":
        kw["max_length"] = 20
    elif where == "generation_config":
        kw["generation_config"] = transformers.GenerationConfig(max_length=20)
    else:
        m.generation_config.max_length = 20
    with pytest.raises(ValueError) as e:
        m.generate(ids, do_sample=False, pad_token_id=0, **kw)
    msg = str(e.value)
    assert msg.startswith("max_length: 20 tokens") and "max_new_tokens:" not in msg, msg
    assert "max_position = 12" in msg and "at most 13" in msg, msg
    kw13 = {k: v for k, v in kw.items() if k != "max_length"}
    if where == "argument":
        kw13["max_length"] = 13
    elif where == "generation_config":
        kw13["generation_config"] = transformers.GenerationConfig(max_length=13)
    else:
        m.generation_config.max_length = 13
    out = m.generate(ids, do_sample=False, pad_token_id=0, **kw13)  # 13 = max_position + 1 fits
    assert torch.equal(out, m.model.generate(ids, max_new_tokens=7, temperature=0))
    # max_new_tokens keeps its own name (it takes precedence over max_length, as in transformers)
    with pytest.raises(ValueError, match=r"^max_new_tokens: a prompt of 6 tokens and 8 new ones"):
        m.generate(ids, do_sample=False, pad_token_id=0, max_new_tokens=8, **kw)


# ---------------------------------------------------------------------------------------------
# part 2: break-it findings


@pytest.mark.parametrize("how", ["argument", "config", "auto"])
def test_from_pretrained_refuses_a_model_field_that_differs_from_the_checkpoint(how, tmp_path):
    """``from_pretrained(path, norm_eps=0.5)`` (or a ``config=`` saying another model field) set the
    field on ``model.config`` while the weights computed the checkpoint's model: the config lied
    about the logits, silently. Refused, naming the field and both values; ``use_cache`` and the
    same values stay accepted."""
    m = _mnemo("mamba")
    m.save_pretrained(tmp_path)
    if how == "argument":
        call = lambda: MnemoForCausalLM.from_pretrained(tmp_path, norm_eps=0.5)  # noqa: E731
    elif how == "config":
        cfg = MnemoConfig.from_model_config(m.model.config)
        cfg.norm_eps = 0.5
        call = lambda: MnemoForCausalLM.from_pretrained(tmp_path, config=cfg)  # noqa: E731
    else:
        call = lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp_path, norm_eps=0.5)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"^norm_eps: .*0\.5 differs from the checkpoint's config\.json \(1e-05\)"
    ):
        call()
    ok = MnemoForCausalLM.from_pretrained(tmp_path, use_cache=False, norm_eps=1e-5)
    assert ok.config.use_cache is False and ok.model.config.norm_eps == 1e-5
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).config.norm_eps == 1e-5


@pytest.mark.parametrize("key", ["output_hidden_states", "output_attentions"])
def test_hidden_states_or_attentions_asked_for_are_refused_not_returned_as_none(key):
    """``forward(..., output_hidden_states=True)`` and ``generate(..., output_hidden_states=True,
    return_dict_in_generate=True)`` gave ``None`` (a tuple of ``None``) silently; refused by name.
    ``False`` stays accepted."""
    m = _mnemo("mamba")
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(ids).logits
        assert torch.equal(m(ids, **{key: False}).logits, want)
        with pytest.raises(ValueError, match=rf"^{key}: not supported .*got True"):
            m(ids, **{key: True})
    with pytest.raises(ValueError, match=rf"^{key}: not supported"):
        m.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, **{key: True})


def test_converted_checkpoint_without_generation_config_stops_at_the_source_eos(tmp_path):
    """A source folder whose special ids live only in ``config.json`` (no ``generation_config.json``):
    ``transformers`` derives its generation config from them and stops at the EOS; the converted
    checkpoint through ``MnemoForCausalLM`` knew no EOS and generated past it (while ``mnemo
    generate`` stopped there). Now the ids kept from the source set ``generation_config``, and the
    generated rows equal ``transformers``' (the EOS chosen so that greedy decoding meets it)."""
    from mnemo.hf.convert import convert

    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4)
    hf = transformers.MambaForCausalLM(cfg).eval()
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    free = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eos = int(free[0, 7])  # the third new token of row 0
    hf.config.eos_token_id, hf.config.bos_token_id, hf.config.pad_token_id = eos, 1, 0
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)
    want_model = transformers.MambaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert want_model.generation_config.eos_token_id == eos
    want = want_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert not torch.equal(want, free)  # transformers stopped row 0 at the EOS (pads after it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "hf", tmp_path / "mn")
    for folder in ("mn", "hf"):  # converted, and the foreign folder loaded directly
        m = MnemoForCausalLM.from_pretrained(tmp_path / folder)
        assert (m.generation_config.eos_token_id, m.generation_config.pad_token_id) == (eos, 0), folder
        assert torch.equal(m.generate(ids, max_new_tokens=8, do_sample=False), want), folder


def test_mamba_intermediate_size_decides_d_inner_as_in_transformers(tmp_path):
    """``MambaMixer`` is built from ``intermediate_size`` (``expand`` only sets its default); a
    folder that ``transformers`` saves and loads with ``intermediate_size = 3 · hidden_size`` and
    ``expand = 2`` was refused ("the config and the weights disagree"). It imports with the logits
    of ``transformers`` (float64) and exports back to a folder ``transformers`` loads with the same
    logits; an ``intermediate_size`` mnemo cannot express is named."""
    from mnemo.hf.convert import convert, export_hf
    from tests.helpers import rel_rms

    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4, intermediate_size=48
    )
    hf = transformers.MambaForCausalLM(cfg).double().eval()
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (saved["intermediate_size"], saved["expand"]) == (48, 2)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "hf", tmp_path / "mn")
    m = MnemoForCausalLM.from_pretrained(tmp_path / "mn", dtype=torch.float64)
    assert m.model.config.mixer_options["mamba"]["expand"] == 3
    with torch.no_grad():
        want = hf(ids).logits
        assert rel_rms(m(ids).logits, want) < 1e-6  # (transformers computes its scan in float32)
    export_hf(tmp_path / "mn", tmp_path / "back")
    back = transformers.MambaForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64).eval()
    assert back.config.intermediate_size == 48
    with torch.no_grad():
        assert rel_rms(back(ids).logits, want) < 1e-6
    bad = dict(saved, intermediate_size=40)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(
        ValueError, match=r"field 'intermediate_size': expected a positive multiple .* got 40"
    ):
        convert(tmp_path / "hf", tmp_path / "mn2")
