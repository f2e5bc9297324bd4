"""Break-it review of the model registry, ModelConfig validation and save/load, and runtime settings."""

from __future__ import annotations

import pytest

from mnemo import runtime
from mnemo.layers.mlp import swiglu_hidden
from mnemo.models import MODELS, LanguageModel, ModelConfig, build_config


def test_moe_preset_experts_follow_d_model_and_mlp_hidden_overrides():
    """Its description: each expert half the dense width (two active = gated_deltanet_hybrid's MLP)."""
    assert build_config("gated_deltanet_attention_moe").mlp_options["expert_hidden"] == 176  # d_model 128
    wide = build_config("gated_deltanet_attention_moe", d_model=256)
    assert 2 * wide.mlp_options["expert_hidden"] == swiglu_hidden(256)
    dense = build_config("gated_deltanet_attention_moe", mlp_hidden=192)
    assert dense.mlp_options["expert_hidden"] == 96  # mlp_hidden was silently ignored before
    given = build_config("gated_deltanet_attention_moe", d_model=256, mlp_options={"expert_hidden": 8})
    assert given.mlp_options["expert_hidden"] == 8
    assert given.mlp_options["n_experts"] == 8  # the preset's other options stay
    assert MODELS["gated_deltanet_attention_moe"].factory().mlp_options["expert_hidden"] == 176


def test_mixer_override_on_a_hybrid_preset_is_not_ignored():
    cfg = build_config("gla_hybrid", mixer="deltanet")
    assert cfg.layer_mixers() == ["deltanet"] * cfg.n_layers
    kept = build_config("gla_hybrid", mixer="deltanet", pattern=["deltanet", "attention"])
    assert kept.layer_mixers() == ["deltanet", "attention"] * 2


def test_tuple_pattern_survives_save_and_load(tmp_path):
    cfg = build_config("transformer", pattern=("gla", "attention"), layers=None)
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg


@pytest.mark.parametrize("bad", [[], None, "abc", 3])
def test_from_dict_refuses_what_is_not_a_mapping(bad):
    with pytest.raises(ValueError, match="ModelConfig: expected a mapping of its fields"):
        ModelConfig.from_dict(bad)


@pytest.mark.parametrize(
    "opts, match",
    [
        (None, r"ModelConfig.mlp_options: expected a dict of ContinuumMemory options, got None"),
        ([1], r"ModelConfig.mlp_options: expected a dict of ContinuumMemory options"),
        ({"levelz": []}, r"ModelConfig.mlp_options: expected options of ContinuumMemory .*got 'levelz'"),
        ({"transfer": 3}, r"ModelConfig.mlp_options\['transfer'\]: expected text"),
        ({"levels": [{"period": 0}]}, r"ModelConfig.mlp_options: Level.period: expected an int >= 1"),
        ({"levels": [{"perod": 3}]}, r"ModelConfig.mlp_options: ContinuumMemory.levels\[0\]: unknown"),
    ],
)
def test_cms_options_are_checked_by_validate(opts, match):
    with pytest.raises(ValueError, match=match):
        build_config("hope", mlp_options=opts)


def test_valid_cms_options_still_build():
    cfg = build_config("hope_attention", d_model=16, n_layers=1, mlp_options={"order": "slowest_first"})
    assert LanguageModel(cfg).blocks[0].mlp.order == "slowest_first"
    assert ModelConfig(mlp="cms").validate().mlp_options == {}  # the default levels


@pytest.mark.parametrize("name", ["mamba", "hope"])
def test_mlp_hidden_without_a_dense_mlp_is_refused(name):
    with pytest.raises(ValueError, match="ModelConfig.mlp_hidden: expected None for mlp"):
        build_config(name, mlp_hidden=512)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"trim_threshold": 4 << 30}, "trim_threshold"),  # a C int wraps this to 0: trim on every free
        ({"top_pad": -1}, "top_pad"),
        ({"mmap_threshold": 1.5}, "mmap_threshold"),
        ({"mmap_threshold": True}, "mmap_threshold"),
    ],
)
def test_tune_malloc_refuses_values_a_c_int_cannot_hold(kw, name, monkeypatch):
    monkeypatch.setattr(runtime, "_tuned", False)
    with pytest.raises(ValueError, match=rf"tune_malloc: {name}: expected an int in \[0, 2\*\*31 - 1\]"):
        runtime.tune_malloc(**kw)
    assert runtime.malloc_tuned() is False


def test_build_model_checks_the_circuit_trackers_length_against_learned_positions():
    """The tracker reads 2 L + 1 tokens at every evaluation: with learned positions that must fit
    max_position before the run starts, not at its first evaluation."""
    import torch

    from mnemo.train.build import build_model
    from mnemo.train.config import TrainConfig
    from mnemo.train.strategy import SingleProcess

    overrides = {"d_model": 16, "n_layers": 1, "max_position": 16}
    cfg = TrainConfig(
        model="transformer_abs", model_overrides=overrides, seq_len=8, batch_size=2, track_circuits=True,
        circuit_length=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"TrainConfig.circuit_length: 17 tokens exceed the learned"):
        build_model(cfg, 32, SingleProcess(cfg, torch.device("cpu")))
    ok = TrainConfig(**{**cfg.__dict__, "circuit_length": 7})  # 15 tokens fit
    assert build_model(ok, 32, SingleProcess(ok, torch.device("cpu"))).config.max_position == 16


def test_a_saved_config_with_an_unused_mlp_hidden_still_loads(tmp_path):
    """The refusal is of an override asked for and ignored; a config saved before it (mlp 'none'
    with a width) still loads."""
    cfg = ModelConfig(mixer="mamba", mlp="none", mlp_hidden=512)
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg


def test_a_mistyped_malloc_tune_switch_is_refused(monkeypatch):
    from mnemo.runtime import tune_malloc

    monkeypatch.setenv("MNEMO_MALLOC_TUNE", "of")
    with pytest.raises(ValueError, match="MNEMO_MALLOC_TUNE must be one of .*got 'of'"):
        tune_malloc()
    monkeypatch.setenv("MNEMO_MALLOC_TUNE", " OFF ")
    assert tune_malloc() is False
