"""Qwen3-Next in and out of mnemo: logit parity with a tiny random-weight ``Qwen3NextForCausalLM``
(full pass and cached decoding; dense and sparse-MoE MLPs), the export round trip, and the refusals.

Measured (CPU): float64 max relative error ~1e-15 (full pass and decoding), float32 ~1e-6.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from mnemo.hf.qwen3_next import export_qwen3_next, import_qwen3_next  # noqa: E402
from mnemo.models import ModelConfig  # noqa: E402
from mnemo.models.lm import LanguageModel  # noqa: E402
from tests.helpers import rel_rms  # noqa: E402

if TYPE_CHECKING:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM


def _modeling():
    """transformers' Qwen3-Next modeling module, imported when a test first needs it: importing it
    at the top of this file (it imports fla and torch._inductor) cost each pytest process ~4 s of
    collection. ``transformers.Qwen3NextConfig`` / ``transformers.Qwen3NextForCausalLM`` below are
    read from transformers' lazy module for the same reason."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


VOCAB = 61
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def hf_config(**over) -> Qwen3NextConfig:
    """Every MLP dense (``num_experts = 0``), grouped value heads, K ≠ V, partial rotary, GQA."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_experts=0,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
    )
    kw.update(over)
    return transformers.Qwen3NextConfig(**kw)


#: sparse MoE MLPs in every layer: 5 experts (the router picks among them), shared expert and gate
MOE = dict(
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=12,  # multiples of 4: grouped_mm (float32 default) needs 16-byte strides
    shared_expert_intermediate_size=16,
    mlp_only_layers=[],
    decoder_sparse_step=1,
)


def hf_model(cfg: Qwen3NextConfig, dtype=torch.float64, seed=0) -> Qwen3NextForCausalLM:
    torch.manual_seed(seed)
    m = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # move every weight off its init (zero-centred norms, biases, dt_bias, ...)
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    if dtype == torch.float64:  # transformers' grouped_mm experts take float32/bf16 only: its loop
        m.config._experts_implementation = "eager"
    return m.to(dtype)


def saved(m: Qwen3NextForCausalLM, tmp_path) -> tuple[dict, dict]:
    """The checkpoint as files, read back: ``(config dict, state dict)``."""
    m.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text()), load_file(str(tmp_path / "model.safetensors"))


def mnemo_model(config: ModelConfig, sd: dict, dtype) -> LanguageModel:
    lm = LanguageModel(config).to(dtype)
    lm.load_state_dict(sd, strict=True)
    return lm.eval()


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The larger of the relative RMS error (the project's measure, docs/DESIGN.md §4) and
    ``max |a − b| / max |b|``."""
    return max(rel_rms(a, b), ((a.double() - b.double()).abs().max() / b.double().abs().max()).item())


class _Float64Torch:
    """``torch`` for Qwen3-Next's module, with ``float32`` (and ``float``) meaning float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@pytest.fixture(autouse=True)
def torch_reference_kernels(monkeypatch):
    """transformers' own PyTorch path of Qwen3-Next even where ``fla`` / ``causal-conv1d`` are
    installed (the functions under their kernel-dispatch wrappers)."""
    for name in (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ):
        f = getattr(_modeling(), name)
        monkeypatch.setattr(_modeling(), name, getattr(f, "__wrapped__", f))


@contextlib.contextmanager
def float64_reference(hf: Qwen3NextForCausalLM, *lms: LanguageModel):
    """transformers' Qwen3-Next computes its norms, rotary angles and delta-rule kernels in float32
    even in a float64 model (``.float()``, ``.to(torch.float32)``). For the float64 comparison those
    casts are lifted so both sides compute in float64, and both use the exact float64 rotary
    frequencies (each otherwise rounds its own table to float32, differently by an ulp)."""
    orig_float = torch.Tensor.float
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(_modeling(), "torch", _Float64Torch())
    monkeypatch.setattr(
        torch.Tensor, "float", lambda t, *a, **k: t if t.dtype == torch.float64 else orig_float(t)
    )
    rot = hf.model.rotary_emb
    R = 2 * rot.inv_freq.shape[0]
    theta = hf.config.rope_parameters["rope_theta"]
    exact = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    rot.inv_freq = exact.clone()
    for block in (b for lm in lms for b in lm.blocks):
        if getattr(block.mixer, "rotary", None) is not None:
            block.mixer.rotary.inv_freq = exact.clone()
    try:
        yield
    finally:
        monkeypatch.undo()


def hf_decode(hf, ids: torch.Tensor, prefill: int) -> list[torch.Tensor]:
    """transformers' own cached decoding: the prefill's last logits, then one step per token."""
    out = hf(ids[:, :prefill], use_cache=True)
    cache = out.past_key_values
    logits = [out.logits[:, -1]]
    for t in range(prefill, ids.shape[1]):
        out = hf(ids[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1])
    return logits


def mnemo_decode(lm, ids: torch.Tensor, prefill: int) -> list[torch.Tensor]:
    out, state = lm(ids[:, :prefill])
    logits = [out[:, -1]]
    for t in range(prefill, ids.shape[1]):
        out, state = lm(ids[:, t : t + 1], state)
        logits.append(out[:, -1])
    return logits


def _ids(T=21, B=2, seed=3):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("variant", ["base", "bias_tied_full_rotary", "moe", "moe_top1_unnormalised"])
def test_import_logits_and_cached_decoding(dtype, variant, tmp_path):
    over = {}
    if variant.startswith("moe"):  # every layer a Qwen3NextSparseMoeBlock (router, experts, gated shared)
        over = dict(MOE, norm_topk_prob=variant == "moe", num_experts_per_tok=2 if variant == "moe" else 1)
    elif variant != "base":
        over = dict(
            attention_bias=True,
            tie_word_embeddings=True,
            linear_num_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        )
    hf = hf_model(hf_config(**over), dtype)
    cfg_dict, weights = saved(hf, tmp_path)
    config, sd = import_qwen3_next(cfg_dict, weights)
    config.mixer_options["gated_deltanet"]["chunk_size"] = 8  # mnemo's chunk form really chunks
    lm = mnemo_model(config, sd, dtype)
    ids = _ids()
    ctx = float64_reference(hf, lm) if dtype == torch.float64 else contextlib.nullcontext()
    # float64: the stricter max of relative RMS and max|Δ|/max|ref|; float32: the project's measure
    # (relative RMS, DESIGN.md §4) — one logit of one decoding step can differ by ~1e-5 relative to
    # the largest from rounding alone (1.1e-5 seen on another machine)
    err = max_rel if dtype == torch.float64 else rel_rms
    with ctx, torch.no_grad():
        ref = hf(ids).logits
        got, _ = lm(ids)
        assert err(got, ref) <= TOL[dtype], f"full pass: {err(got, ref):.2e}"
        # a prompt shorter than the conv width, then single-token steps with each side's cache
        for prefill in (2, 9):
            for step, (a, b) in enumerate(zip(mnemo_decode(lm, ids, prefill), hf_decode(hf, ids, prefill))):
                assert err(a, b) <= TOL[dtype], f"prefill {prefill} step {step}: {err(a, b):.2e}"


#: MoE in layers 1 and 3 only (``decoder_sparse_step`` 2), layer 3 also in ``mlp_only_layers``: layers 0,
#: 2 and 3 dense (mnemo's ``mlp_only_layers``)
MIXED = {**MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]}


@pytest.mark.parametrize("mlp", ["dense", "moe", "mixed"])
def test_greedy_generation_matches(mlp):
    hf = hf_model(hf_config(**{"dense": {}, "moe": MOE, "mixed": MIXED}[mlp]), torch.float64)
    config, sd = import_qwen3_next(hf.config.to_dict(), hf.state_dict())  # fused expert tensors
    if mlp == "mixed":
        assert config.mlp == "moe" and config.mlp_only_layers == [0, 2, 3]
    lm = mnemo_model(config, sd, torch.float64)
    if mlp == "mixed":  # the full pass too, and the balance loss: one sparse layer, so transformers'
        ids = _ids()  # c · (its pooled loss) is exactly mnemo's aux_loss_coef · L_aux (c · k / 1)
        with float64_reference(hf, lm), torch.no_grad():
            out = hf(ids, output_router_logits=True)
            assert max_rel(lm(ids)[0], out.logits) <= TOL[torch.float64]
            c = hf.config.router_aux_loss_coef
            assert config.mlp_options["aux_loss_coef"] == pytest.approx(c * MOE["num_experts_per_tok"])
            assert lm.aux_loss().item() == pytest.approx(c * out.aux_loss.item(), rel=1e-9)
    prompt = _ids(T=5, B=1)
    with float64_reference(hf, lm), torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = lm.generate(prompt, 8, temperature=0)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_export_round_trip(dtype, tmp_path):
    hf = hf_model(hf_config(), dtype)
    config, sd = import_qwen3_next(hf.config.to_dict(), hf.state_dict())
    lm = mnemo_model(config, sd, dtype)
    hf_cfg, hf_sd = export_qwen3_next(lm.config, lm.state_dict())
    back = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hf_cfg)).to(dtype).eval()
    back.load_state_dict(hf_sd, strict=True)
    # and through files: transformers writes and reads it, mnemo imports it again
    config2, sd2 = import_qwen3_next(*saved(back, tmp_path))
    assert config2.to_dict() == config.to_dict()
    lm2 = mnemo_model(config2, sd2, dtype)
    ids = _ids()
    ctx = float64_reference(back, lm, lm2) if dtype == torch.float64 else contextlib.nullcontext()
    with ctx, torch.no_grad():
        ref, _ = lm(ids)
        assert max_rel(back(ids).logits, ref) <= TOL[dtype]
        assert max_rel(lm2(ids)[0], ref) <= TOL[dtype]
        for step, (a, b) in enumerate(zip(hf_decode(back, ids, 6), mnemo_decode(lm, ids, 6))):
            assert max_rel(a, b) <= TOL[dtype], f"step {step}"


def test_export_of_a_native_mnemo_model():
    """A model built in mnemo (not imported) with Qwen3-Next's options exports and matches."""
    gdn = dict(n_heads=2, n_v_heads=4, head_dim=8, value_head_dim=4, conv_bias=False, beta_bias=False,
               qk_norm_eps=1e-6, norm_eps=1e-6)  # fmt: skip
    attn = dict(
        n_heads=2, n_kv_heads=1, head_dim=16, rotary_dim=4, qk_norm=True, output_gate=True, norm_eps=1e-6
    )
    config = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, layers=["gated_deltanet", "attention"],
        mixer_options={"gated_deltanet": gdn, "attention": attn}, mlp_hidden=24, norm_eps=1e-6,
        tie_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(1)
    lm = LanguageModel(config).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf_cfg, hf_sd = export_qwen3_next(config, lm.state_dict())
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hf_cfg)).eval()
    hf.load_state_dict(hf_sd, strict=True)
    ids = _ids(T=12)
    with torch.no_grad():
        assert max_rel(lm(ids)[0], hf(ids).logits) <= TOL[torch.float32]


def test_moe_and_unsupported_options_are_refused():
    hf = hf_model(hf_config(), torch.float32)
    sd = hf.state_dict()
    moe = hf_config(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0, 1]).to_dict()  # dense weights
    with pytest.raises(ValueError, match=r"weight 'model\.layers\.2\.mlp\.gate\.weight' is missing"):
        import_qwen3_next(moe, sd)
    dynamic = hf_config().to_dict()  # (transformers' "yarn" imports: test_review2_interop)
    dynamic["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        import_qwen3_next(dynamic, sd)
    gelu = hf_config().to_dict() | {"hidden_act": "gelu"}
    with pytest.raises(ValueError, match="hidden_act"):
        import_qwen3_next(gelu, sd)
    with pytest.raises(ValueError, match="unexpected weights"):
        import_qwen3_next(
            hf.config.to_dict(), sd | {"model.layers.0.linear_attn.conv1d.bias": torch.zeros(40)}
        )
    missing = {k: v for k, v in sd.items() if "A_log" not in k}
    with pytest.raises(ValueError, match="A_log.*missing"):
        import_qwen3_next(hf.config.to_dict(), missing)

    config, msd = import_qwen3_next(hf.config.to_dict(), sd)
    for field, value, match in [
        ("gated_deltanet", {"conv_bias": True}, "conv_bias"),
        ("gated_deltanet", {"allow_neg_eigval": True}, "allow_neg_eigval"),
        ("gated_deltanet", {"qk_norm_eps": None}, "qk_norm_eps"),
        ("attention", {"window": 8}, "window"),
        ("attention", {"output_gate": False}, "output_gate"),
    ]:
        c = ModelConfig.from_dict(config.to_dict())
        c.mixer_options[field].update(value)
        with pytest.raises(ValueError, match=match):
            export_qwen3_next(c, msd)
    c = ModelConfig.from_dict(
        config.to_dict() | {"layers": ["gla", "attention", "gated_deltanet", "attention"]}
    )
    with pytest.raises(ValueError, match="'gla'"):
        export_qwen3_next(c, msd)
    c = ModelConfig.from_dict(config.to_dict() | {"norm_eps": 1e-5})
    with pytest.raises(ValueError, match="norm_eps"):
        export_qwen3_next(c, msd)


def test_moe_import_layouts_and_routing(tmp_path):
    """The per-expert files and the fused in-memory tensors import to the same weights; the imported
    model routes each token to the experts transformers picks."""
    hf = hf_model(hf_config(**MOE), torch.float64)
    config, from_files = import_qwen3_next(*saved(hf, tmp_path))
    _, from_memory = import_qwen3_next(hf.config.to_dict(), hf.state_dict())
    assert config.mlp == "moe" and config.mlp_options["shared_expert_gate"]
    assert from_files.keys() == from_memory.keys()
    assert all(torch.equal(from_files[k], from_memory[k]) for k in from_files)
    lm = mnemo_model(config, from_files, torch.float64)
    ids = _ids(T=9)
    picked = {}
    handles = [
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: picked.__setitem__(i, out[2]))
        for i, layer in enumerate(hf.model.layers)
    ]
    with float64_reference(hf, lm), torch.no_grad():
        hf(ids)
        _, cache = lm.run_with_cache(ids, names="hook_topk_indices")
    for h in handles:
        h.remove()
    for i in range(len(hf.model.layers)):
        ours = cache[f"blocks.{i}.mlp.hook_topk_indices"].reshape(-1, MOE["num_experts_per_tok"])
        assert torch.equal(ours.sort(-1).values, picked[i].sort(-1).values), f"layer {i}"
    assert len(set(torch.cat([v.reshape(-1) for v in picked.values()]).tolist())) == MOE["num_experts"]


ROPE_SCALINGS = [
    {"rope_type": "linear", "factor": 8.0},
    {"rope_type": "ntk", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
]


def _native_config(**attn_over) -> ModelConfig:
    gdn = dict(n_heads=2, n_v_heads=4, head_dim=8, value_head_dim=6, conv_bias=False, beta_bias=False,
               qk_norm_eps=1e-6, norm_eps=1e-6)  # fmt: skip
    attn = dict(
        n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True, output_gate=True, rotary_dim=6, norm_eps=1e-6
    )
    return ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, layers=["gated_deltanet", "attention"],
        mixer_options={"gated_deltanet": gdn, "attention": {**attn, **attn_over}}, mlp_hidden=40,
        norm_eps=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=[s["rope_type"] for s in ROPE_SCALINGS])
def test_export_refuses_rope_scaling(scaling, tmp_path):
    """A scaled RoPE has no exact Qwen3-Next export here: refused by name with the value (the
    review: linear scaling was written as rope_type 'default' and the logits differed by 0.027);
    nothing is written. Plain RoPE spelled out (``{"rope_type": "default"}``) still exports."""
    from mnemo.hf.convert import export_hf

    config = _native_config(rope_scaling=scaling)
    lm = LanguageModel(config).eval()
    with pytest.raises(ValueError) as e:
        export_qwen3_next(config, lm.state_dict())
    assert f"mixer_options['attention']['rope_scaling'] = {scaling!r}" in str(e.value)
    with pytest.raises(ValueError, match=r"mixer_options\['attention'\]\['rope_scaling'\] = \{'rope_type'"):
        export_hf(lm, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    plain = _native_config(rope_scaling={"rope_type": "default"})
    torch.manual_seed(0)
    lm = LanguageModel(plain).eval()
    export_hf(lm, tmp_path / "plain")
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert hf.config.rope_parameters["rope_type"] == "default"
    ids = _ids(T=12)
    with torch.no_grad():
        assert max_rel(lm(ids)[0], hf(ids).logits) <= TOL[torch.float32]


def test_bad_fields_are_named(tmp_path):
    """``attention_bias: "no"`` is refused as a field (it read as true and then as a missing bias
    weight); a head count that contradicts the weights names the fields that set the shape."""
    from mnemo.hf.convert import import_hf

    hf = hf_model(hf_config(), torch.float32)
    cfg, sd = saved(hf, tmp_path / "hf")
    with pytest.raises(ValueError, match="field 'attention_bias': expected true or false, got 'no'"):
        import_qwen3_next({**cfg, "attention_bias": "no"}, sd)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "attention_bias": "no"}))
    with pytest.raises(ValueError, match="field 'attention_bias': expected true or false, got 'no'"):
        import_hf(tmp_path / "hf")
    with pytest.raises(ValueError) as e:
        import_qwen3_next({**cfg, "linear_num_value_heads": 2}, sd)
    assert "'model.layers.0.linear_attn.in_proj_qkvz.weight' has shape [80, 32], expected [56, 32]" in str(
        e.value
    )
    assert (
        "its shape is set by linear_num_key_heads = 2, linear_key_head_dim = 8, linear_num_value_heads = 2, "
        "linear_value_head_dim = 6, hidden_size = 32: the config and the weights disagree"
    ) in str(e.value)
    with pytest.raises(ValueError, match=r"set by num_attention_heads = 4, head_dim = 16, hidden_size = 32"):
        import_qwen3_next({**cfg, "head_dim": 16}, sd)
    without = {k: v for k, v in cfg.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"set by intermediate_size = 5632 \(default\), hidden_size = 32"):
        import_qwen3_next(without, sd)
