"""Fifth review of the Hugging Face interop: config overrides at ``from_pretrained`` as ``transformers``
takes them, a wrapped model whose config disagrees with the given one, the loss's dtype, and the
defects found by the break-it pass."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402

VOCAB = 40


def _mnemo(mixer: str = "mamba", seed: int = 0, **over) -> MnemoForCausalLM:
    return tiny_mnemo_for_causal_lm(mixer, seed, VOCAB, **over)


# ---------------------------------------------------------------------------------------------
# part 1: the previous session's leftovers


def test_from_pretrained_takes_special_token_ids_as_transformers_does(tmp_path):
    """``from_pretrained(path, pad_token_id=3)`` sets the config's and the generation config's id, as
    ``transformers`` does for its own models (GPT-2 here), and the id survives save -> load."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", pad_token_id=3, eos_token_id=5)
    assert (ref.config.pad_token_id, ref.generation_config.pad_token_id) == (3, 3)
    assert (ref.config.eos_token_id, ref.generation_config.eos_token_id) == (5, 5)

    _mnemo().save_pretrained(tmp_path / "m")
    m = MnemoForCausalLM.from_pretrained(tmp_path / "m", pad_token_id=3, eos_token_id=5)
    assert (m.config.pad_token_id, m.generation_config.pad_token_id) == (3, 3)
    assert (m.config.eos_token_id, m.generation_config.eos_token_id) == (5, 5)
    m.save_pretrained(tmp_path / "again")
    back = MnemoForCausalLM.from_pretrained(tmp_path / "again")
    assert (back.generation_config.pad_token_id, back.generation_config.eos_token_id) == (3, 5)
    # generate stops at the given end id (this model repeats 4 after this prompt: it stops at once)
    m = MnemoForCausalLM.from_pretrained(tmp_path / "m", eos_token_id=4)
    ids = torch.tensor([[1, 2, 4]])
    free = m.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert free[0, 3:].tolist() == [4] * 5
    assert m.generate(ids, max_new_tokens=5, do_sample=False)[0, 3:].tolist() == [4]


def test_from_pretrained_names_an_unknown_argument_and_a_bad_token_id(tmp_path):
    _mnemo().save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="bogus"):
        MnemoForCausalLM.from_pretrained(tmp_path, bogus=1)
    with pytest.raises(ValueError, match=r"pad_token_id.*0 \.\. 39.*got 40"):
        MnemoForCausalLM.from_pretrained(tmp_path, pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="eos_token_id.*'x'"):
        MnemoForCausalLM.from_pretrained(tmp_path, eos_token_id="x")


def test_wrapping_a_model_whose_config_differs_is_refused_naming_the_fields():
    torch.manual_seed(0)
    lm = LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, mixer="mamba"))
    other = MnemoConfig.from_model_config(lm.config)
    other.vocab_size, other.d_model = 50, 32
    with pytest.raises(ValueError, match=r"config: differs") as e:
        MnemoForCausalLM(other, model=lm)
    assert "d_model (expected 16, got 32)" in str(e.value)
    assert "vocab_size (expected 40, got 50)" in str(e.value)
    preset = MnemoConfig.from_model_config(lm.config)
    preset.mixer = "gla"
    with pytest.raises(ValueError, match=r"mixer.*'mamba'.*'gla'"):
        MnemoForCausalLM(preset, model=lm)
    MnemoForCausalLM(MnemoConfig.from_model_config(lm.config), model=lm)  # agreeing: fine


def test_loss_of_a_float64_model_is_float64_and_equals_a_hand_cross_entropy():
    m = _mnemo().double()
    ids = torch.tensor([[1, 5, 7, 2, 9, 4], [3, 3, 8, 1, 0, 6]])
    labels = ids.clone()
    labels[0, 2] = -100
    labels[1, 5] = -100
    out = m(ids, labels=labels)
    assert out.loss.dtype == torch.float64
    logp = torch.log_softmax(out.logits.double(), -1)
    terms = [-logp[b, t - 1, labels[b, t]] for b in range(2) for t in range(1, 6 + 0) if labels[b, t] != -100]
    want = torch.stack(terms).mean()
    assert len(terms) == 8
    torch.testing.assert_close(out.loss, want, rtol=1e-13, atol=1e-13)
    # bf16 stays float32 (as mnemo's own losses)
    b = _mnemo().to(torch.bfloat16)
    assert b(ids, labels=labels).loss.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# part 2: the break-it pass


def test_logits_to_keep_slices_the_logits_as_transformers_does():
    """``logits_to_keep`` was swallowed by ``**kwargs``: all ``T`` positions came back where a
    ``transformers`` model returns the last ``n``. Now it slices as ``transformers`` does (int, 1-D
    positions; other tensors refused; review 6: 2-D as transformers 5), the old name
    ``num_logits_to_keep`` too, and the loss still covers every labelled position."""
    m = _mnemo()
    ids = torch.tensor([[1, 5, 7, 2, 9, 4], [3, 3, 8, 1, 0, 6]])
    full = m(ids, labels=ids)
    assert m(ids, logits_to_keep=0).logits.shape == (2, 6, VOCAB)
    out = m(ids, logits_to_keep=1, labels=ids)
    assert out.logits.shape == (2, 1, VOCAB)
    torch.testing.assert_close(out.logits, full.logits[:, -1:], rtol=0, atol=0)
    torch.testing.assert_close(out.loss, full.loss, rtol=0, atol=0)
    torch.testing.assert_close(m(ids, num_logits_to_keep=2).logits, full.logits[:, -2:], rtol=0, atol=0)
    pos = torch.tensor([0, 3])
    torch.testing.assert_close(m(ids, logits_to_keep=pos).logits, full.logits[:, [0, 3]], rtol=0, atol=0)
    # (2-D tensors are taken as transformers 5 takes them: tests/hf/test_review6_interop.py)
    for other in (torch.zeros(2, 6, 1, dtype=torch.long), torch.tensor(True)):  # (1-D bool: review 7)
        with pytest.raises(ValueError, match=r"logits_to_keep: expected an int >= 0 or an integer tensor"):
            m(ids, logits_to_keep=other)
    torch.testing.assert_close(m(ids, logits_to_keep=None).logits, full.logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="logits_to_keep= or num_logits_to_keep="):
        m(ids, logits_to_keep=1, num_logits_to_keep=2)
    with pytest.raises(ValueError, match=r"logits_to_keep.*int >= 0.*got -1"):
        m(ids, logits_to_keep=-1)
    # generate (which now passes logits_to_keep=1) still makes what the full logits make
    got = m.generate(ids, max_new_tokens=4, do_sample=False)
    want = m.model.generate(ids, max_new_tokens=4, temperature=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_resize_token_embeddings_grows_the_vocabulary_and_round_trips(tie, tmp_path):
    """``resize_token_embeddings`` (adding a pad token, as done for ``transformers`` models) raised
    ``NotImplementedError`` (no ``set_input_embeddings``). Now the vocabulary grows in both configs,
    the old tokens' logits are unchanged, a tied head stays tied, and the model saves and reloads."""
    m = _mnemo(tie_embeddings=tie)
    ids = torch.tensor([[1, 5, 7, 2, 9, 4]])
    before = m(ids).logits
    m.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    after = m(ids).logits
    assert after.shape == (1, 6, VOCAB + 8)
    assert (m.config.vocab_size, m.model.config.vocab_size) == (VOCAB + 8, VOCAB + 8)
    assert (m.model.lm_head.weight is m.model.embed.weight) == tie
    torch.testing.assert_close(after[..., :VOCAB], before, rtol=0, atol=0)
    m(torch.tensor([[VOCAB + 7]]))  # a new id is in the vocabulary
    m.save_pretrained(tmp_path)
    back = MnemoForCausalLM.from_pretrained(tmp_path)
    assert back.config.vocab_size == VOCAB + 8
    torch.testing.assert_close(back(ids).logits, after, rtol=0, atol=0)


def test_special_ids_given_in_the_config_survive_save_and_reload(tmp_path):
    """``MnemoConfig(..., pad_token_id=3, eos_token_id=2)``: ``transformers`` derives the generation
    config from them, but ``save_pretrained`` wrote neither (mnemo's ``config.json`` does not hold them
    and the derived generation config counted as saying nothing more): the reloaded model had no end
    id. Now ``generation_config.json`` keeps them, as a ``transformers`` model's ``config.json`` does."""
    cfg = MnemoConfig(vocab_size=VOCAB, d_model=16, n_layers=1, mixer="mamba", pad_token_id=3, eos_token_id=2)
    m = MnemoForCausalLM(cfg)
    assert (m.generation_config.pad_token_id, m.generation_config.eos_token_id) == (3, 2)
    m.save_pretrained(tmp_path)
    back = MnemoForCausalLM.from_pretrained(tmp_path)
    assert (back.generation_config.pad_token_id, back.generation_config.eos_token_id) == (3, 2)
    # a model whose config gives none still writes no generation_config.json
    _mnemo().save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "generation_config.json").exists()


def test_continuing_a_cache_that_took_in_right_padding_is_refused():
    """A right-padded forward is harmless for its own logits, but the returned cache's padded rows hold
    the pads in their state: continuing it with a ``[B, T]`` mask (or none) put them inside the row
    silently (the ``[B, S + T]`` mask was refused, the shorter one not). Now refused by name."""
    m = _mnemo()
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    out = m(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits[1, :4], m(ids[1:2, :4]).logits[0], rtol=1e-5, atol=1e-6)  # fine
    assert out.cache.padded_rows == [1]
    nxt = torch.tensor([[3], [4], [5]])
    for kw in ({}, {"attention_mask": torch.ones(3, 1, dtype=torch.long)}):
        with pytest.raises(ValueError, match=r"cache: rows \[1\] of this cache took in right padding"):
            m(nxt, cache=out.cache, **kw)
    # beam reordering keeps track of the padded row; a cache without it continues
    out.cache.reorder_cache(torch.tensor([0, 2, 1, 1]))
    assert out.cache.padded_rows == [2, 3]
    out.cache.reorder_cache(torch.tensor([0, 1]))
    assert out.cache.padded_rows == []
    m(nxt[:2], cache=out.cache)
