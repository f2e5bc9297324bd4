"""The mixture-of-experts releases (Mixtral, Qwen3-MoE, Qwen2-MoE) in and out of mnemo: tiny
random-weight models built and saved by ``transformers`` itself (4 experts, top-2, 2 layers,
grouped-query heads, ``head_dim`` 12 ≠ hidden/heads) are converted, and their logits (full pass
and token loop), routing, greedy generations and exports are compared with ``transformers``' own
classes; what mnemo cannot express exactly is refused by name.

Formats, each with a window of 5 (as each class reads it): Mixtral (always renormalised top-k),
Qwen3-MoE tied, with biases, q/k norms and ``norm_topk_prob`` true, Qwen2-MoE with the gated
shared expert, q/k/v biases and ``norm_topk_prob`` false. Measured (CPU, 12 tokens): float32 max
|Δlogits| ≤ 1.2e-6 full pass, ≤ 1.9e-6 token loop (logits of size ~4), bounded by 2e-5; float64,
with ``transformers``' float32 casts lifted (its routers' softmax, norms and rotary angles),
≤ 2.5e-15, bounded by 1e-12 (without the lift ~1e-6: its routing weights are float32 even in a
float64 model).
"""

from __future__ import annotations

import contextlib
import importlib
import json

import pytest
import torch

from mnemo.hf.convert import export_hf
from mnemo.hf.llama import (
    export_mixtral,
    export_qwen2_moe,
    import_mixtral,
    import_qwen2_moe,
    import_qwen3_moe,
)
from mnemo.models import LanguageModel, ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T, WINDOW, E, K = 53, 12, 5, 4, 2
ATOL = 2e-5  # float32; measured ≤ 1.9e-6
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, num_experts_per_tok=K, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)  # fmt: skip
QWEN_EXPERTS = dict(num_experts=E, moe_intermediate_size=12)
#: name -> (config class, model class, options beyond SMALL, the window)
FORMATS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E, sliding_window=WINDOW)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(QWEN_EXPERTS, norm_topk_prob=True, tie_word_embeddings=True, attention_bias=True,
             use_sliding_window=True, sliding_window=WINDOW),  # fmt: skip
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(QWEN_EXPERTS, shared_expert_intermediate_size=16, use_sliding_window=True,
             sliding_window=WINDOW, layer_types=["sliding_attention"] * 2),
    ),
}  # fmt: skip
IMPORTS = {"mixtral": import_mixtral, "qwen3_moe": import_qwen3_moe, "qwen2_moe": import_qwen2_moe}


def hf_config(name: str, **over):
    import transformers

    config_cls, _, opts = FORMATS[name]
    return getattr(transformers, config_cls)(**{**SMALL, **opts, **over})


def hf_model(name: str, seed: int = 0, **over):
    """A random-weight ``…ForCausalLM`` (float32), every weight moved off its init (the routers
    included, so that each token's experts differ)."""
    import transformers

    torch.manual_seed(seed)
    m = getattr(transformers, FORMATS[name][1])(hf_config(name, **over)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module", params=list(FORMATS))
def made(request, tmp_path_factory):
    """``(name, transformers model, its saved folder, mnemo model read from the folder)``."""
    name = request.param
    hf = hf_model(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, folder, LanguageModel.from_pretrained(folder).eval()


def test_logits_equal_transformers(made):
    """Full-pass and token-loop (``mode="recurrent"``) logits equal transformers' (float32) on 12
    tokens, past the window where there is one; the converted model has the format's experts,
    routing normalisation, shared expert, window, heads and tying."""
    name, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        assert max_diff(lm(x, mode="recurrent")[0], ref) <= ATOL
    o, a = lm.config.mlp_options, lm.config.mixer_options["attention"]
    assert lm.config.mlp == "moe" and (o["n_experts"], o["top_k"]) == (E, K)
    assert o["norm_topk_prob"] == (name != "qwen2_moe")
    assert o.get("shared_expert_hidden") == (16 if name == "qwen2_moe" else None)
    assert o["expert_hidden"] == (40 if name == "mixtral" else 12)
    assert a["window"] == WINDOW
    assert (a["n_heads"], a["n_kv_heads"], a["head_dim"]) == (4, 2, 12)
    assert a["qk_norm"] == (name == "qwen3_moe") and lm.config.tie_embeddings == (name == "qwen3_moe")
    assert a["bias"] == {"mixtral": False, "qwen3_moe": True, "qwen2_moe": "qkv"}[name]
    # transformers' loss is k × mnemo's per layer, pooled over the L layers: k / L
    assert o["aux_loss_coef"] == pytest.approx(hf.config.router_aux_loss_coef * K / 2)


class _Float64Torch:
    """``torch`` for a modeling module, with ``float32`` / ``float`` meaning float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def transformers_in_float64(hf):
    """transformers' routers, norms and rotary angles compute in float32 even in a float64 model
    (``softmax(…, dtype=torch.float)``, ``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``):
    lifted for the call, and its rotary frequencies (plain, or YaRN as DeepSeek-V3's) computed in
    float64 as mnemo's float64 model computes them (also ``tests/hf/test_deepseek_v3_49.py``'s)."""
    from mnemo.layers.rotary import yarn_hf_inv_freq
    from tests.hf.test_mamba_interop import transformers_in_float64 as lift

    rot, rp = hf.model.rotary_emb, hf.config.rope_parameters
    R = 2 * rot.inv_freq.shape[0]
    if rp["rope_type"] == "yarn":
        rot.inv_freq = yarn_hf_inv_freq(
            rp["rope_theta"], R, rp["factor"], rp["original_max_position_embeddings"], dtype=torch.float64
        )
    else:
        rot.inv_freq = 1.0 / rp["rope_theta"] ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    mp = pytest.MonkeyPatch()
    mp.setattr(importlib.import_module(type(hf).__module__), "torch", _Float64Torch())
    try:
        with lift():
            yield
    finally:
        mp.undo()


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
    """An independent reading of the routing: the experts mnemo's ``hook_topk_indices`` reports in
    each layer are transformers' router choice on the same tokens (the top-k of the softmax of the
    ``router_logits`` its ``output_router_logits`` returns), and every expert serves some token;
    transformers' balance loss is ``k`` times mnemo's ``L_aux`` with the layers pooled (the reason
    for the import's ``aux_loss_coef = router_aux_loss_coef · k / L``)."""
    _, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        out = hf(x, output_router_logits=True)
        _, cache = lm.run_with_cache(x, ["hook_topk_indices", "hook_router_logits"])
    loads, probs = [], []
    for i, logits in enumerate(out.router_logits):
        chosen = torch.softmax(logits.float(), -1).topk(K, dim=-1).indices
        ours = cache[f"blocks.{i}.mlp.hook_topk_indices"].reshape(-1, K)
        assert torch.equal(ours, chosen), i
        assert torch.bincount(ours.reshape(-1), minlength=E).min() > 0
        loads.append(lm.blocks[i].mlp.last_load)
        probs.append(torch.softmax(cache[f"blocks.{i}.mlp.hook_router_logits"].reshape(-1, E), -1).mean(0))
        assert lm.blocks[i].mlp.last_aux_loss.item() == pytest.approx(E * (loads[i] * probs[i]).sum().item())
    # transformers' balance loss: k × mnemo's L_aux, its shares and probabilities pooled over the layers
    pooled = E * (K * torch.stack(loads).mean(0) * torch.stack(probs).mean(0)).sum()
    assert out.aux_loss.item() == pytest.approx(pooled.item(), rel=1e-5)


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token KV-cache decoding picks transformers' greedy tokens (a prompt of
    4, 10 new tokens: past the window of 5 where there is one)."""
    _, hf, _, lm = made
    prompt = ids(length=4, seed=2)
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 10, temperature=0), ref)


def test_export_round_trip(made, tmp_path, capsys):
    """``mnemo convert`` then export: the converted checkpoint is the import's model, and
    transformers reloads the exported folder as the source class, with the fields that matter and
    the same logits; the router coefficient comes back."""
    import transformers

    from mnemo.cli import main

    name, hf, folder, lm = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert LanguageModel.from_pretrained(tmp_path / "ck").config == lm.config
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob", "sliding_window", "layer_types",
              "tie_word_embeddings", "attention_bias", "qkv_bias"):  # fmt: skip
        assert getattr(back.config, k, None) == getattr(hf.config, k, None), k
    assert back.config.router_aux_loss_coef == pytest.approx(hf.config.router_aux_loss_coef)
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL


def _hub_layout(name: str, sd: dict) -> dict:
    """transformers 5's fused experts (``experts.gate_up_proj [E, 2I, d]``, ``experts.down_proj``)
    written by hand as the Hub's per-expert files (Mixtral's ``block_sparse_moe.experts.{e}.w1`` /
    ``w3`` / ``w2``; Qwen's ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``)."""
    qwen = ("mlp.", ("gate_proj", "up_proj", "down_proj"))
    block, (g, u, dn) = ("block_sparse_moe.", ("w1", "w3", "w2")) if name == "mixtral" else qwen
    out = {}
    for k, v in sd.items():
        if ".mlp.experts.gate_up_proj" in k:
            p = k.split("mlp.")[0] + block
            for e, (gate, up) in enumerate(t.chunk(2, 0) for t in v):
                out[f"{p}experts.{e}.{g}.weight"], out[f"{p}experts.{e}.{u}.weight"] = gate, up
        elif ".mlp.experts.down_proj" in k:
            p = k.split("mlp.")[0] + block
            for e, t in enumerate(v):
                out[f"{p}experts.{e}.{dn}.weight"] = t
        else:
            out[k.replace(".mlp.gate.", f".{block}gate.")] = v
    return out


def test_both_expert_layouts(made):
    """The fused experts of a transformers 5 state dict and the Hub's per-expert files (written by
    hand from them) import to the same mnemo weights, equal to the ones read from save_pretrained's
    folder."""
    name, hf, folder, lm = made
    fused = {k: v.clone() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    hub = _hub_layout(name, fused)
    assert not any("gate_up_proj" in k for k in hub)
    cfg = json.loads((folder / "config.json").read_text())
    want = lm.state_dict()
    for sd in (fused, hub):
        config, got = IMPORTS[name](cfg, sd)
        assert config == lm.config and set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)


def _moe_lm(seed: int = 0, attention=None, **moe) -> LanguageModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, mixer="attention", mlp="moe",
        mlp_options={"n_experts": E, "top_k": K, "expert_hidden": 12, **moe},
        mixer_options={"attention": {"n_heads": 4, "n_kv_heads": 2, **(attention or {})}},
    )  # fmt: skip
    lm = LanguageModel(cfg).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return lm


def test_export_picks_the_class(tmp_path):
    """mnemo's own ``mlp="moe"`` attention stacks export as the first class that expresses them —
    renormalised top-k: Mixtral; q/k norms: Qwen3-MoE (either normalisation); a gated shared
    expert: Qwen2-MoE — which computes the same logits. A routing no class computes is refused,
    each candidate naming why (the dense classes: the MLP)."""
    import transformers

    x = ids()
    picks = [
        ({}, {}, "MixtralForCausalLM"),
        ({"qk_norm": True}, {"norm_topk_prob": False}, "Qwen3MoeForCausalLM"),
        ({"bias": "qkv", "window": WINDOW}, {"shared_expert_hidden": 16, "shared_expert_gate": True,
                                              "norm_topk_prob": False}, "Qwen2MoeForCausalLM"),
    ]  # fmt: skip
    for i, (attention, moe, arch) in enumerate(picks):
        lm = _moe_lm(i, attention, **moe)
        export_hf(lm, tmp_path / arch)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / arch).eval()
        assert type(back).__name__ == arch
        with torch.no_grad():
            assert max_diff(back(x).logits, lm(x)[0]) <= ATOL
    with pytest.raises(ValueError, match="exports as none of") as e:  # not renormalised, no q/k norm
        export_hf(_moe_lm(norm_topk_prob=False), tmp_path / "plain")
    said = str(e.value)
    assert "LlamaForCausalLM: Llama conversion: mlp 'moe' is not supported" in said
    assert "Mixtral conversion: mlp_options option norm_topk_prob=False has no Mixtral equivalent" in said
    assert "Qwen3-MoE conversion: mixer_options['attention'] option qk_norm=False" in said
    assert "Qwen2-MoE conversion: mlp_options options shared_expert_hidden=None" in said
    ungated = _moe_lm(shared_expert_hidden=16)  # (another format may take it: asked of Qwen2-MoE)
    with pytest.raises(ValueError, match=r"Qwen2-MoE conversion: .*shared_expert_gate=False.*always gated"):
        export_qwen2_moe(ungated.config, ungated.state_dict())
    sigmoid = _moe_lm(score="sigmoid")
    with pytest.raises(ValueError, match=r"Mixtral conversion: mlp_options option score='sigmoid'"):
        export_mixtral(sigmoid.config, sigmoid.state_dict())


def test_import_refusals_and_dense():
    """An expert count given twice with two values or a top-k beyond the experts is refused by
    name, and so is a Qwen2-MoE whose default layer types mix sliding and full layers; a Qwen3-MoE
    whose layers are all dense imports as a dense SwiGLU model."""
    base = hf_config("qwen3_moe").to_dict()
    for over, said in (
        ({"num_experts": 4, "num_local_experts": 8}, "fields .*: the expert count is given twice"),
        (
            {"num_experts_per_tok": 5, "num_local_experts": 4},
            "field 'num_experts_per_tok' = 5: expected at most",
        ),
    ):
        with pytest.raises(ValueError, match="Qwen3-MoE conversion: " + said):
            import_qwen3_moe({**base, **over}, {})
    q2 = {**hf_config("qwen2_moe").to_dict(), "layer_types": None, "max_window_layers": 2}
    with pytest.raises(ValueError, match=r"Qwen2-MoE conversion: layers \[0\] use sliding-window"):
        import_qwen2_moe(q2, {})
    hf = hf_model("qwen3_moe", mlp_only_layers=[0, 1])
    config, sd = import_qwen3_moe(hf.config.to_dict(), hf.state_dict())
    assert config.mlp == "swiglu" and config.mlp_hidden == 40
    lm = LanguageModel(config).eval()
    lm.load_state_dict(sd)
    x = ids()
    with torch.no_grad():
        assert max_diff(lm(x)[0], hf(x).logits) <= ATOL


@pytest.mark.parametrize(
    "name, over, dense",
    [("qwen3_moe", {"decoder_sparse_step": 2}, [0]), ("qwen2_moe", {"mlp_only_layers": [1]}, [1])],
)
def test_dense_layers_among_sparse(name, over, dense, tmp_path):
    """Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` (dense layers of ``intermediate_size``
    among sparse ones) import as mnemo's ``mlp_only_layers`` with ``mlp_hidden`` that width: logits
    equal transformers' (float32), and the export (``mlp_only_layers``, ``decoder_sparse_step`` 1)
    loads in ``transformers`` with the same logits. Mixtral, all sparse, refuses such a model."""
    import transformers

    hf = hf_model(name, **over)
    config, sd = IMPORTS[name](hf.config.to_dict(), hf.state_dict())
    assert config.mlp == "moe" and config.mlp_only_layers == dense and config.mlp_hidden == 40
    lm = LanguageModel(config).eval()
    lm.load_state_dict(sd)
    assert [type(b.mlp).__name__ for b in lm.blocks] == ["SwiGLU" if i in dense else "MoE" for i in range(2)]
    x = ids()
    with torch.no_grad():
        out = hf(x, output_router_logits=True)
        ref = out.logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        # one sparse layer: transformers' c · (balance loss over the sparse layers' router logits) is
        # mnemo's aux_loss_coef · L_aux exactly (coefficient c · k / 1: dense layers do not count)
        c = hf.config.router_aux_loss_coef
        assert config.mlp_options["aux_loss_coef"] == pytest.approx(c * K)
        assert lm.aux_loss().item() == pytest.approx(c * out.aux_loss.item(), rel=1e-5)
    lm.save_pretrained(tmp_path / "mnemo")
    export_hf(tmp_path / "mnemo", tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == (dense, 1)
    assert written["router_aux_loss_coef"] == pytest.approx(hf.config.router_aux_loss_coef)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert max_diff(back(x).logits, ref) <= ATOL
    with pytest.raises(
        ValueError, match=r"Mixtral conversion: ModelConfig\.mlp_only_layers = \[.\] \(dense layers"
    ):
        export_mixtral(lm.config, lm.state_dict())
