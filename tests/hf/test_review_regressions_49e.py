"""Review 49e of the Granite / MoE-family interop: each test failed before its fix."""

from __future__ import annotations

import pytest

from mnemo.models import LanguageModel, ModelConfig

ATTN = {"attention": {"n_heads": 2}}


def _exporters():
    from mnemo.hf import bamba, deepseek, llama, mamba, qwen3_next

    return {
        "Llama": llama.export_llama,
        "Mistral": llama.export_mistral,
        "Qwen2": llama.export_qwen2,
        "Qwen3": llama.export_qwen3,
        "Mixtral": llama.export_mixtral,
        "Qwen3-MoE": llama.export_qwen3_moe,
        "Qwen2-MoE": llama.export_qwen2_moe,
        "MambaForCausalLM": mamba.export_mamba,
        "FalconMambaForCausalLM": mamba.export_falcon_mamba,
        "Mamba2ForCausalLM": mamba.export_mamba2,
        "Bamba": bamba.export_bamba,
        "Qwen3-Next": qwen3_next.export_qwen3_next,
        "DeepSeek-V3": deepseek.export_deepseek_v3,
    }


@pytest.mark.parametrize("field", ["embedding_multiplier", "residual_multiplier", "logits_scaling"])
def test_every_exporter_called_directly_refuses_granites_scalars(field):
    """The exporters dropped the scalars in silence when called directly (only ``export_hf`` checked)."""
    config = ModelConfig(vocab_size=40, d_model=16, n_layers=2, mixer_options=ATTN, **{field: 2.0})
    sd = LanguageModel(config).state_dict()
    for name, export in _exporters().items():
        with pytest.raises(ValueError, match=rf"^{name} conversion: ModelConfig\.{field} = 2\.0"):
            export(config, sd)


def test_every_exporter_called_directly_refuses_a_softmax_scale_and_dense_layers_among_moe():
    scaled = ModelConfig(
        vocab_size=40,
        d_model=16,
        n_layers=2,
        mixer_options={"attention": {"n_heads": 2, "softmax_scale": 0.3}},
    )
    mixed = ModelConfig(
        vocab_size=40, d_model=16, n_layers=2, mixer_options=ATTN, mlp="moe", mlp_only_layers=[0],
        mlp_options={"n_experts": 4, "top_k": 2},
    )  # fmt: skip
    carry_dense = {"Qwen3-MoE", "Qwen2-MoE", "DeepSeek-V3"}
    for name, export in _exporters().items():
        with pytest.raises(
            ValueError, match=rf"^{name} conversion: mixer_options\['attention'\]\['softmax_scale'\]"
        ):
            export(scaled, LanguageModel(scaled).state_dict())
        if name in carry_dense:
            continue
        with pytest.raises(ValueError, match=rf"^{name} conversion: ModelConfig\.mlp_only_layers = \[0\]"):
            export(mixed, LanguageModel(mixed).state_dict())


def test_granite_h_export_refuses_an_odd_head_dim_without_positions():
    """``transformers`` 5.25's config checks the rotary fields of a ``"nope"`` model too: the export
    wrote a folder no class loads."""
    from mnemo.hf.granite import export_granitemoehybrid

    config = ModelConfig(
        vocab_size=40,
        d_model=16,
        n_layers=2,
        mixer_options={"attention": {"n_heads": 2, "rope": False, "head_dim": 5}},
    )
    with pytest.raises(ValueError, match=r"Granite 4\.0-H conversion: head_dim = 5 is odd"):
        export_granitemoehybrid(config, LanguageModel(config).state_dict())


def test_eval_yarn_names_the_models_softmax_scale_not_the_beta_flags():
    from mnemo.commands.evaluate import _yarn_setting

    config = ModelConfig(
        vocab_size=40,
        d_model=16,
        n_layers=1,
        mixer_options={"attention": {"n_heads": 2, "softmax_scale": 0.2}},
    )
    with pytest.raises(
        ValueError, match=r"^--yarn: blocks\.0\.mixer sets its logit scale \(softmax_scale = 0\.2"
    ):
        _yarn_setting("2", {"seq_len": 16}, LanguageModel(config))


def test_granite_h_balance_loss_coefficient_is_mapped_as_mixtrals():
    """``transformers`` computes Granite 4.0-H's balance loss with Mixtral's function: the coefficient
    maps as Mixtral's (``c · k / L``) and back, where it was dropped (mnemo's 0.01 kept on import,
    transformers' 0.001 written on export)."""
    from mnemo.hf.granite import export_granitemoehybrid, import_granitemoehybrid
    from tests.hf.test_granite_49 import hf_model

    hf = hf_model("moe", router_aux_loss_coef=0.03)  # 3 layers, top-2
    config, sd = import_granitemoehybrid(hf.config.to_dict(), hf.state_dict())
    assert config.mlp_options["aux_loss_coef"] == pytest.approx(0.03 * 2 / 3, rel=1e-12)
    back, _ = export_granitemoehybrid(config, sd)
    assert back["router_aux_loss_coef"] == pytest.approx(0.03, rel=1e-12)


def test_every_registered_format_is_named_where_users_read_the_list():
    """Trial 50h: ``mnemo convert --help`` still listed the formats of session 49 after Jamba,
    DeepSeek-V2 and Kimi Linear were registered. Every architecture :mod:`mnemo.hf.convert` registers
    is named (letters and digits, case aside: ``Qwen3-Next``; ``GraniteMoeHybrid`` as Granite 4.0-H) in
    the command's help, its description and ``LanguageModel.from_pretrained``'s docstring."""
    import argparse
    import re

    from mnemo.commands import convert as command
    from mnemo.hf.convert import ARCHITECTURES
    from mnemo.models import LanguageModel

    sub = argparse.ArgumentParser().add_subparsers()
    command.add_commands(sub)
    parser = sub.choices["convert"]
    help_text = next(a.help for a in sub._choices_actions if a.dest == "convert")

    def squash(text):
        return re.sub(r"[^a-z0-9]", "", text.lower())

    for where, text in (
        ("help", help_text),
        ("description", parser.description),
        ("from_pretrained", LanguageModel.from_pretrained.__doc__),
    ):
        for name in ARCHITECTURES:
            short = squash(name.removesuffix("ForCausalLM").replace("mamba_ssm", "mamba-ssm"))
            short = {"granitemoehybrid": "granite40h"}.get(short, short)
            assert short in squash(text), f"{where} does not name {name}"
