"""Moonshot's Kimi Linear (``KimiLinearForCausalLM``) in and out of mnemo: tiny random-weight models
built and saved by ``transformers`` itself are converted (``mnemo.hf.kimi_linear``), and their logits
(full pass and token loop), greedy generations and exports are compared with ``transformers``' own
class; what mnemo cannot express exactly is refused by name. Also multi-head latent attention
without positions (``MultiHeadLatentAttention(rope=False)``, Kimi Linear's MLA) against a hand
computation.

Variants (4 layers, 8 experts in 4 groups of which 2 are kept, top-3, a random
``e_score_correction_bias``, ``routed_scaling_factor`` 2.5): KDA, KDA, KDA, MLA with a full
``q_proj``, the first MLP dense, two shared experts; and KDA, MLA, KDA, KDA with ``q_lora_rank`` 12,
``attention_bias``, dense MLPs at layers 1 and 3 (not a prefix), ``moe_renormalize`` false, no shared
expert and ``tie_word_embeddings`` true (which the class ignores). Measured (CPU, 20 tokens, logits of
size ~4): float32 max |Δlogits| 7.3e-6 / 1.9e-5 full pass, 7.3e-6 / 1.7e-5 token loop, bounded by
5e-5 — most of it is transformers' own float32 rounding (its logits are 8.6e-6 / 2.4e-5 from the
float64 result, mnemo's float32 4.4e-6 / 5.4e-6); float64 with ``transformers``' float32 casts
lifted ≤ 2.9e-14, bounded by 1e-12.
"""

from __future__ import annotations

import contextlib
import importlib
import json

import pytest
import torch

from mnemo.models import LanguageModel
from tests.hf.test_moe_family_49 import _Float64Torch, max_diff

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T, E, K = 61, 20, 8, 3
ATOL = 5e-5  # float32; measured ≤ 1.9e-5 (transformers' float32 alone: 2.4e-5 from float64)
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4,
    v_head_dim=10, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3, num_local_experts=E,
    num_experts_per_tok=K, n_group=4, topk_group=2, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
VARIANTS = {
    "kda3_mla_full_q": dict(
        q_lora_rank=None, n_shared_experts=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
    "mla_second_lora_q_tied": dict(
        q_lora_rank=12, attention_bias=True, n_shared_experts=0, norm_topk_prob=False,
        tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "dense"],
    ),
}  # fmt: skip


def hf_model(name: str = "kda3_mla_full_q", seed: int = 0, **over):
    """A random-weight ``KimiLinearForCausalLM`` (float32), every weight and the routers'
    ``e_score_correction_bias`` moved off their init."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.KimiLinearConfig(**{**SMALL, **VARIANTS[name], **over})
    m = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return m


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def transformers_in_float64(hf):
    """transformers' Kimi Linear computes its norms, router, gates and KDA in float32 even in a
    float64 model (``.to(torch.float32)``, ``.float()``, ``.type(torch.float32)``): lifted for the call."""
    from tests.hf.test_mamba_interop import transformers_in_float64 as lift

    mp = pytest.MonkeyPatch()
    mp.setattr(importlib.import_module(type(hf).__module__), "torch", _Float64Torch())
    try:
        with lift():
            yield
    finally:
        mp.undo()


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
    converted model has KDA and MLA (without positions) layers where ``layer_types`` puts them, the
    dense and sparse MLPs of ``mlp_layer_types``, DeepSeek-V3's router with the file's correction
    bias, and an untied head."""
    name, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        assert max_diff(lm(x, mode="recurrent")[0], ref) <= ATOL
    c, first = lm.config, name == "kda3_mla_full_q"
    assert c.layers == (["kda"] * 3 + ["mla"] if first else ["kda", "mla", "kda", "kda"])
    assert c.mlp_only_layers == ([0] if first else [1, 3]) and not c.tie_embeddings
    o, a, k = c.mlp_options, c.mixer_options["mla"], c.mixer_options["kda"]
    assert (o["n_experts"], o["top_k"], o["expert_hidden"]) == (E, K, 8)
    assert o["shared_expert_hidden"] == (16 if first else None) and o["norm_topk_prob"] == first
    assert (o["score"], o["n_group"], o["topk_group"], o["routed_scaling_factor"]) == ("sigmoid", 4, 2, 2.5)
    assert a["rope"] is False and a["q_lora_rank"] == (None if first else 12) and a["bias"] == (not first)
    assert (k["n_heads"], k["head_dim"], k["conv_size"], k["norm_eps"]) == (2, 8, 3, 1e-6)
    mla = next(b.mixer for b in lm.blocks if type(b.mixer).__name__ == "MultiHeadLatentAttention")
    assert mla.rotary is None and mla.scale == 10**-0.5
    sparse = [i for i, t in enumerate(hf.config.mlp_layer_types) if t == "sparse"]
    for i in sparse:
        assert torch.equal(lm.blocks[i].mlp.expert_bias, hf.model.layers[i].mlp.gate.e_score_correction_bias)


def test_logits_equal_transformers_in_float64(made):
    """The same in float64, with transformers' float32 casts lifted: equal to rounding."""
    _, hf, folder, _ = made
    hf = type(hf).from_pretrained(folder).double().eval()
    hf.config._experts_implementation = "eager"  # (grouped_mm takes float32 / bfloat16 only)
    lm = LanguageModel.from_pretrained(folder).double().eval()
    x = ids()
    with torch.no_grad(), transformers_in_float64(hf):
        assert max_diff(lm(x)[0], hf(x).logits) <= 1e-12


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token decoding (KDA's recurrent state and conv tail, MLA's latent
    cache) picks transformers' greedy tokens (a prompt of 4, 10 new tokens)."""
    _, hf, _, lm = made
    prompt = ids(length=4, seed=2)
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 10, temperature=0), ref)


def test_export_round_trip(made, tmp_path, capsys):
    """``mnemo convert`` then export: transformers reloads the exported folder (the Hub's layout:
    per-projection convs, per-expert ``w1`` / ``w3`` / ``w2`` under ``block_sparse_moe.``) as
    ``KimiLinearForCausalLM`` with the same layer kinds, sizes, routing fields and logits; importing
    it again gives the same mnemo weights."""
    import transformers

    from mnemo.cli import main
    from mnemo.hf.convert import export_hf
    from mnemo.hf.kimi_linear import import_kimi_linear

    _, hf, folder, lm = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert LanguageModel.from_pretrained(tmp_path / "ck").config == lm.config
    export_hf(tmp_path / "ck", tmp_path / "back")
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["mla_use_nope"] is True and saved["tie_word_embeddings"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    for f in ("layer_types", "mlp_layer_types", "num_local_experts", "num_experts_per_tok", "n_group",
              "topk_group", "n_shared_experts", "norm_topk_prob", "routed_scaling_factor",
              "moe_intermediate_size", "intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "attention_bias", "linear_num_heads", "linear_head_dim",
              "linear_conv_kernel_dim", "rms_norm_eps"):  # fmt: skip
        assert getattr(back.config, f) == getattr(hf.config, f), f
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL
    config, sd = import_kimi_linear(back.config.to_dict(), back.state_dict())
    want = lm.state_dict()
    assert config == lm.config and set(sd) == set(want)
    assert all(torch.equal(sd[k].to(want[k].dtype), want[k]) for k in want)


def test_config_spellings_and_layouts(tmp_path):
    """Moonshot's ``config.json`` (1-based ``linear_attn_config`` layer lists, its MoE field names,
    ``first_k_dense_replace``, no ``layer_types``) and transformers' state dict (fused conv, forget
    gate module, fused experts) import as the saved folder does; mnemo's own ``kimi_linear`` preset
    (NoPE MLA, dense SwiGLUs, tied) exports to a folder transformers computes the same logits from
    (two copies of the tied matrix), and re-imports unchanged."""
    import transformers
    from safetensors.torch import save_file

    from mnemo.hf.kimi_linear import export_kimi_linear, import_kimi_linear
    from mnemo.models import build_config

    hf = hf_model()
    cfg = hf.config.to_dict()
    c1, sd1 = import_kimi_linear(cfg, hf.state_dict())
    moonshot = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types")}
    moonshot |= {"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                                        "head_dim": 8, "short_conv_kernel_size": 3},
                 "first_k_dense_replace": 1, "mla_use_nope": True, "moe_layer_freq": 1}  # fmt: skip
    _, hub = export_kimi_linear(c1, sd1)
    c2, sd2 = import_kimi_linear(moonshot, hub)
    assert c1 == c2 and set(sd1) == set(sd2) and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    torch.manual_seed(0)
    preset = build_config("kimi_linear", vocab_size=VOCAB, d_model=32)
    lm = LanguageModel(preset).eval()
    hf_cfg, hf_sd = export_kimi_linear(preset, lm.state_dict())
    assert hf_cfg["mlp_layer_types"] == ["dense"] * 4 and "num_experts" not in hf_cfg
    save_file(
        {k: v.clone() for k, v in hf_sd.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"}
    )
    ids_null = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))  # (as export_hf writes them)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg | ids_null))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert max_diff(lm(ids())[0], theirs(ids()).logits) <= ATOL
    back, sd = import_kimi_linear(hf_cfg, hf_sd)
    assert back.layers == preset.layer_mixers() and back.mlp == "swiglu" and not back.tie_embeddings
    assert all(torch.equal(sd[k], v) for k, v in lm.state_dict().items())


REFUSED_IMPORT = [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(num_key_value_heads=2), "num_key_value_heads = 2"),
    (dict(mla_use_nope=False), "'mla_use_nope' = False"),
    (dict(moe_router_activation_func="softmax"), "'moe_router_activation_func'"),
    (dict(moe_layer_freq=2), "'moe_layer_freq' = 2"),
    (dict(linear_attn_config={"gate_lower_bound": -5.0}), "gate_lower_bound"),
    (dict(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [3]}), "full_attn_layers"),
    (dict(linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3]}), "contradicts linear_attn"),
    (dict(first_k_dense_replace=2), "'mlp_layer_types' = .* contradicts first_k_dense_replace = 2"),
    (dict(num_expert_group=8), "groups of at least two experts"),
    (dict(num_local_experts=8, num_experts=4), "'num_local_experts' = 8 and 'num_experts' = 4"),
    (dict(is_moe=False), "'is_moe' = false"),
]


@pytest.mark.parametrize("over, match", REFUSED_IMPORT, ids=[m for _, m in REFUSED_IMPORT])
def test_refused_imports_are_named(over, match):
    from mnemo.hf.kimi_linear import import_kimi_linear

    hf = hf_model()
    with pytest.raises(ValueError, match="Kimi Linear conversion: .*" + match):
        import_kimi_linear({**hf.config.to_dict(), **over}, hf.state_dict())
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="never ties its head"):
        import_kimi_linear({**hf.config.to_dict(), "tie_word_embeddings": True}, sd)


REFUSED_EXPORT = [
    (dict(layers=["kda", "attention"]), "layer 1 uses mixer 'attention'"),
    (
        dict(layers=["kda", "kda"]),
        "no 'mla' layer; expected at least one",
    ),  # (transformers fails with a cache)
    (dict(mla={"rope": True}), "option rope=True"),
    (dict(mla={"softmax_scale": 0.5}), "softmax_scale"),
    (dict(kda={"gate_rank": 4}), "option gate_rank=4"),
    (dict(kda={"output_gate_bias": True}), "option output_gate_bias=True"),
    (dict(kda={"norm_eps": 1e-6}), "option norm_eps=1e-06"),
    (dict(moe={"score": "softmax"}), "option score='softmax'"),
    (dict(moe={"shared_expert_gate": True, "shared_expert_hidden": 8}), "shared_expert_gate=True"),
    (dict(moe={"n_group": 8, "topk_group": 4}), "at least two experts per group"),
]


@pytest.mark.parametrize("over, match", REFUSED_EXPORT, ids=[m for _, m in REFUSED_EXPORT])
def test_refused_exports_are_named(over, match):
    from mnemo.hf.kimi_linear import export_kimi_linear
    from mnemo.models import ModelConfig

    moe = dict(n_experts=E, top_k=K, expert_hidden=8, score="sigmoid", n_group=4, topk_group=2)
    config = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, layers=over.get("layers", ["kda", "mla"]), mlp="moe",
        mixer_options={"kda": {"n_heads": 2, **over.get("kda", {})}, "mla": {"n_heads": 4, "rope": False,
                                                                            **over.get("mla", {})}},
        mlp_options={**moe, **over.get("moe", {})}, mlp_only_layers=[0], tie_embeddings=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="Kimi Linear conversion: .*" + match):
        export_kimi_linear(config, LanguageModel(config).state_dict())


def _mla(rope: bool, dr: int, seed: int = 0):
    from mnemo.layers.mla import MultiHeadLatentAttention

    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(24, 3, kv_lora_rank=10, qk_nope_head_dim=5, qk_rope_head_dim=dr,
                                 v_head_dim=7, rope=rope, q_lora_rank=9).double()  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _mla_by_hand(m, x):
    """MLA without positions from its equations (eq. 9–19 with no RoPE): per head the keys
    ``[W^UK_h c^KV; W^KR x]``, queries ``[q^C_h; q^R_h]``, values ``W^UV_h c^KV``, causal softmax."""
    B, L, _ = x.shape
    H, r, dn, dr, dv = m.n_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    rms = lambda t, n: t / (t.pow(2).mean(-1, keepdim=True) + n.eps).sqrt() * n.weight  # noqa: E731
    cq = rms(x @ m.q_a_proj.weight.T, m.q_a_norm)
    q = (cq @ m.q_b_proj.weight.T).view(B, L, H, dn + dr)
    a = x @ m.kv_a_proj.weight.T
    c, k_r = rms(a[..., :r], m.kv_a_norm), a[..., r:]
    kv = (c @ m.kv_b_proj.weight.T).view(B, L, H, dn + dv)
    k = torch.cat([kv[..., :dn], k_r[:, :, None].expand(B, L, H, dr)], -1)
    s = torch.einsum("bthd,bshd->bhts", q, k) * (dn + dr) ** -0.5
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), kv[..., dn:])
    return o.reshape(B, L, H * dv) @ m.o_proj.weight.T


def test_mla_without_positions_equals_a_hand_computation():
    """``rope=False``: the decoupled channels unrotated (an odd width is allowed) in the parallel
    form, the absorbed token loop and one-token decoding after a prefill, equal to the equations
    (float64); the output is independent of the offset the state carries, and the same weights
    with ``rope=True`` compute another function; ``rope_scaling`` is refused without rotary
    positions."""
    from mnemo.layers.mla import MLAState, MultiHeadLatentAttention

    m = _mla(rope=False, dr=3)
    x = torch.randn(2, 9, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = _mla_by_hand(m, x)
    with torch.no_grad():
        for mode in ("parallel", "recurrent"):
            assert max_diff(m(x, mode=mode)[0], want) <= 1e-12, mode
        y, state = m(x[:, :5])
        steps = [y]
        for t in range(5, 9):
            y, state = m(x[:, t : t + 1], state)
            steps.append(y)
        assert max_diff(torch.cat(steps, 1), want) <= 1e-12
        moved = MLAState(latent=None, offset=1000)
        assert max_diff(m(x, moved)[0], want) <= 1e-12
        nope, rotated = _mla(rope=False, dr=4), _mla(rope=True, dr=4)
        assert max_diff(nope(x)[0], _mla_by_hand(nope, x)) <= 1e-12
        assert max_diff(rotated(x)[0], _mla_by_hand(nope, x)) > 1e-3
    with pytest.raises(ValueError, match="rope_scaling: needs rope=True"):
        MultiHeadLatentAttention(24, 3, rope=False, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="no rotary positions"):
        m.set_rope_scaling({"rope_type": "linear", "factor": 2.0})
