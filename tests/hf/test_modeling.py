"""mnemo checkpoints as ``transformers`` models (mnemo/hf/modeling.py): Auto loading, logits,
greedy generation, the recurrent state as the generation cache, config.json's model_type."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from mnemo.hf.modeling import MnemoCache, MnemoConfig, MnemoForCausalLM  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402

VOCAB = 40
MIXERS = ["gla", "attention", "mamba"]


def _tiny(mixer: str, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, mixer=mixer)).eval()


@pytest.fixture(scope="module", params=MIXERS)
def saved(request, tmp_path_factory):
    lm = _tiny(request.param)
    d = tmp_path_factory.mktemp(request.param)
    lm.save_pretrained(d)
    return lm, d


def test_auto_classes_load_a_mnemo_checkpoint(saved):
    lm, d = saved
    assert json.loads((d / "config.json").read_text())["model_type"] == "mnemo"
    cfg = AutoConfig.from_pretrained(d)
    assert isinstance(cfg, MnemoConfig) and cfg.to_model_config() == lm.config
    model = AutoModelForCausalLM.from_pretrained(d)
    assert isinstance(model, MnemoForCausalLM) and not model.training
    # the weights are mnemo's, under their own names
    ref = lm.state_dict()
    for name, t in model.model.state_dict().items():
        assert torch.equal(t, ref[name]), name


def test_logits_equal_mnemo(saved):
    lm, d = saved
    model = AutoModelForCausalLM.from_pretrained(d)
    x = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = lm(x)
        out = model(x)
    assert (out.logits - expected).abs().max().item() == 0.0
    # labels: the transformers convention (shifted inside) equals mnemo's loss
    loss = model(x, labels=x).loss
    assert torch.allclose(loss, lm.loss(x[:, :-1], x[:, 1:]), atol=1e-6)


def test_greedy_generate_equals_mnemo_and_cache_equals_no_cache(saved):
    lm, d = saved
    model = AutoModelForCausalLM.from_pretrained(d)
    x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    expected = lm.generate(x, 12, temperature=0)
    cached = model.generate(x, max_new_tokens=12, do_sample=False)
    uncached = model.generate(x, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, expected)
    assert torch.equal(uncached, expected)


def test_cache_continues_the_sequence(saved):
    """Feeding the returned cache (or past_key_values=, or the plain list of states) with the next
    tokens equals one forward pass over the whole sequence."""
    lm, d = saved
    model = AutoModelForCausalLM.from_pretrained(d)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x).logits
        first = model(x[:, :5])
        assert isinstance(first.cache, MnemoCache) and first.cache.get_seq_length() == 5
        assert len(first.cache) == 2 and first.past_key_values is first.cache
        step = model(x[:, 5:6], cache=first.cache)
        rest = model(x[:, 6:], past_key_values=step.cache)
        as_list = model(x[:, 5:], cache=list(first.cache.states))
    assert step.cache.get_seq_length() == 6
    assert torch.allclose(torch.cat([first.logits, step.logits, rest.logits], 1), full, atol=1e-5)
    assert torch.allclose(as_list.logits, full[:, 5:], atol=1e-5)
    assert model(x, use_cache=False).cache is None


def test_beam_search_runs(saved):
    _, d = saved
    model = AutoModelForCausalLM.from_pretrained(d)
    x = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(4))
    out = model.generate(x, max_new_tokens=4, num_beams=2, do_sample=False)
    assert out.shape == (2, 8) and torch.equal(out[:, :4], x)


def test_padding_rules():
    model = MnemoForCausalLM(MnemoConfig(vocab_size=VOCAB, d_model=32, n_layers=1, mixer="gla"))
    x = torch.randint(0, VOCAB, (2, 5))
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    full = model(x).logits
    assert torch.allclose(model(x, attention_mask=right).logits, full)  # causal: right padding unseen
    with pytest.raises(ValueError, match="attention_mask: padding must be at the left"):
        model(x, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 2, 32))
    # left padding with a mixer that uses positions: refused, naming it
    att = MnemoForCausalLM(MnemoConfig(vocab_size=VOCAB, d_model=32, n_layers=1, mixer="attention"))
    with pytest.raises(ValueError, match="Attention"):
        att(x, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]))


@pytest.mark.parametrize("mixer", ["gla", "mamba"])
def test_left_padded_generate_equals_each_prompt_alone(mixer):
    model = MnemoForCausalLM(MnemoConfig(vocab_size=VOCAB, d_model=32, n_layers=2, mixer=mixer)).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (L,), generator=g) for L in (6, 2, 4)]
    ids = torch.full((3, 6), VOCAB - 1)  # the pad id is a real token: it must not reach a state
    mask = torch.zeros(3, 6, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 6 - p.numel() :], mask[i, 6 - p.numel() :] = p, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=VOCAB - 1)
    for i, p in enumerate(prompts):
        alone = model.model.generate(p[None], 5, temperature=0)[0, p.numel() :]
        assert torch.equal(out[i, 6:], alone), i


def test_config_fields_mirror_model_config(tmp_path):
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    mc = MnemoConfig()
    for n in names:  # same names and defaults
        assert getattr(mc, n) == getattr(ModelConfig(), n), n
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=3, pattern=["gla", "attention"])
    hf = MnemoConfig.from_model_config(cfg)
    assert hf.to_model_config() == cfg
    hf.save_pretrained(tmp_path)  # mnemo's config.json, readable by both
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    assert AutoConfig.from_pretrained(tmp_path).to_model_config() == cfg


def test_old_config_without_model_type_still_loads(tmp_path):
    lm = _tiny("gla")
    lm.save_pretrained(tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    del d["model_type"]  # as written before config.json carried it
    p.write_text(json.dumps(d))
    assert ModelConfig.load(p) == lm.config
    assert LanguageModel.from_pretrained(tmp_path).config == lm.config
    model = MnemoForCausalLM.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm(x)[0])
    with pytest.raises(ValueError, match="model_type: expected 'mnemo'"):
        ModelConfig.from_dict({**d, "model_type": "llama"})
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({**d, "hidden_size": 3})


def test_save_pretrained_round_trip(tmp_path):
    model = MnemoForCausalLM(MnemoConfig(vocab_size=VOCAB, d_model=32, n_layers=2, mixer="mamba"))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path, use_cache=False)
    assert back.config.use_cache is False
    lm = LanguageModel.from_pretrained(tmp_path)
    x = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        assert torch.equal(back(x).logits, lm(x)[0])
        assert torch.equal(model(x).logits, lm(x)[0])


def test_checkpoint_written_by_mnemo_train(tmp_path):
    from mnemo.cli import main
    from mnemo.data import load_tokenizer
    from mnemo.train import resolve_checkpoint

    out = tmp_path / "run"
    args = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-interval", "2"]
    args += ["--eval-batches", "1", "--d-model", "32", "--n-layers", "1", "--sample-tokens", "0"]
    assert main(["train", "--model", "gla", "--out", str(out), *args, "--no-progress"]) == 0
    ckpt = resolve_checkpoint(out)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    lm = LanguageModel.from_pretrained(ckpt)
    tok = load_tokenizer(ckpt)
    ids = tok.encode("KING:")[None]
    got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, lm.generate(ids, 8, temperature=0))
    assert tok.decode(got[0]).startswith("KING:")


def test_generation_config_json_is_loaded_used_and_saved(tmp_path):
    """A folder's ``generation_config.json`` (a converted checkpoint carries its source's) becomes
    the model's ``generation_config``, so ``generate`` stops at its end id and runs its default
    length, as ``transformers`` does for its own models; saving writes it back, and a model whose
    generation config says nothing more than its config writes none."""
    from transformers import GenerationConfig

    lm = _tiny("gla")
    src = tmp_path / "src"
    lm.save_pretrained(src)
    plain = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.tensor([[3, 7, 11]])
    free = plain.generate(ids, max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert len(free) == 8
    end = free[3]
    cut = free.index(end)
    GenerationConfig(eos_token_id=end, max_new_tokens=6, pad_token_id=0).save_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    assert model.generation_config.eos_token_id == end and model.generation_config.max_new_tokens == 6
    assert model.generate(ids, do_sample=False)[0, 3:].tolist() == free[: cut + 1]  # stops at the end id
    GenerationConfig(max_new_tokens=5).save_pretrained(tmp_path / "src")
    assert AutoModelForCausalLM.from_pretrained(src).generate(ids, do_sample=False).shape == (1, 3 + 5)
    GenerationConfig(eos_token_id=end, max_new_tokens=6, pad_token_id=0).save_pretrained(src)
    model.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    assert again.generation_config.eos_token_id == end and again.generation_config.max_new_tokens == 6
    plain.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "generation_config.json").exists()


def test_a_config_change_writes_no_generation_config_json(tmp_path):
    """``model.config.use_cache = False`` (what training code sets) is no generation setting: saving
    wrote a ``generation_config.json`` that said nothing new, and over a converted checkpoint whose
    end id lives in ``hf_config_carried.json`` (``mnemo generate`` reads it there) that empty file
    took the end id away (``transformers`` reads the ids from that file alone)."""
    from mnemo.hf.special_ids import checkpoint_eos

    folder = tmp_path / "converted"
    _tiny("gla").save_pretrained(folder)
    carried = {"source_architecture": "LlamaForCausalLM", "fields": {"eos_token_id": 2}}
    (folder / "hf_config_carried.json").write_text(json.dumps(carried))
    model = MnemoForCausalLM.from_pretrained(folder)
    model.config.use_cache = False
    model.save_pretrained(folder)
    assert not (folder / "generation_config.json").exists()
    assert checkpoint_eos(folder) == 2
    model.generation_config.max_new_tokens = 7  # a generation setting: written
    model.save_pretrained(tmp_path / "set")
    assert MnemoForCausalLM.from_pretrained(tmp_path / "set").generation_config.max_new_tokens == 7
