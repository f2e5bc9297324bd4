"""IBM Granite in and out of mnemo: tiny random-weight ``GraniteMoeHybridForCausalLM`` (Granite
4.0-H) and ``GraniteForCausalLM`` models built and saved by ``transformers`` itself are converted,
and their logits, greedy generations and exports are compared with ``transformers``' own classes;
what mnemo cannot express exactly is refused by name.

* ``moe``: 3 layers Mamba-2 / attention / Mamba-2, a top-2 mixture of 4 experts plus the shared
  MLP, RoPE, grouped-query attention with q/k/v/o biases, Mamba projection biases, untied head;
* ``dense``: attention / Mamba-2, the shared MLP alone (``num_local_experts`` 0), no positions
  (``"nope"``), ``head_dim`` 12 ≠ hidden / heads, tied head;
* ``granite``: dense Granite (Llama with the scalars), untied.

Every model has the four scalars away from 1 (``embedding_multiplier`` 3, ``residual_multiplier``
0.4, ``attention_multiplier`` 0.2, ``logits_scaling`` 2.5) and reads 21 tokens (past a Mamba chunk
of 8). Measured (float32, CPU): max |Δlogits| 6.7e-6 (``moe``), 7.2e-7 (``dense``), 6.0e-7
(``granite``), and token by token (``mode="recurrent"``) 3.9e-6 / 2.2e-6 / 1.7e-6 (logits up to
~2.3 / 3.2 / 2.9); the tests bound it by 2e-5. In float64, with ``transformers``' float32 casts
lifted (:func:`tests.hf.test_mamba_interop.transformers_in_float64`) and its rotary frequencies
computed in float64: 7.8e-15 / 1.4e-15 / 2.9e-15, bounded by 1e-12.
"""

from __future__ import annotations

import json

import pytest
import torch

from mnemo.models import LanguageModel, ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T = 61, 21
ATOL = 2e-5  # float32; measured ≤ 6.7e-6 (21 tokens)
SCALARS = dict(
    embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5
)
HYBRID = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=20, shared_intermediate_size=24,
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, rms_norm_eps=1e-5, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, **SCALARS,
)  # fmt: skip
KINDS = {
    "moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        HYBRID, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, position_embedding_type="rope", attention_bias=True, mamba_proj_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=False,
    )),
    "dense": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        HYBRID, num_hidden_layers=2, layer_types=["attention", "mamba"], num_local_experts=0, head_dim=12,
        position_embedding_type="nope", tie_word_embeddings=True,
    )),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **SCALARS,
    )),
}  # fmt: skip


def hf_model(name: str, seed: int = 0, **over):
    """A random-weight ``…ForCausalLM`` (float32) with every weight moved off its init (experts run
    by the plain loop, which also takes float64)."""
    import transformers

    config_name, model_name, opts = KINDS[name]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(seed)
    m = model_cls(config_cls(**{**opts, **over})).eval()
    m.config._experts_implementation = "eager"
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 1.5 - 0.5)
            elif n.endswith("dt_bias"):
                p.copy_(torch.rand_like(p) * 2 - 3)
            elif "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return m


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", params=list(KINDS))
def made(request, tmp_path_factory):
    """``(name, transformers model, its saved folder, mnemo model read from the folder)``."""
    name = request.param
    hf = hf_model(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, folder, LanguageModel.from_pretrained(folder).eval()


def test_the_converted_model_is_the_function_of_the_config(made):
    """The mnemo config says what the checkpoint computes: the layers of ``layer_types``, the MLP
    (MoE + ungated shared expert, or the shared SwiGLU alone), the positions, and the scalars."""
    name, _, _, lm = made
    c = lm.config
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (3.0, 0.4, 2.5)
    a = c.mixer_options["attention"]
    assert a["softmax_scale"] == 0.2 and all(
        b.mixer.scale == 0.2 for b in lm.blocks if type(b.mixer).__name__ == "Attention"
    )
    if name == "moe":
        assert c.layer_mixers() == ["mamba2", "attention", "mamba2"] and c.mlp == "moe"
        o = c.mlp_options
        assert (o["n_experts"], o["top_k"], o["expert_hidden"], o["shared_expert_hidden"]) == (4, 2, 20, 24)
        assert not o["shared_expert_gate"] and o["norm_topk_prob"]
        # router_aux_loss_coef as Mixtral's: c · k / L (transformers' default c = 0.001; review 49e)
        assert o["aux_loss_coef"] == pytest.approx(0.001 * 2 / 3, rel=1e-12)
        assert a["rope"] and a["rope_theta"] == 1000.0 and a["bias"] is True and not c.tie_embeddings
    elif name == "dense":
        assert c.layer_mixers() == ["attention", "mamba2"] and c.mlp == "swiglu" and c.mlp_hidden == 24
        assert a["rope"] is False and a["head_dim"] == 12 and c.tie_embeddings
    else:
        assert c.layer_mixers() == ["attention"] * 2 and c.mlp_hidden == 40 and a["rope_theta"] == 500.0


def test_logits_equal_transformers(made):
    """Full-pass and token-by-token (``mode="recurrent"``) logits equal transformers' (float32, 21
    tokens); with any one scalar at 1 instead they do not (each one matters)."""
    name, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        assert max_diff(lm(x, mode="recurrent")[0], ref) <= ATOL
        for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "softmax_scale"):
            cfg = json.loads(json.dumps(lm.config.to_dict()))
            if k == "softmax_scale":
                del cfg["mixer_options"]["attention"][k]
            else:
                cfg[k] = 1.0
            other = LanguageModel(ModelConfig.from_dict(cfg)).eval()
            other.load_state_dict(lm.state_dict())
            assert max_diff(other(x)[0], ref) > 1e-3, k


def test_logits_equal_transformers_in_float64(made):
    """The same in float64 with transformers' float32 casts lifted (its norms, router and scans then
    compute in float64) and its rotary frequencies in float64, as mnemo's: equal to rounding."""
    from tests.hf.test_mamba_interop import transformers_in_float64

    name, hf, folder, _ = made
    hf = type(hf).from_pretrained(folder, dtype=torch.float64).eval()
    hf.config._experts_implementation = "eager"
    lm = LanguageModel.from_pretrained(folder).double().eval()
    rot = getattr(hf.model, "rotary_emb", None)
    if rot is not None:
        D = lm.config.mixer_options["attention"]["head_dim"]
        theta = hf.config.rope_parameters["rope_theta"]
        rot.inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    x = ids()
    with torch.no_grad(), transformers_in_float64():
        assert max_diff(lm(x)[0], hf(x).logits) <= 1e-12


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token cached decoding picks transformers' greedy tokens (a prompt of 5,
    9 new tokens: past a Mamba chunk)."""
    _, hf, _, lm = made
    prompt = ids(length=5, seed=2)
    ref = hf.generate(prompt, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 9, temperature=0), ref)


def test_export_round_trip(made, tmp_path, capsys):
    """``mnemo convert``, then export: the converted checkpoint computes the source's logits;
    transformers reloads the export as the source class with the fields that set the function, and
    computes the source's logits; importing the export gives the model back (config and weights)."""
    import transformers

    from mnemo.cli import main
    from mnemo.hf.convert import export_hf, import_hf

    name, hf, folder, lm = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    x = ids()
    with torch.no_grad():
        assert max_diff(LanguageModel.from_pretrained(tmp_path / "ck")(x)[0], hf(x).logits) <= ATOL
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    keys = ("tie_word_embeddings", *SCALARS, "num_key_value_heads", "attention_bias")
    if name != "granite":
        keys += ("layer_types", "num_local_experts", "position_embedding_type", "shared_intermediate_size",
                 "mamba_n_groups", "mamba_proj_bias")  # fmt: skip
    for k in keys:
        assert getattr(back.config, k, None) == getattr(hf.config, k, None), k
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL
    config, state, _ = import_hf(tmp_path / "back")
    assert config == lm.config
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in state.items())


def test_a_state_dict_of_transformers_5_reads_as_the_file(made):
    """``transformers`` 5 renames the MoE weights in memory (``experts.gate_up_proj`` …); its state
    dict imports as its file does."""
    from mnemo.hf.granite import import_granite, import_granitemoehybrid

    name, hf, _, lm = made
    fn = import_granite if name == "granite" else import_granitemoehybrid
    config, state = fn(hf.config.to_dict(), hf.state_dict())
    assert config == lm.config
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in state.items())


def test_exports_pick_granite_and_others_refuse_the_scalars(tmp_path):
    """A mnemo model with Granite's scalars goes out as a Granite class (the only ones that carry
    them); every other format refuses them by name, as the one check of the export says."""
    from mnemo.hf.convert import ARCHITECTURES, _export, _refuse_multipliers, export_hf

    base = dict(vocab_size=VOCAB, d_model=16, n_layers=2, mixer_options={"attention": {"n_heads": 2}})
    lm = LanguageModel(ModelConfig(**base, residual_multiplier=0.5)).eval()
    export_hf(lm, tmp_path / "g")
    assert json.loads((tmp_path / "g" / "config.json").read_text())["architectures"] == ["GraniteForCausalLM"]
    plain = ModelConfig(**base)
    assert _export(plain, LanguageModel(plain).state_dict())[0].name == "LlamaForCausalLM"
    scaled = ModelConfig(**{**base, "mixer_options": {"attention": {"n_heads": 2, "softmax_scale": 0.3}}})
    for name, cfg, said in (
        ("LlamaForCausalLM", ModelConfig(**base, logits_scaling=2.0), r"ModelConfig\.logits_scaling = 2\.0"),
        (
            "BambaForCausalLM",
            ModelConfig(**base, embedding_multiplier=3.0),
            r"ModelConfig\.embedding_\w+ = 3",
        ),
        ("MistralForCausalLM", scaled, r"mixer_options\['attention'\]\['softmax_scale'\] = 0\.3"),
    ):
        with pytest.raises(ValueError, match=rf"^{name} conversion: {said}"):
            _refuse_multipliers(ARCHITECTURES[name], cfg)
    mamba = ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=1, mixer="mamba2", mlp="none",
                        embedding_multiplier=2.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"Mamba2ForCausalLM conversion: ModelConfig\.embedding_multiplier"):
        export_hf(LanguageModel(mamba), tmp_path / "m")


def test_refusals_by_name(made):
    """What Granite 4.0-H / Granite cannot be read or written as by mnemo is refused, naming the
    field or option and the value."""
    from mnemo.hf.granite import export_granitemoehybrid, import_granite, import_granitemoehybrid

    name, hf, _, lm = made
    cfg, sd = hf.config.to_dict(), hf.state_dict()
    if name == "granite":
        for over, said in (
            ({"mlp_bias": True}, "Granite conversion: mlp_bias true"),
            (
                {"logits_scaling": 0},
                r"Granite conversion: field 'logits_scaling': expected a finite number > 0",
            ),
        ):
            with pytest.raises(ValueError, match=said):
                import_granite({**cfg, **over}, sd)
        return
    n = cfg["num_hidden_layers"]
    for over, said in (
        ({"layer_types": ["mamba"] * (n - 1) + ["moe"]}, rf"layer {n - 1} has type 'moe'"),
        ({"mamba_n_groups": 3}, "mamba_n_groups = 3 does not divide mamba_n_heads = 4"),
        ({"position_embedding_type": "alibi"}, "field 'position_embedding_type' = 'alibi'"),
        (
            {"residual_multiplier": -1.0},
            "field 'residual_multiplier': expected a finite number > 0, got -1.0",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ):
        with pytest.raises(ValueError, match=rf"^Granite 4\.0-H conversion: .*{said}"):
            import_granitemoehybrid({**cfg, **over}, sd)
    c = lm.config.to_dict()
    for over, said in (
        ({"mlp": "none", "mlp_options": {}}, "mlp 'none' is not supported"),
        ({"pos_embedding": "learned"}, "pos_embedding 'learned' is not supported"),
    ):
        with pytest.raises(ValueError, match=rf"^Granite 4\.0-H conversion: {said}"):
            export_granitemoehybrid(ModelConfig.from_dict({**c, **over}), lm.state_dict())
    if name == "moe":
        for opt, val in (("shared_expert_gate", True), ("score", "sigmoid"), ("capacity_factor", 1.5)):
            bad = ModelConfig.from_dict({**c, "mlp_options": {**c["mlp_options"], opt: val}})
            with pytest.raises(ValueError, match=rf"mlp_options option {opt}={val!r} has no Granite 4.0-H"):
                export_granitemoehybrid(bad, LanguageModel(bad).state_dict())
