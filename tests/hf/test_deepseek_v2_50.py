"""DeepSeek-V2 (``DeepseekV2ForCausalLM``) in and out of mnemo: tiny random-weight models built and
saved by ``transformers`` itself (3 layers, the first dense, 8 experts, top-3, two shared experts,
``routed_scaling_factor`` 1.5) are converted, and their logits (full pass and token loop), routing,
greedy generations and exports are compared with ``transformers``' own class; what mnemo cannot
express exactly is refused by name.

Variants: ``"greedy"`` with a full ``q_proj`` and plain RoPE, untied; ``"grouped"``
(``group_limited_greedy``, 4 groups of 2 of which 2 are kept: mnemo's ``group_score="max"``) with
``q_lora_rank`` 12, YaRN with ``mscale`` / ``mscale_all_dim``, ``attention_bias`` and tied
embeddings. Measured (CPU, 12 tokens): float32 max |Δlogits| ≤ 1.0e-5 full pass, ≤ 6.2e-6 token
loop (logits of size ~4), bounded by 5e-5; float64, with ``transformers``' float32 casts lifted (its
router, norms and complex rotary), ≤ 1.8e-14, bounded by 1e-12.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from mnemo.hf.convert import export_hf
from mnemo.hf.deepseek import export_deepseek_v2, import_deepseek_v2, rope_permutation
from mnemo.models import LanguageModel, ModelConfig
from tests.hf.test_deepseek_v3_49 import VOCAB, ids
from tests.hf.test_moe_family_49 import max_diff, transformers_in_float64

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

T, E, K = 12, 8, 3  # (the tokens of ids())
ATOL = 5e-5  # float32; measured ≤ 1.0e-5
YARN = {
    "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "mscale": 0.707, "mscale_all_dim": 0.8,
}  # fmt: skip
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
    num_attention_heads=4, n_shared_experts=2, n_routed_experts=E, kv_lora_rank=16, qk_rope_head_dim=8,
    v_head_dim=10, qk_nope_head_dim=6, num_experts_per_tok=K, first_k_dense_replace=1,
    max_position_embeddings=256, routed_scaling_factor=1.5, bos_token_id=None, eos_token_id=None,
    pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)  # fmt: skip
VARIANTS = {
    "greedy": dict(q_lora_rank=None, topk_method="greedy"),
    "grouped": dict(
        q_lora_rank=12,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        rope_parameters=YARN,
        attention_bias=True,
        tie_word_embeddings=True,
    ),  # fmt: skip
}


def hf_config(name: str = "greedy", **over):
    import transformers

    return transformers.DeepseekV2Config(**{**SMALL, **VARIANTS[name], **over})


def hf_model(name: str = "greedy", seed: int = 0, **over):
    """A random-weight ``DeepseekV2ForCausalLM`` (float32), every weight moved off its init (the
    router's by more, so that the softmax scores differ between experts)."""
    import transformers

    torch.manual_seed(seed)
    m = transformers.DeepseekV2ForCausalLM(hf_config(name, **over)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.add_((2.0 if n.endswith("mlp.gate.weight") else 0.2) * torch.randn_like(p))
    return m


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
    converted model has an MLA mixer of the config's sizes, a dense first layer, DeepSeek-V2's
    softmax router (not renormalised, scaled, no bias; groups scored by their largest score) and
    YaRN's ``mscale_all_dim²`` in the logit scale."""
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
    assert (o["score"], o["norm_topk_prob"], o["bias_balancing"], o["routed_scaling_factor"]) == (
        "softmax",
        False,
        False,
        1.5,
    )
    grouped = name == "grouped"
    assert (o["n_group"], o["topk_group"], o.get("group_score")) == (
        (4, 2, "max") if grouped else (1, 1, None)
    )
    assert (o["aux_loss_coef"], o["seq_aux_loss_coef"]) == (0.0, 0.0)  # (transformers' config has none)
    assert a["q_lora_rank"] == hf.config.q_lora_rank and a["bias"] == grouped and c.tie_embeddings == grouped
    if grouped:  # transformers' DeepseekV2Attention.scaling, the same number
        assert lm.blocks[0].mixer.scale == hf.model.layers[0].self_attn.scaling
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


def test_complex_rotary_is_mnemos_rotation_of_permuted_channels(made):
    """DeepSeek-V2's ``apply_rotary_emb`` (the pairs ``(2i, 2i + 1)`` as complex numbers times
    ``e^{i θ_i t}``, YaRN's factor included) equals mnemo's rotate-half rotary on the channels
    permuted by :func:`rope_permutation` (evens, then odds), permuted back."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    _, hf, _, lm = made
    x = torch.randn(2, 1, T, 8, generator=torch.Generator().manual_seed(5))  # [B, heads, T, dr]
    freqs = hf.model.rotary_emb(x, torch.arange(T)[None].expand(2, T))
    ref, _ = apply_rotary_emb(x, x, freqs)
    perm = rope_permutation(8, True)
    ours = lm.blocks[0].mixer.rotary(x[..., perm].transpose(1, 2)).transpose(1, 2)[..., torch.argsort(perm)]
    assert max_diff(ours, ref) <= 1e-6


def test_routing_equals_transformers(made):
    """The experts mnemo's ``hook_topk_indices`` reports in each sparse layer are the ones
    transformers' ``DeepseekV2TopkRouter`` chooses on the same tokens (as sets: its ``topk`` is
    unsorted); with groups, on 256 random hidden states too, each token's experts lie in at most
    ``topk_group`` groups, and scoring the groups by their two best experts (DeepSeek-V3's rule)
    would choose otherwise for some token."""
    name, hf, _, lm = made
    x = ids()
    chosen, hooks = {}, []
    for i in (1, 2):
        gate = hf.model.layers[i].mlp.gate
        hooks.append(gate.register_forward_hook(lambda mod, args, out, i=i: chosen.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            hf(x)
            _, cache = lm.run_with_cache(x, ["hook_topk_indices"])
    finally:
        for h in hooks:
            h.remove()
    for i in (1, 2):
        ours = cache[f"blocks.{i}.mlp.hook_topk_indices"].reshape(-1, K)
        assert torch.equal(ours.sort(-1).values, chosen[i].sort(-1).values), i
    if name != "grouped":
        return
    # many random tokens straight into the routers: the same choice; DeepSeek-V3's group score would
    # part from it
    changed = False
    h = torch.randn(256, 32, generator=torch.Generator().manual_seed(3))
    for i in (1, 2):
        moe = lm.blocks[i].mlp
        with torch.no_grad():
            theirs = hf.model.layers[i].mlp.gate(h)[2]
            ours = moe.route(h)[2]
            assert torch.equal(ours.sort(-1).values, theirs.sort(-1).values), i
            assert ((ours // 2).unsqueeze(-1) == torch.arange(4)).any(1).sum(-1).max() <= 2
            moe.group_score = "top2"
            try:
                other = moe.route(h)[2]
            finally:
                moe.group_score = "max"
        changed |= not torch.equal(other.sort(-1).values, ours.sort(-1).values)
    assert changed


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token latent-cache decoding picks transformers' greedy tokens (a
    prompt of 4, 10 new tokens)."""
    _, hf, _, lm = made
    prompt = ids(length=4, seed=2)
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 10, temperature=0), ref)


def test_export_round_trip(made, tmp_path, capsys):
    """``mnemo convert`` then export: transformers reloads the exported folder as
    ``DeepseekV2ForCausalLM`` (the rotary rows permuted back) with the fields that matter and the
    same logits; importing it again gives the same mnemo weights."""
    import transformers

    from mnemo.cli import main

    name, hf, folder, lm = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert LanguageModel.from_pretrained(tmp_path / "ck").config == lm.config
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    keys = ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
            "n_shared_experts", "norm_topk_prob", "topk_method", "routed_scaling_factor",
            "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "tie_word_embeddings", "attention_bias"]  # fmt: skip
    for k in keys + (["n_group", "topk_group"] if name == "grouped" else []):
        assert getattr(back.config, k) == getattr(hf.config, k), k
    assert hf.config.rope_parameters.items() <= back.config.rope_parameters.items()  # (+ YaRN's defaults)
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL
    config, sd = import_deepseek_v2(back.config.to_dict(), back.state_dict())
    want = lm.state_dict()
    assert config == lm.config and set(sd) == set(want)
    assert all(torch.equal(sd[k].to(want[k].dtype), want[k]) for k in want)


def _mla_lm(**over) -> LanguageModel:
    cfg = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, mixer="mla", mlp="moe", mlp_hidden=40, mlp_only_layers=[0],
        mixer_options={"mla": {"n_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8}},
        mlp_options={"n_experts": 4, "top_k": 2, "expert_hidden": 8, "norm_topk_prob": False,
                     "routed_scaling_factor": 2.0, "shared_expert_hidden": 16},
    )  # fmt: skip
    return LanguageModel(ModelConfig(**{**cfg, **over}))


def test_a_mnemo_model_exports_as_deepseek_v2(tmp_path):
    """A softmax-routed MLA model made in mnemo (not renormalised, groups scored by their largest
    score) is refused by DeepSeek-V3 and exports as ``DeepseekV2ForCausalLM``; transformers computes
    its logits; in bfloat16 the router is written in float32 (transformers keeps it so)."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(3)
    opts = {**_mla_lm().config.mlp_options, "n_group": 2, "topk_group": 1, "group_score": "max"}
    lm = _mla_lm(mlp_options=opts).eval()
    with torch.no_grad():
        lm.blocks[1].mlp.router.weight.mul_(50)  # (distinct scores: the group limit matters)
    export_hf(lm, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (written["topk_method"], written["n_group"], written["topk_group"]) == (
        "group_limited_greedy",
        2,
        1,
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, lm(x)[0]) <= ATOL
    export_hf(lm, tmp_path / "bf16", dtype="bfloat16")
    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(saved["model.layers.1.mlp.gate.weight"], lm.blocks[1].mlp.router.weight.detach())
    assert saved["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert not any(k.endswith("e_score_correction_bias") for k in saved)


def test_training_losses_of_deepseek_v2s_code():
    """DeepSeek-V2's own code (its released config's ``aux_loss_alpha`` / ``seq_aux``): the
    expert-level loss ``α · E Σ f_e P_e`` over the routing's choices, computed here from
    transformers' router outputs as that code computes it, is ``aux_loss_coef · L_aux`` of the
    imported model; ``seq_aux`` maps to ``seq_aux_loss_coef`` for greedy routing and is not carried
    over a group-limited choice; the export writes the fields back."""
    import torch.nn.functional as F

    hf = hf_model()
    cfg, sd = hf.config.to_dict(), hf.state_dict()
    config, weights = import_deepseek_v2({**cfg, "aux_loss_alpha": 0.01, "seq_aux": False}, sd)
    assert (config.mlp_options["aux_loss_coef"], config.mlp_options["seq_aux_loss_coef"]) == (0.01, 0.0)
    lm = LanguageModel(config).eval()
    lm.load_state_dict(weights)
    x = ids()
    out = {}
    hook = hf.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, o: out.setdefault("gate", o))
    try:
        with torch.no_grad():
            hf(x)
            lm(x)
    finally:
        hook.remove()
    logits, _, idx = out["gate"]
    ce = F.one_hot(idx.reshape(-1), E).float().mean(0)  # DeepSeek-V2's MoEGate, seq_aux false
    theirs = 0.01 * (logits.softmax(-1).mean(0) * ce * E).sum()
    assert lm.blocks[1].mlp.loss().item() == pytest.approx(theirs.item(), rel=1e-5)
    seq = import_deepseek_v2({**cfg, "aux_loss_alpha": 0.01}, sd)[0]  # (seq_aux: its code's default true)
    assert (seq.mlp_options["aux_loss_coef"], seq.mlp_options["seq_aux_loss_coef"]) == (0.0, 0.01)
    hf_cfg, _ = export_deepseek_v2(seq, weights)
    assert (hf_cfg["aux_loss_alpha"], hf_cfg["seq_aux"]) == (0.01, True)
    grouped = hf_config("grouped").to_dict() | {"aux_loss_alpha": 0.01}
    o = import_deepseek_v2(grouped, hf_model("grouped").state_dict())[0].mlp_options
    assert (o["aux_loss_coef"], o["seq_aux_loss_coef"]) == (0.0, 0.0)


def test_import_refusals():
    """What transformers' class does not compute as the checkpoint says, or what mnemo cannot
    express, is refused by name."""
    base = hf_config().to_dict()
    grouped = hf_config("grouped").to_dict()
    for cfg, over, said in (
        (base, {"topk_method": "noaux_tc"}, "field 'topk_method' = 'noaux_tc': transformers' DeepseekV2For"),
        (base, {"scoring_func": "sigmoid"}, "field 'scoring_func' = 'sigmoid'"),
        (base, {"moe_layer_freq": 2}, "field 'moe_layer_freq' = 2"),
        (
            base,
            {"norm_topk_prob": True},
            "field 'norm_topk_prob' = true: transformers' DeepseekV2ForCausalLM",
        ),
        (base, {"mlp_bias": True}, "field 'mlp_bias' = true"),
        (base, {"num_key_value_heads": 2}, "num_key_value_heads = 2: expected num_attention_heads = 4"),
        (base, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (base, {"num_experts_per_tok": None}, "field 'num_experts_per_tok': expected an int >= 1, got None"),
        (base, {"aux_loss_alpha": -1}, "field 'aux_loss_alpha': expected a number >= 0"),
        (grouped, {"n_group": 3}, "fields n_routed_experts = 8, n_group = 3: expected n_group dividing"),
        (grouped, {"n_group": None}, "field 'n_group': expected an int >= 1, got None"),
        (grouped, {"topk_group": 1}, "fields num_experts_per_tok = 3, topk_group = 1"),
        (base, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear' is not"),
        (base, {"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not 'deepseek_v2'"),
    ):
        with pytest.raises(ValueError, match="DeepSeek-V2 conversion: .*" + re.escape(said)):
            import_deepseek_v2({**cfg, **over}, {})
    hf = hf_model()
    with pytest.raises(
        ValueError, match=re.escape("field 'first_k_dense_replace' = 4 makes layer 1 a dense")
    ):
        import_deepseek_v2({**base, "first_k_dense_replace": 4}, hf.state_dict())
    # review 50g: transformers reads the attribute_map spelling num_experts as n_routed_experts
    alias = {k: v for k, v in base.items() if k != "n_routed_experts"} | {
        "num_experts": base["n_routed_experts"]
    }
    assert import_deepseek_v2(alias, hf.state_dict())[0] == import_deepseek_v2(base, hf.state_dict())[0]
    with pytest.raises(
        ValueError, match=r"fields 'n_routed_experts' = \d+ and 'num_experts' = 99 \(its alias\)"
    ):
        import_deepseek_v2({**base, "num_experts": 99}, {})


def test_export_refusals():
    """The export refuses by name a model the class cannot express: renormalised weights, a
    balancing bias, groups scored by their two best experts, sigmoid scores, a gated shared expert,
    dense layers that are not the first ones."""
    lm = _mla_lm()
    hf_cfg, _ = export_deepseek_v2(lm.config, lm.state_dict())
    assert (hf_cfg["topk_method"], hf_cfg["norm_topk_prob"], hf_cfg["n_shared_experts"]) == (
        "greedy",
        False,
        2,
    )
    o = lm.config.mlp_options
    for over, said in (
        (dict(mlp_options={**o, "norm_topk_prob": True}), "mlp_options option norm_topk_prob=True"),
        (dict(mlp_options={**o, "bias_balancing": True}), "mlp_options option bias_balancing=True"),
        (dict(mlp_options={**o, "n_group": 2, "topk_group": 1}), "mlp_options option group_score='top2'"),
        (dict(mlp_options={**o, "score": "sigmoid"}), "mlp_options option score='sigmoid'"),
        (dict(mlp_options={**o, "shared_expert_gate": True}), "mlp_options option shared_expert_gate=True"),
        (dict(mlp_only_layers=[1]), "mlp_only_layers [1]: DeepseekV2ForCausalLM's dense layers are the"),
    ):
        bad = _mla_lm(**over)
        with pytest.raises(ValueError, match="DeepSeek-V2 conversion: .*" + re.escape(said)):
            export_deepseek_v2(bad.config, bad.state_dict())


def test_group_score_option():
    """mnemo's ``group_score``: ``"max"`` scores a group by its largest selection score (DeepSeek-V2),
    the default ``"top2"`` by the sum of its two largest (DeepSeek-V3): on scores ``(0.5, 0) | (0.375,
    0.375)`` the first keeps group 0, the second group 1; another value is refused by name."""
    from mnemo.layers import MoE

    sel = torch.tensor([[0.5, 0.0, 0.375, 0.375]])
    inf = float("-inf")
    for score, want in (("max", [0.5, 0.0, inf, inf]), ("top2", [inf, inf, 0.375, 0.375])):
        moe = MoE(8, n_experts=4, top_k=1, n_group=2, topk_group=1, group_score=score)
        assert moe._limit_groups(sel).tolist() == [want]
    assert "group_score='max'" in repr(MoE(8, n_experts=4, n_group=2, topk_group=1, group_score="max"))
    assert MoE(8, n_experts=4).group_score == "top2"
    with pytest.raises(ValueError, match=r"group_score: expected one of \('top2', 'max'\), got 'sum'"):
        MoE(8, n_experts=4, group_score="sum")
