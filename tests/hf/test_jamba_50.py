"""AI21's Jamba in and out of mnemo, and the Mamba mixer's ``bcdt_norm`` (Jamba's RMSNorms with
weights on the Δ input, B and C) on its own.

Tiny random-weight ``JambaForCausalLM`` models built and saved by ``transformers`` itself are
converted, and their logits, routing, greedy generations and exports are compared with
``transformers``' own class; what mnemo cannot express exactly is refused by name.

* ``MOE``: 4 layers, attention at layer 1 (``attn_layer_period`` 4, offset 1: grouped-query, 4 query
  / 2 key-value heads, ``head_dim`` 12 ≠ hidden / heads, no positions), Mamba elsewhere (projection
  biases, ``mamba_dt_rank`` 3), a top-2 mixture of 4 experts at layers 1 and 3
  (``expert_layer_period`` 2, offset 1; the others dense), untied head;
* ``DENSE``: 3 layers, attention at 0 and 2, ``num_experts`` 1 (every MLP dense), no conv bias,
  tied head.

Measured (float32, CPU, 21 tokens): max |Δlogits| 4.6e-6 (``MOE``) / 1.2e-6 (``DENSE``), logits up
to ~4.2; token by token (``mode="recurrent"``) 4.0e-6 / 5.4e-6; at 200 tokens 7.6e-6 / 2.4e-6; the
tests bound it by 2e-5. In float64,
with ``transformers``' float32 casts lifted (its norms, router softmax and scans then compute in
float64): 7.3e-15, bounded by 1e-12 (2.4e-6 without the lift).
"""

from __future__ import annotations

import contextlib
import importlib
import json

import pytest
import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T, E, K = 61, 21, 4, 2
ATOL = 2e-5  # float32; measured ≤ 4.6e-6
MOE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
    expert_layer_offset=1, num_experts=E, num_experts_per_tok=K, mamba_d_state=8, mamba_d_conv=4,
    mamba_expand=2, mamba_dt_rank=3, mamba_proj_bias=True, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
DENSE = {k: v for k, v in MOE.items() if k != "head_dim"} | dict(
    num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=0, num_experts=1, num_key_value_heads=4,
    mamba_conv_bias=False, mamba_proj_bias=False, tie_word_embeddings=True,
)  # fmt: skip


def hf_model(opts: dict, seed: int = 0):
    """A random-weight ``JambaForCausalLM`` (float32), every weight moved off its init (the routers
    and the dt / B / C norms included)."""
    transformers = pytest.importorskip("transformers")
    import mnemo.hf  # noqa: F401  (registers the converters: LanguageModel.from_pretrained reads the folders)

    torch.manual_seed(seed)
    m = transformers.JambaForCausalLM(transformers.JambaConfig(**opts)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``(transformers model, its saved folder, mnemo model read from the folder)`` of ``MOE``."""
    hf = hf_model(MOE)
    folder = tmp_path_factory.mktemp("jamba")
    hf.save_pretrained(folder)
    return hf, folder, LanguageModel.from_pretrained(folder).eval()


def test_the_converted_model_is_the_function_of_the_config(made):
    """Attention (no positions) where ``i % 4 == 1``, Mamba with ``bcdt_norm`` elsewhere; a MoE
    (not renormalised) where ``i % 2 == 1``, the other layers dense SwiGLUs of the same width."""
    hf, _, lm = made
    c = lm.config
    assert c.layer_mixers() == ["mamba", "attention", "mamba", "mamba"] == hf.config.layers_block_type
    assert c.mlp == "moe" and c.mlp_only_layers == [0, 2] and c.mlp_hidden == 24
    o, a, m = c.mlp_options, c.mixer_options["attention"], c.mixer_options["mamba"]
    assert (o["n_experts"], o["top_k"], o["expert_hidden"], o["norm_topk_prob"]) == (E, K, 24, False)
    assert o["aux_loss_coef"] == pytest.approx(0.02 * K / 2)  # c · k / L over the 2 sparse layers
    assert (a["n_heads"], a["n_kv_heads"], a["head_dim"], a["rope"], a["bias"]) == (4, 2, 12, False, False)
    assert (m["dt_rank"], m["d_state"], m["bias"], m["conv_bias"]) == (3, 8, True, True)
    assert m["bcdt_norm"] is True and m["norm_eps"] == c.norm_eps == 1e-5
    assert not c.tie_embeddings and c.pos_embedding == "none"


def test_logits_equal_transformers(made):
    """Full-pass and token-loop logits equal transformers' (float32, 21 tokens); a renormalised
    router (the top-k weights summing to 1) would compute other logits."""
    hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        assert max_diff(lm(x, mode="recurrent")[0], ref) <= ATOL
        cfg = lm.config.to_dict()
        cfg["mlp_options"]["norm_topk_prob"] = True
        other = LanguageModel(ModelConfig.from_dict(cfg)).eval()
        other.load_state_dict(lm.state_dict())
        assert max_diff(other(x)[0], ref) > 1e-3


@contextlib.contextmanager
def _transformers_in_float64(hf):
    """transformers' RMSNorms (``.to(torch.float32)``), router softmax (``dtype=torch.float``) and
    scans (``.float()``) compute in float32 even in a float64 model: lifted for the call."""
    from tests.hf.test_mamba_interop import transformers_in_float64 as lift
    from tests.hf.test_moe_family_49 import _Float64Torch

    mp = pytest.MonkeyPatch()
    mp.setattr(importlib.import_module(type(hf).__module__), "torch", _Float64Torch())
    try:
        with lift():
            yield
    finally:
        mp.undo()


def test_logits_equal_transformers_in_float64(made):
    """The same in float64, with transformers' float32 casts lifted: equal to rounding."""
    hf, folder, _ = made
    hf = type(hf).from_pretrained(folder, dtype=torch.float64).eval()
    hf.config._experts_implementation = "eager"  # (grouped_mm takes no float64)
    lm = LanguageModel.from_pretrained(folder).double().eval()
    x = ids()
    with torch.no_grad(), _transformers_in_float64(hf):
        assert max_diff(lm(x)[0], hf(x).logits) <= 1e-12


def test_routing_equals_transformers(made):
    """An independent reading of the routing: the experts of mnemo's ``hook_topk_indices`` in each
    sparse layer are the top-k of the softmax of transformers' ``router_logits``, and transformers'
    balance loss is ``k`` times mnemo's ``L_aux`` with the two sparse layers pooled (the import's
    ``c · k / L``)."""
    hf, _, lm = made
    x = ids()
    with torch.no_grad():
        out = hf(x, output_router_logits=True)
        _, cache = lm.run_with_cache(x, ["hook_topk_indices", "hook_router_logits"])
    assert len(out.router_logits) == 2
    loads, probs = [], []
    for i, logits in zip((1, 3), out.router_logits):
        chosen = torch.softmax(logits.float(), -1).topk(K, dim=-1).indices
        assert torch.equal(cache[f"blocks.{i}.mlp.hook_topk_indices"].reshape(-1, K), chosen), i
        loads.append(lm.blocks[i].mlp.last_load)
        probs.append(torch.softmax(cache[f"blocks.{i}.mlp.hook_router_logits"].reshape(-1, E), -1).mean(0))
    pooled = E * (K * torch.stack(loads).mean(0) * torch.stack(probs).mean(0)).sum()
    assert out.aux_loss.item() == pytest.approx(pooled.item(), rel=1e-5)


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token cached decoding (Mamba states and the KV cache) picks
    transformers' greedy tokens (a prompt of 5, 12 new tokens)."""
    hf, _, lm = made
    prompt = ids(length=5, seed=2)
    ref = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 12, temperature=0), ref)


def test_convert_and_export_round_trip(made, tmp_path, capsys):
    """``mnemo convert``, then export: transformers reloads the folder as JambaForCausalLM, with the
    fields that set the function (the attention period written as the smallest that places it),
    the per-expert files ``save_pretrained`` writes, and the source's logits; transformers 5's
    fused experts import to the same mnemo weights as those files."""
    import transformers

    from mnemo.cli import main
    from mnemo.hf.convert import export_hf, load_weights
    from mnemo.hf.jamba import import_jamba

    hf, folder, lm = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert LanguageModel.from_pretrained(tmp_path / "ck").config == lm.config
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    assert back.config.layers_block_type == hf.config.layers_block_type
    assert back.config.layers_num_experts == hf.config.layers_num_experts
    for k in ("num_experts", "num_experts_per_tok", "intermediate_size", "num_key_value_heads", "head_dim",
              "mamba_dt_rank", "mamba_proj_bias", "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        assert getattr(back.config, k, None) == getattr(hf.config, k, None), k
    assert back.config.router_aux_loss_coef == pytest.approx(0.02)
    assert "model.layers.3.feed_forward.experts.2.up_proj.weight" in load_weights(tmp_path / "back")
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL
    cfg = json.loads((folder / "config.json").read_text())
    fused = {k: v.clone() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    config, sd = import_jamba(cfg, fused)
    assert config == lm.config and all(torch.equal(v, lm.state_dict()[k]) for k, v in sd.items())


def test_dense_tied_model(tmp_path):
    """``num_experts`` 1: every MLP dense (mnemo ``swiglu``), attention at layers 0 and 2, no conv
    bias, tied head: transformers' logits, and back out as Jamba with ``num_experts`` 1."""
    import transformers

    from mnemo.hf.convert import export_hf

    hf = hf_model(DENSE, seed=3)
    hf.save_pretrained(tmp_path / "src")
    lm = LanguageModel.from_pretrained(tmp_path / "src").eval()
    c = lm.config
    assert c.layer_mixers() == ["attention", "mamba", "attention"] and c.mlp == "swiglu"
    assert c.tie_embeddings and c.mixer_options["mamba"]["conv_bias"] is False
    assert c.mixer_options["attention"]["head_dim"] == 8
    x = ids()
    with torch.no_grad():
        assert max_diff(lm(x)[0], hf(x).logits) <= ATOL
    export_hf(lm, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (
        back.config.layers_num_experts == [1, 1, 1]
        and back.config.layers_block_type == hf.config.layers_block_type
    )
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL


def test_import_refusals_by_name(made, tmp_path):
    """What mnemo cannot reproduce exactly is refused, the message naming the field and the value."""
    from tests.hf.test_bamba_falcon_mamba_48 import _refused

    _, folder, _ = made
    cases = [
        ({"hidden_act": "gelu"}, r"Jamba conversion: hidden_act 'gelu' is not supported"),
        ({"attn_layer_offset": 4}, r"attn_layer_offset = 4: expected less than attn_layer_period = 4"),
        ({"sliding_window": 8}, r"field 'sliding_window' = 8: expected null"),
        ({"layers_block_type": ["mamba"] * 4}, r"'layers_block_type' = \['mamba'.* contradicts the periods"),
        ({"num_experts_per_tok": 5}, r"'num_experts_per_tok' = 5: expected at most num_experts = 4"),
        ({"num_local_experts": 8}, r"the expert count is given twice, with two values"),
        ({"mamba_proj_bias": "yes"}, r"field 'mamba_proj_bias': expected true or false, got 'yes'"),
        ({"mamba_d_state": 4}, r"'model.layers.0.mamba.A_log' has shape \[64, 8\], .*mamba_d_state = 4"),
        ({"mamba_proj_bias": False}, r"unexpected weights .*mamba.in_proj.bias"),
        ({"head_dim": None}, r"self_attn.q_proj.weight' has shape \[48, 32\], expected \[32, 32\]"),
    ]  # fmt: skip
    for i, (edit, match) in enumerate(cases):
        _refused(folder, edit, match, tmp_path, f"c{i}")


def test_export_refusals_by_name(made):
    """A model Jamba cannot express is refused, naming the option: no attention layer, attention
    that is not periodic, a renormalised router, a shared expert, one expert, experts wider than
    the dense layers, a Mamba without the dt/B/C norms or with another epsilon, RoPE; and the
    Mamba classes do not take Jamba's norms."""
    from mnemo.hf.jamba import export_jamba
    from mnemo.hf.mamba import export_falcon_mamba, export_mamba

    _, _, lm = made
    base = lm.config.to_dict()

    def refused(edit, match):
        cfg = json.loads(json.dumps(base))
        edit(cfg)
        config = ModelConfig.from_dict(cfg)
        with pytest.raises(ValueError, match=rf"^Jamba conversion: .*{match}"):
            export_jamba(config, LanguageModel(config).state_dict())

    def set_(*path_value):
        *path, value = path_value

        def edit(cfg):
            for k in path[:-1]:
                cfg = cfg[k]
            cfg[path[-1]] = value

        return edit

    refused(set_("layers", ["mamba"] * 4), r"without an attention layer")
    refused(
        set_("layers", ["attention", "attention", "mamba", "mamba"]),
        r"attention layers at layers \[0, 1\] of 4",
    )
    refused(
        set_("mlp_only_layers", [0, 1]),
        r"mixture-of-experts layers at layers \[2, 3\] of 4: .* no such period",
    )
    refused(
        set_("mlp_options", "norm_topk_prob", True), r"option norm_topk_prob=True has no Jamba equivalent"
    )
    refused(set_("mlp_options", "shared_expert_hidden", 8), r"option shared_expert_hidden=8 has no Jamba")
    refused(lambda c: c["mlp_options"].update(n_experts=1, top_k=1), r"n_experts=1: .* is a dense MLP")
    refused(
        set_("mlp_options", "expert_hidden", 16), r"expert_hidden=16 differs from the dense layers' width"
    )
    refused(
        set_("mixer_options", "mamba", "bcdt_norm", False), r"mixer_options\['mamba'\] option bcdt_norm=False"
    )
    refused(set_("mixer_options", "mamba", "norm_eps", 1e-6), r"option norm_eps=1e-06 has no Jamba .* 1e-05")
    refused(
        set_("mixer_options", "attention", "rope", True), r"mixer_options\['attention'\] option rope=True"
    )
    plain = dict(vocab_size=VOCAB, d_model=16, n_layers=1, mixer="mamba", mlp="none")
    normed = {"mamba": {"d_state": 4, "bcdt_norm": True}}
    config = ModelConfig(**plain, mixer_options=normed)
    sd = LanguageModel(config).state_dict()
    for export in (export_mamba, export_falcon_mamba):  # refused by the option's name, before the weights
        with pytest.raises(ValueError, match=r"mixer_options\['mamba'\]\['bcdt_norm'\] = True .* Jamba's"):
            export(config, sd)


# --- the mixer option alone ----------------------------------------------------------------------

D_MODEL, EPS = 6, 1e-3


def _mamba(seed: int = 0, **kw):
    from mnemo.layers import Mamba

    torch.manual_seed(seed)
    m = Mamba(D_MODEL, d_state=3, expand=2, dt_rank=2, conv_size=3, bias=True, **kw).double()
    with torch.no_grad():  # off the init, so that every term (the norms' weights too) matters
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _x(T=5, seed=1):
    return torch.randn(1, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_bcdt_norm_by_hand():
    """The layer against a hand-written token loop: ``(dt, B, C) = W_x u`` each RMS-normalised over
    its own channels with ε and multiplied by its norm's weight, ``Δ = softplus(W_dt dt̂ + b)``,
    ``h_t = exp(Δ_t A) h_{t−1} + Δ_t B̂_t u_t``, ``y_t = Ĉ_t·h_t + D u_t``, ``out = W_out (y ⊙
    silu(z))``; the chunk form and the token loop both give it."""
    m = _mamba(bcdt_norm=True, norm_eps=EPS)
    x = _x()
    seen = {}
    m.hook_v.add(lambda v, _: seen.__setitem__("u", v.clone()))
    y_chunk, _ = m(x, mode="chunk")
    y_loop, _ = m(x, mode="recurrent")
    u, z = seen["u"], m.in_proj(x).chunk(2, dim=-1)[1]
    dt, Bm, Cm = m.x_proj(u).split([2, 3, 3], dim=-1)

    def norm(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS) * w

    dt, Bm, Cm = norm(dt, m.dt_norm.weight), norm(Bm, m.b_norm.weight), norm(Cm, m.c_norm.weight)
    delta = F.softplus(dt @ m.dt_proj.weight.T + m.dt_proj.bias)
    A, h, ys = -m.A_log.exp(), torch.zeros(m.d_inner, 3, dtype=torch.float64), []
    for t in range(x.shape[1]):
        h = torch.exp(delta[0, t, :, None] * A) * h + delta[0, t, :, None] * Bm[0, t] * u[0, t, :, None]
        ys.append(h @ Cm[0, t] + m.D * u[0, t])
    ref = m.o_proj(torch.stack(ys)[None] * F.silu(z))
    assert max_diff(y_chunk, ref) <= 1e-12 and max_diff(y_loop, ref) <= 1e-12
    with torch.no_grad():  # the norms' weights matter (unlike FalconMamba's weightless norms)
        m.b_norm.weight.fill_(1.0)
        assert max_diff(m(x)[0], ref) > 1e-3


def test_bcdt_norm_passes_the_mixer_checks_and_is_off_by_default():
    """The generic mixer checks (splits, token steps, state size, hooks, map, gradients into every
    parameter, cached decoding) pass with the norms; without them (the default, or ``False``) the
    layer has a plain Mamba's parameters and computes the same output bit for bit; bad values are
    refused by name."""
    from mnemo.layers import Mamba
    from mnemo.testing.mixers import check_mixer

    for r in check_mixer(
        "mamba", options={"d_state": 4, "chunk_size": 4, "bcdt_norm": True, "norm_eps": EPS}
    ):
        assert r.passed, r
    torch.manual_seed(0)
    plain = Mamba(D_MODEL, d_state=3)
    torch.manual_seed(0)
    off = Mamba(D_MODEL, d_state=3, bcdt_norm=False, norm_eps=0.5)
    assert list(plain.state_dict()) == list(off.state_dict()) and "norm" not in repr(plain)
    x = _x().float()
    assert torch.equal(plain(x)[0], off(x)[0])
    with pytest.raises(ValueError, match=r"bcdt_norm: expected a bool, got 'yes'"):
        Mamba(8, bcdt_norm="yes")
    with pytest.raises(ValueError, match=r"bcdt_norm: expected False with bcdt_rms_eps = 1e-06"):
        Mamba(8, bcdt_norm=True, bcdt_rms_eps=1e-6)
    with pytest.raises(ValueError, match=r"norm_eps: expected a finite number >= 0"):
        Mamba(8, bcdt_norm=True, norm_eps=-1.0)
