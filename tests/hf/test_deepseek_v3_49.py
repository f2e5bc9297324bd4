"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) in and out of mnemo: tiny random-weight models built and
saved by ``transformers`` itself (3 layers, the first dense, 8 experts in 4 groups of which 2 are
kept, top-3, two shared experts, a random ``e_score_correction_bias``) are converted, and their
logits (full pass and token loop), routing, greedy generations and exports are compared with
``transformers``' own class; what mnemo cannot express exactly is refused by name.

Variants: a full ``q_proj`` with ``rope_interleave`` and plain RoPE, untied; ``q_lora_rank`` 12
with rotate-half RoPE, YaRN with ``mscale`` / ``mscale_all_dim`` and ``attention_bias``; and
``q_lora_rank`` 12 with ``rope_interleave``, YaRN, tied embeddings and ``norm_topk_prob`` false.
Measured (CPU, 12 tokens): float32 max |Δlogits| ≤ 3.4e-6 full pass, ≤ 4.8e-6 token loop (logits
of size ~4), bounded by 2e-5; float64, with ``transformers``' float32 casts lifted (its router,
norms and rotary angles), ≤ 7.1e-15, bounded by 1e-12.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from mnemo.hf.convert import ARCHITECTURES, _refuse_multipliers, export_hf
from mnemo.hf.deepseek import export_deepseek_v3, import_deepseek_v3
from mnemo.models import LanguageModel, ModelConfig
from tests.hf.test_moe_family_49 import max_diff, transformers_in_float64

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T, E, K = 61, 12, 8, 3
ATOL = 2e-5  # float32; measured ≤ 4.8e-6
YARN = {
    "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "mscale": 1.0, "mscale_all_dim": 0.8,
}  # fmt: skip
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=E, kv_lora_rank=16,
    qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=K,
    first_k_dense_replace=1, max_position_embeddings=256, routed_scaling_factor=2.5, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)  # fmt: skip
VARIANTS = {
    "full_q_interleaved": dict(q_lora_rank=None, rope_interleave=True),
    "lora_q_yarn_bias": dict(
        q_lora_rank=12, rope_interleave=False, rope_parameters=YARN, attention_bias=True
    ),
    "lora_q_interleaved_yarn_tied": dict(
        q_lora_rank=12,
        rope_interleave=True,
        rope_parameters=YARN,
        tie_word_embeddings=True,
        norm_topk_prob=False,
    ),
}


def hf_config(name: str = "full_q_interleaved", **over):
    import transformers

    return transformers.DeepseekV3Config(**{**SMALL, **VARIANTS[name], **over})


def hf_model(name: str = "full_q_interleaved", seed: int = 0, **over):
    """A random-weight ``DeepseekV3ForCausalLM`` (float32), every weight and the routers'
    ``e_score_correction_bias`` moved off their init."""
    import transformers

    torch.manual_seed(seed)
    m = transformers.DeepseekV3ForCausalLM(hf_config(name, **over)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return m


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(VARIANTS))
def made(request, tmp_path_factory):
    """``(name, transformers model, its saved folder, mnemo model read from the folder)``."""
    name = request.param
    hf = hf_model(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, folder, LanguageModel.from_pretrained(folder).eval()


def test_logits_equal_transformers(made):
    """Full-pass and token-loop (``mode="recurrent"``) logits equal transformers' (float32); the
    converted model has an MLA mixer of the config's sizes, a dense first layer of
    ``intermediate_size``, DeepSeek-V3's router with the file's correction bias, and YaRN's
    ``mscale_all_dim²`` in the logit scale."""
    name, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        assert max_diff(lm(x, mode="recurrent")[0], ref) <= ATOL
    c = lm.config
    assert (c.mlp, c.mlp_only_layers, c.mlp_hidden) == ("moe", [0], 40)
    assert [type(b.mlp).__name__ for b in lm.blocks] == ["SwiGLU", "MoE", "MoE"]
    o, a = c.mlp_options, c.mixer_options["mla"]
    assert (o["n_experts"], o["top_k"], o["expert_hidden"], o["shared_expert_hidden"]) == (E, K, 8, 16)
    assert (o["score"], o["n_group"], o["topk_group"], o["routed_scaling_factor"]) == ("sigmoid", 4, 2, 2.5)
    assert o["norm_topk_prob"] == (name != "lora_q_interleaved_yarn_tied") and o["bias_balancing"]
    assert (a["kv_lora_rank"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]) == (
        16,
        6,
        8,
        10,
    )
    assert a["q_lora_rank"] == hf.config.q_lora_rank and a["bias"] == hf.config.attention_bias
    assert c.tie_embeddings == (name == "lora_q_interleaved_yarn_tied")
    for i in (1, 2):
        want = hf.model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.equal(lm.blocks[i].mlp.expert_bias, want)
    if "yarn" in name:  # transformers' DeepseekV3Attention.scaling, the same number
        assert lm.blocks[0].mixer.scale == hf.model.layers[0].self_attn.scaling
        m = 0.1 * 0.8 * math.log(4.0) + 1
        assert a["softmax_scale"] == pytest.approx(14**-0.5 * m * m, rel=1e-15)
    else:
        assert "softmax_scale" not in a


def test_logits_equal_transformers_in_float64(made):
    """The same in float64, with transformers' float32 casts lifted: equal to rounding."""
    _, hf, folder, _ = made
    hf = type(hf).from_pretrained(folder, dtype=torch.float64).eval()
    hf.config._experts_implementation = "eager"  # (grouped_mm takes float32 / bfloat16 only)
    lm = LanguageModel.from_pretrained(folder).double().eval()
    x = ids()
    with torch.no_grad(), transformers_in_float64(hf):
        assert max_diff(lm(x)[0], hf(x).logits) <= 1e-12


def test_routing_equals_transformers(made):
    """The experts mnemo's ``hook_topk_indices`` reports in each sparse layer are the ones
    transformers' ``DeepseekV3TopkRouter`` chooses on the same tokens (as sets: its ``topk`` is
    unsorted), the group limit leaves each token experts of at most ``topk_group`` groups, and the
    correction bias changes some choice (so the test would see it dropped)."""
    _, hf, _, lm = made
    x = ids()
    chosen, hooks = {}, []
    for i in (1, 2):
        gate = hf.model.layers[i].mlp.gate
        hooks.append(gate.register_forward_hook(lambda mod, args, out, i=i: chosen.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            hf(x)
            _, cache = lm.run_with_cache(x, ["hook_topk_indices", "hook_router_logits"])
    finally:
        for h in hooks:
            h.remove()
    changed = False
    for i in (1, 2):
        ours = cache[f"blocks.{i}.mlp.hook_topk_indices"].reshape(-1, K)
        assert torch.equal(ours.sort(-1).values, chosen[i].sort(-1).values), i
        assert ((ours // (E // 4)).unsqueeze(-1) == torch.arange(4)).any(1).sum(-1).max() <= 2
        unbiased = torch.sigmoid(cache[f"blocks.{i}.mlp.hook_router_logits"].reshape(-1, E)).topk(K).indices
        changed |= not torch.equal(unbiased.sort(-1).values, ours.sort(-1).values)
    assert changed
    assert "hook_topk_indices" not in dict(lm.blocks[0].mlp.named_modules())  # (the dense layer)


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token latent-cache decoding picks transformers' greedy tokens (a
    prompt of 4, 10 new tokens)."""
    _, hf, _, lm = made
    prompt = ids(length=4, seed=2)
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 10, temperature=0), ref)


def test_export_round_trip(made, tmp_path, capsys):
    """``mnemo convert`` then export: transformers reloads the exported folder as
    ``DeepseekV3ForCausalLM`` (written with ``rope_interleave`` true, the rotary rows permuted
    back) with the fields that matter and the same logits; importing it again gives the same
    mnemo weights."""
    import transformers

    from mnemo.cli import main

    name, hf, folder, lm = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert LanguageModel.from_pretrained(tmp_path / "ck").config == lm.config
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf) and back.config.rope_interleave is True
    for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
              "n_shared_experts", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
              "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "tie_word_embeddings", "attention_bias"):  # fmt: skip
        assert getattr(back.config, k) == getattr(hf.config, k), k
    assert hf.config.rope_parameters.items() <= back.config.rope_parameters.items()  # (+ YaRN's defaults)
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL
    config, sd = import_deepseek_v3(back.config.to_dict(), back.state_dict())
    want = lm.state_dict()
    assert config == lm.config and set(sd) == set(want)
    assert all(torch.equal(sd[k].to(want[k].dtype), want[k]) for k in want)


def _fused_to_hub(sd: dict) -> dict:
    """transformers 5's fused experts written by hand as the Hub's per-expert files."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for e, (g, u) in enumerate(t.chunk(2, 0) for t in v):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = u
        elif k.endswith("mlp.experts.down_proj"):
            for e, t in enumerate(v):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = t
        else:
            out[k] = v
    return out


def test_expert_layouts_and_mtp_weights():
    """The fused and the per-expert layouts import alike; a multi-token-prediction layer saved after
    the last layer (``num_nextn_predict_layers``) is not part of the forward pass and is dropped;
    ``first_k_dense_replace`` past the layers imports as a dense SwiGLU model; ``n_shared_experts``
    0 as no shared expert."""
    hf = hf_model()
    cfg, fused = hf.config.to_dict(), hf.state_dict()
    c1, sd1 = import_deepseek_v3(cfg, fused)
    mtp = {**_fused_to_hub(fused), "model.layers.3.enorm.weight": torch.ones(32)}
    c2, sd2 = import_deepseek_v3({**cfg, "num_nextn_predict_layers": 1}, mtp)
    assert c1 == c2 and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    with pytest.raises(ValueError, match=r"DeepSeek-V3 conversion: unexpected weights .*layers\.3\.enorm"):
        import_deepseek_v3({**cfg, "num_nextn_predict_layers": 0}, mtp)
    dense = hf_model(first_k_dense_replace=5)
    config, sd = import_deepseek_v3(dense.config.to_dict(), dense.state_dict())
    assert config.mlp == "swiglu" and config.mlp_only_layers is None
    unshared = hf_model(n_shared_experts=0)
    config, sd = import_deepseek_v3(unshared.config.to_dict(), unshared.state_dict())
    assert config.mlp_options["shared_expert_hidden"] is None
    for m_hf, conf, weights in ((dense, *import_deepseek_v3(dense.config.to_dict(), dense.state_dict())),
                                (unshared, config, sd)):  # fmt: skip
        lm = LanguageModel(conf).eval()
        lm.load_state_dict(weights)
        x = ids()
        with torch.no_grad():
            assert max_diff(lm(x)[0], m_hf(x).logits) <= ATOL


def test_import_refusals():
    """What transformers' class does not compute as the checkpoint says, or what mnemo cannot
    express, is refused by name."""
    base = hf_config().to_dict()
    for over, said in (
        ({"topk_method": "greedy"}, "field 'topk_method' = 'greedy': transformers' DeepseekV3ForCausalLM"),
        ({"scoring_func": "softmax"}, "field 'scoring_func' = 'softmax'"),
        ({"moe_layer_freq": 2}, "field 'moe_layer_freq' = 2"),
        ({"num_key_value_heads": 2}, "num_key_value_heads = 2: expected num_attention_heads = 4"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"n_group": 8}, "fields n_routed_experts = 8, n_group = 8: expected groups of at least two experts"),
        ({"topk_group": 1, "num_experts_per_tok": 3}, "fields num_experts_per_tok = 3, topk_group = 1"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary"),
        ({"first_k_dense_replace": None}, "field 'first_k_dense_replace': expected an int >= 0"),
        ({"qk_rope_head_dim": 7}, "field 'qk_rope_head_dim' = 7"),
    ):
        with pytest.raises(ValueError, match="DeepSeek-V3 conversion: .*" + re.escape(said)):
            import_deepseek_v3({**base, **over}, {})


SIGMOID = {"n_experts": 4, "score": "sigmoid"}


def _mla_lm(**over) -> LanguageModel:
    cfg = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, mixer="mla", mlp="moe", mlp_hidden=40, mlp_only_layers=[0],
        mixer_options={"mla": {"n_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8}},
        mlp_options={"n_experts": 4, "top_k": 2, "expert_hidden": 8, "score": "sigmoid"},
    )  # fmt: skip
    return LanguageModel(ModelConfig(**{**cfg, **over}))


def test_export_refusals():
    """The export refuses by name a model the class cannot express: dense layers that are not the
    first ones, softmax scores, a gated shared expert, a logit scale other than DeepSeek-V3's, another
    latent epsilon, unrotated decoupled keys (MLA's ``rope=False``), another mixer; and every format
    without dense layers among MoE ones refuses ``mlp_only_layers`` in the one check of every export."""
    lm = _mla_lm()
    hf_cfg, _ = export_deepseek_v3(lm.config, lm.state_dict())
    assert hf_cfg["first_k_dense_replace"] == 1 and hf_cfg["n_shared_experts"] == 0
    for over, said in (
        (dict(mlp_only_layers=[1]), "mlp_only_layers [1]: DeepseekV3ForCausalLM's dense layers are the"),
        (dict(mlp_options={"n_experts": 4, "expert_hidden": 8}), "mlp_options option score='softmax'"),
        (
            dict(mlp_options={**SIGMOID, "shared_expert_hidden": 8, "shared_expert_gate": True}),
            "mlp_options option shared_expert_gate=True",
        ),
        (
            dict(mlp_options={**SIGMOID, "expert_hidden": 8, "shared_expert_hidden": 12}),
            "mlp_options option shared_expert_hidden=12: DeepSeek-V3's shared experts are n_shared_experts",
        ),
        (
            dict(mixer_options={"mla": {"n_heads": 4, "kv_lora_rank": 16, "softmax_scale": 0.3}}),
            "option softmax_scale=0.3 gives the logit scale 0.3",
        ),
        (dict(mixer_options={"mla": {"n_heads": 4, "norm_eps": 1e-5}}), "option norm_eps=1e-05"),
        (dict(mixer_options={"mla": {"n_heads": 4, "rope": False}}), "option rope=False"),  # (Kimi Linear's)
        (dict(mixer="attention", mixer_options={}), "layer 0 uses mixer 'attention'"),
    ):
        bad = _mla_lm(**over)
        with pytest.raises(ValueError, match="DeepSeek-V3 conversion: .*" + re.escape(said)):
            export_deepseek_v3(bad.config, bad.state_dict())
    attn = ModelConfig(vocab_size=VOCAB, n_layers=2, mlp="moe", mlp_only_layers=[0])
    for name in ("MixtralForCausalLM", "GraniteMoeHybridForCausalLM", "Qwen3NextForCausalLM"):
        with pytest.raises(ValueError, match=rf"{name} conversion: ModelConfig.mlp_only_layers = \[0\]"):
            _refuse_multipliers(ARCHITECTURES[name], attn)
    _refuse_multipliers(ARCHITECTURES["Qwen3MoeForCausalLM"], attn)  # (carries it)
    _refuse_multipliers(ARCHITECTURES["DeepseekV3ForCausalLM"], lm.config)  # (its own softmax_scale too)


def test_a_mnemo_model_exports_and_loads_in_transformers(tmp_path):
    """A model made in mnemo (a full ``q_proj``, plain RoPE, groups, a balancing bias of its own)
    exports through ``export_hf`` and transformers computes its logits; exported in bfloat16, the
    router (``gate.weight``) and its bias stay float32, as transformers keeps them."""
    import transformers

    torch.manual_seed(3)
    lm = _mla_lm(
        mlp_options={"n_experts": 4, "top_k": 2, "expert_hidden": 8, "score": "sigmoid", "n_group": 2,
                     "topk_group": 1, "bias_balancing": True, "shared_expert_hidden": 16},
    ).eval()  # fmt: skip
    with torch.no_grad():
        lm.blocks[1].mlp.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.05, 0.0]))
    lm.save_pretrained(tmp_path / "m")
    export_hf(tmp_path / "m", tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and written["first_k_dense_replace"] == 1
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, lm(x)[0]) <= ATOL
    # in bfloat16 the router and its bias stay float32 (transformers keeps them so): no rounding of
    # the choice; the other weights are bfloat16
    from safetensors.torch import load_file

    export_hf(lm, tmp_path / "bf16", dtype="bfloat16")
    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    assert saved["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(saved["model.layers.1.mlp.gate.weight"], lm.blocks[1].mlp.router.weight.detach())
    assert saved["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert saved["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # (the dense layer's)


def test_kimi_k2_model_type_reads_as_deepseek_v3(made, tmp_path):
    """A folder whose ``config.json`` names ``DeepseekV3ForCausalLM`` with Kimi K2's ``model_type``
    ``"kimi_k2"`` and an ``auto_map`` to remote code (as Moonshot's releases ship it) is read as
    DeepSeek-V3, without running that code: the same model and logits as the ``deepseek_v3`` file."""
    import shutil

    _, hf, folder, lm = made
    kimi = tmp_path / "kimi"
    shutil.copytree(folder, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg |= {
        "model_type": "kimi_k2",
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    }  # fmt: skip
    (kimi / "config.json").write_text(json.dumps(cfg))
    got = LanguageModel.from_pretrained(kimi).eval()
    assert got.config == lm.config
    x = ids()
    with torch.no_grad():
        assert max_diff(got(x)[0], hf(x).logits) <= ATOL
    with pytest.raises(ValueError, match=r"model_type 'kimi_k3' is not one of \['deepseek_v3', 'kimi_k2'\]"):
        import_deepseek_v3({**cfg, "model_type": "kimi_k3"}, {})
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k3"}))  # (trial 50h: name both)
    with pytest.raises(
        ValueError, match=r"\(model_type 'deepseek_v3' or 'kimi_k2'\) but model_type is 'kimi_k3'"
    ):
        LanguageModel.from_pretrained(kimi)


def test_groups_of_one_expert(tmp_path):
    """``transformers``' router takes the top 2 of each group, so it cannot run groups of one expert
    even where ``topk_group = n_group`` (nothing limited): the import refuses such a config; a mnemo
    model whose groups limit nothing (``topk_group = n_group = n_experts``) exports as one group,
    the same function, which transformers runs."""
    import transformers

    bad = hf_config(n_group=8, topk_group=8)
    with pytest.raises(RuntimeError, match="out of range"):  # transformers' own class
        torch.manual_seed(0)
        transformers.DeepseekV3ForCausalLM(bad)(ids())
    with pytest.raises(ValueError, match="n_group = 8: expected groups of at least two experts .*whatever"):
        import_deepseek_v3(bad.to_dict(), {})
    torch.manual_seed(4)
    opts = {"n_experts": 4, "top_k": 2, "expert_hidden": 8, "score": "sigmoid", "n_group": 4, "topk_group": 4}
    lm = _mla_lm(mlp_options=opts).eval()
    hf_cfg, _ = export_deepseek_v3(lm.config, lm.state_dict())
    assert (hf_cfg["n_group"], hf_cfg["topk_group"]) == (1, 1)
    export_hf(lm, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, lm(x)[0]) <= ATOL


def test_first_k_dense_replace_contradicting_the_weights():
    """A ``first_k_dense_replace`` that makes a layer dense where the file holds its router (past the
    layers: every layer dense), or sparse where it holds a dense MLP, is refused naming the field,
    not as a missing weight."""
    hf = hf_model()
    cfg, sd = hf.config.to_dict(), hf.state_dict()
    for k, layer, kind in ((5, 1, "a dense MLP"), (2, 1, "a dense MLP"), (0, 0, "a mixture of experts")):
        said = f"field 'first_k_dense_replace' = {k} makes layer {layer} {kind}"
        with pytest.raises(ValueError, match="DeepSeek-V3 conversion: " + re.escape(said)):
            import_deepseek_v3({**cfg, "first_k_dense_replace": k}, sd)
