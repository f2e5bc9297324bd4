"""Language model: cached decoding equals the full pass for every registered model; save/load;
registry and config errors."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.models import LanguageModel, ModelConfig, build_config, model_names
from tests.helpers import assert_close


def _model(name, **kw):
    """A small float64 copy of a registered model: d_model 32, two layers (a full pattern for hybrids)."""
    torch.manual_seed(0)
    base = build_config(name, vocab_size=50)
    small = {"d_model": 32, "n_layers": len(base.pattern) if base.pattern else 2}
    m = LanguageModel(build_config(name, vocab_size=50, **{**small, **kw})).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("name", model_names())
def test_cached_decoding_equals_full_forward(name):
    m = _model(name)
    T = 20
    ids = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(1))
    full, _ = m(ids)
    for prefill in (1, 3, 13):  # 1 and 3 are shorter than the short-conv width
        logits, state = m(ids[:, :prefill])
        outs = [logits]
        for t in range(prefill, T):
            logits, state = m(ids[:, t : t + 1], state)
            outs.append(logits)
        assert_close(torch.cat(outs, 1), full, 1e-10, what=f"{name} prefill {prefill}")


@pytest.mark.parametrize("name", model_names())
def test_greedy_generate_matches_recomputed_argmax(name):
    m = _model(name)
    prompt = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(2))
    out = m.generate(prompt, 8, temperature=0)
    for t in range(5, 13):
        logits, _ = m(out[:, :t])
        assert out[0, t] == logits[0, -1].argmax()


def test_hybrid_is_configuration():
    cfg = build_config(
        "transformer",
        vocab_size=50,
        n_layers=4,
        layers=["gla", "retnet", "linear_attention", "attention"],
        d_model=32,
    )
    m = LanguageModel(cfg).double()
    kinds = [type(b.mixer).__name__ for b in m.blocks]
    assert kinds == ["GatedLinearAttention", "GatedLinearAttention", "LinearAttention", "Attention"]
    ids = torch.randint(0, 50, (1, 12))
    full, _ = m(ids)
    a, s = m(ids[:, :7])
    b, _ = m(ids[:, 7:], s)
    assert_close(torch.cat([a, b], 1), full, 1e-10)


def test_recurrent_state_is_constant_size_and_kv_cache_grows():
    rec, att = _model("gla"), _model("transformer")
    assert rec.state_size_bytes(1, 100) == rec.state_size_bytes(1, 100_000)
    assert att.state_size_bytes(1, 200) == 2 * att.state_size_bytes(1, 100)


def test_save_and_load_roundtrip(tmp_path):
    m = _model("gla_hybrid").float()
    m.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pattern"] == ["gla", "gla", "gla", "attention"]
    m2 = LanguageModel.from_pretrained(tmp_path)
    ids = torch.randint(0, 50, (1, 9))
    assert torch.equal(m(ids)[0], m2(ids)[0])
    assert m2.lm_head.weight is m2.embed.weight  # tying survives the round trip


def test_corrupt_or_missing_checkpoint_files(tmp_path):
    m = _model("transformer").float()
    m.save_pretrained(tmp_path)
    w = tmp_path / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or incompatible weights file"):
        LanguageModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt model config"):
        LanguageModel.from_pretrained(tmp_path)
    w.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LanguageModel.from_pretrained(tmp_path)


def test_registry_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="unknown model 'gpt5'; registered models: .*transformer"):
        build_config("gpt5")
    with pytest.raises(ValueError, match="unknown ModelConfig field 'width'"):
        build_config("transformer", width=3)
    with pytest.raises(ValueError, match=r"ModelConfig.layers: expected a list of n_layers = 4"):
        build_config("transformer", layers=["attention"])
    with pytest.raises(ValueError, match=r"ModelConfig.mixer: expected mixer names among"):
        build_config("transformer", mixer="lstm")
    with pytest.raises(ValueError, match=r"ModelConfig.d_model: expected a positive int, got 0"):
        ModelConfig(d_model=0).validate()


def test_pattern_repeats_over_layers():
    cfg = build_config("gla_hybrid", n_layers=8)
    assert cfg.layer_mixers() == ["gla", "gla", "gla", "attention"] * 2


def test_mixer_options_merge_per_mixer():
    cfg = build_config("transformer", mixer_options={"attention": {"window": 8}})
    assert cfg.mixer_options["attention"] == {"n_heads": 4, "window": 8}


def test_bad_token_ids_and_positions():
    m = _model("transformer")
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size = 50\)"):
        m(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        m(torch.zeros(1, 3))
    p = _model("transformer", pos_embedding="learned", max_position=8)
    with pytest.raises(ValueError, match="max_position = 8"):
        p(torch.zeros(1, 9, dtype=torch.long))


def test_generate_validates_max_new_tokens():
    m = LanguageModel(build_config("transformer", vocab_size=11, d_model=16, n_layers=1))
    ids = torch.zeros(1, 2, dtype=torch.long)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 0"):
            m.generate(ids, bad)
    assert m.generate(ids, 0).shape == (1, 2)


@pytest.mark.parametrize("name", ["titans_mac", "titans_mag", "titans_mal"])
def test_the_memory_inside_a_titans_architecture_starts_as_titans_lmm(name):
    """The neural memory nested in MAC / MAG / MAL gets its own init after the model's generic one
    (which zeroes every bias): at initialisation its gates read what ``titans_lmm``'s do — θ =
    0.1 · max_lr, forgetting 1 − α = 1 − sigmoid(5) ≈ 0.0067 a token — not sigmoid(0) = 0.5."""
    from mnemo.models.registry import build_config

    torch.manual_seed(0)
    lm = LanguageModel(build_config(name, vocab_size=64, d_model=32, n_layers=2))
    ref = LanguageModel(build_config("titans_lmm", vocab_size=64, d_model=32, n_layers=2))
    x = torch.zeros(1, 5, 32)  # the gates then read their biases alone
    for block in lm.blocks:
        memory = block.mixer.memory
        theta, g, _, _ = memory._gates(x)
        assert torch.allclose(theta, torch.full_like(theta, 0.1 * memory.max_lr), rtol=1e-5)
        assert torch.allclose(1 - g.exp(), torch.full_like(g, 1 - torch.sigmoid(torch.tensor(5.0)).item()))
        assert torch.equal(memory.gate_proj.bias, ref.blocks[0].mixer.gate_proj.bias)
