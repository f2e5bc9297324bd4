"""FalconMamba and Bamba in and out of mnemo: tiny random-weight models built and saved by
``transformers`` itself are converted, and their logits, greedy generations and exports are compared
with ``transformers``' own classes; what mnemo cannot express exactly is refused by name.

* FalconMamba (``FalconMambaForCausalLM``): Mamba-1 with the weightless RMS normalisation of dt, B
  and C (mnemo's ``bcdt_rms_eps``), a non-default ``mixer_rms_eps``, in/out biases, untied head.
* Bamba (``BambaForCausalLM``): 4 layers, attention at layers 1 and 3 (grouped-query, 4 query /
  2 key-value heads, ``head_dim`` 12 ≠ hidden / heads, half of it rotary, q/k/v/o biases), Mamba-2
  elsewhere (4 heads in 2 groups, projection and conv biases), SwiGLU MLPs everywhere, Mamba chunks
  of 8 tokens.

Both run on 21 tokens (odd, more than one Mamba chunk of 8 in Bamba, of the selective scan's 16
in mnemo). Measured (float32, CPU): max |Δlogits| FalconMamba 1.2e-6, Bamba 4.1e-6 (logits up to
~3 / ~4.5; at 200 tokens 9.5e-7 / 6.9e-6); the tests bound it by 2e-5. In float64, with
transformers' float32 casts lifted (:func:`tests.hf.test_mamba_interop.transformers_in_float64`)
and Bamba's rotary frequencies exact on both sides: 1.8e-15 / 6.0e-15, bounded by 1e-12.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mnemo.hf.convert import convert, export_hf, import_hf, load_weights  # noqa: E402
from mnemo.hf.mamba import export_mamba  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T = 61, 21
ATOL = 2e-5  # float32; measured ≤ 4.1e-6 (21 tokens)

FALCON = dict(
    vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
    time_step_rank=3, use_bias=True, mixer_rms_eps=1e-3, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
BAMBA = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_n_groups=2,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_proj_bias=True,
    attention_bias=True, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
#: transformers' classes by name: read from its lazy module when a model is built, so collecting
#: this file does not import their modeling code (FalconMamba's pulls in fla and torch._dynamo, ~5 s)
KINDS = {
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", FALCON),
    "bamba": ("BambaConfig", "BambaForCausalLM", BAMBA),
}


def hf_model(name: str, seed: int = 0, **over):
    """A random-weight ``…ForCausalLM`` (float32) with every weight moved off its init."""
    config_name, model_name, opts = KINDS[name]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(seed)
    m = model_cls(config_cls(**{**opts, **over})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
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
    """The mnemo config says what the checkpoint computes: FalconMamba = ``mamba`` layers with
    ``bcdt_rms_eps = mixer_rms_eps``; Bamba = attention at ``attn_layer_indices`` (half of each head
    rotary, as BambaConfig fixes it), Mamba-2 elsewhere, SwiGLU MLPs in every layer."""
    name, hf, _, lm = made
    c = lm.config
    if name == "falcon_mamba":
        assert c.layer_mixers() == ["mamba", "mamba"] and c.mlp == "none"
        o = c.mixer_options["mamba"]
        assert o["bcdt_rms_eps"] == 1e-3 and o["dt_rank"] == 3 and o["bias"] is True
        assert all(b.mixer.bcdt_rms_eps == 1e-3 for b in lm.blocks)
    else:
        assert c.layer_mixers() == ["mamba2", "attention", "mamba2", "attention"] and c.mlp == "swiglu"
        a, m = c.mixer_options["attention"], c.mixer_options["mamba2"]
        assert (a["n_heads"], a["n_kv_heads"], a["head_dim"], a["rotary_dim"]) == (4, 2, 12, 6)
        assert a["rope_theta"] == 1000.0 and a["bias"] is True
        got = (m["head_dim"], m["n_groups"], m["d_state"], m["norm_eps"], m["bias"], m["chunk_size"])
        assert got == (16, 2, 8, 1e-5, True, 8)
        assert hf.config.rope_parameters["partial_rotary_factor"] == 0.5


def test_logits_equal_transformers(made):
    """Full-pass logits equal transformers' (float32) on 21 tokens; without the part of the
    function that distinguishes the family (FalconMamba's norms; Bamba's partial rotary) they differ."""
    name, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
        assert max_diff(lm(x)[0], ref) <= ATOL
        cfg = copy.deepcopy(lm.config.to_dict())
        if name == "falcon_mamba":
            cfg["mixer_options"]["mamba"]["bcdt_rms_eps"] = None
        else:
            cfg["mixer_options"]["attention"]["rotary_dim"] = None
        other = LanguageModel(ModelConfig.from_dict(cfg)).eval()
        other.load_state_dict(lm.state_dict())
        assert max_diff(other(x)[0], ref) > 1e-3


def test_logits_equal_transformers_in_float64(made):
    """The same in float64 with transformers' float32 casts lifted (its norms, scans and rotary
    angles then compute in float64 too) and Bamba's rotary frequencies computed in float64 on its
    side as mnemo's float64 model does: equal to rounding."""
    from tests.hf.test_mamba_interop import transformers_in_float64

    name, hf, folder, _ = made
    hf = type(hf).from_pretrained(folder, dtype=torch.float64).eval()
    lm = LanguageModel.from_pretrained(folder).double().eval()
    if name == "bamba":
        rot, R = hf.model.rotary_emb, lm.config.mixer_options["attention"]["rotary_dim"]
        rot.inv_freq = 1.0 / hf.config.rope_parameters["rope_theta"] ** (
            torch.arange(0, R, 2, dtype=torch.float64) / R
        )
    x = ids()
    with torch.no_grad(), transformers_in_float64():
        assert max_diff(lm(x)[0], hf(x).logits) <= 1e-12


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token cached decoding picks transformers' greedy tokens (a prompt of 5,
    12 new tokens: past a Mamba chunk)."""
    _, hf, _, lm = made
    prompt = ids(length=5, seed=2)
    ref = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 12, temperature=0), ref)


def test_export_round_trip(made, tmp_path):
    """convert, then export: transformers reloads the folder as the source class, with the fields
    that set the function, and computes the source's logits."""
    name, hf, folder, _ = made
    convert(folder, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    keys = {
        "falcon_mamba": ("mixer_rms_eps", "time_step_rank", "intermediate_size", "use_bias"),
        "bamba": ("attn_layer_indices", "head_dim", "num_key_value_heads", "mamba_n_heads", "mamba_d_head",
                  "mamba_n_groups", "attention_bias", "mamba_proj_bias"),
    }[name] + ("tie_word_embeddings",)  # fmt: skip
    for k in keys:
        assert getattr(back.config, k, None) == getattr(hf.config, k, None), k
    if name == "bamba":
        assert back.config.rope_parameters["partial_rotary_factor"] == 0.5
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) <= ATOL


def test_exports_pick_the_class(tmp_path):
    """A mnemo Mamba with ``bcdt_rms_eps`` goes out as FalconMamba, one without as Mamba (and
    ``export_mamba`` refuses the norm by name); a Mamba-2 + attention stack with SwiGLU MLPs and a
    partial rotary as Bamba, which computes the same logits; a Mamba-2 stack without MLPs stays
    Mamba-2."""
    x = ids()
    for i, (opts, arch) in enumerate(
        [({"bcdt_rms_eps": 1e-5}, "FalconMambaForCausalLM"), ({}, "MambaForCausalLM")]
    ):
        cfg = ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, mixer="mamba", mlp="none",
                          mixer_options={"mamba": {"d_state": 4, **opts}})  # fmt: skip
        torch.manual_seed(0)
        lm = LanguageModel(cfg).eval()
        export_hf(lm, tmp_path / str(i))
        assert json.loads((tmp_path / str(i) / "config.json").read_text())["architectures"] == [arch]
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(i)).eval()
        with torch.no_grad():
            assert max_diff(back(x).logits, lm(x)[0]) <= ATOL
        if opts:
            with pytest.raises(ValueError, match=r"export to MambaForCausalLM: bcdt_rms_eps = 1e-05"):
                export_mamba(cfg, lm.state_dict())
    hybrid = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=3, layers=["attention", "mamba2", "mamba2"], mlp_hidden=24,
        mixer_options={"attention": {"n_heads": 4, "n_kv_heads": 2, "rotary_dim": 4},
                       "mamba2": {"d_state": 4, "head_dim": 16, "n_groups": 2, "chunk_size": 8}},
    )  # fmt: skip
    torch.manual_seed(0)
    lm = LanguageModel(hybrid).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    export_hf(lm, tmp_path / "hybrid")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid").eval()
    assert type(back).__name__ == "BambaForCausalLM" and back.config.attn_layer_indices == [0]
    with torch.no_grad():
        assert max_diff(back(x).logits, lm(x)[0]) <= ATOL
    m2 = ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=1, mixer="mamba2", mlp="none",
                     mixer_options={"mamba2": {"d_state": 4, "head_dim": 8}})  # fmt: skip
    export_hf(LanguageModel(m2), tmp_path / "m2")
    assert json.loads((tmp_path / "m2" / "config.json").read_text())["architectures"] == ["Mamba2ForCausalLM"]
    # with MLPs only Bamba could express it, but transformers' Bamba cannot run without attention
    with pytest.raises(ValueError, match=r"BambaForCausalLM: .*without an attention layer"):
        export_hf(LanguageModel(ModelConfig.from_dict({**m2.to_dict(), "mlp": "swiglu"})), tmp_path / "m2s")
    # Qwen2's biases (q, k, v; no o) have no Bamba field: refused by name, not exported with o biased
    from mnemo.hf.bamba import export_bamba

    qkv = ModelConfig.from_dict(hybrid.to_dict())
    qkv.mixer_options["attention"]["bias"] = "qkv"
    with pytest.raises(ValueError, match=r"\['bias'\] = 'qkv' .* no Bamba equivalent"):
        export_bamba(qkv, LanguageModel(qkv).state_dict())


def test_bamba_rotary_share_as_transformers_reads_it(tmp_path):
    """``rope_parameters['partial_rotary_factor']`` sets the rotary share (1.0: the whole head); a
    top-level ``partial_rotary_factor`` is ignored by BambaConfig (it forces 0.5), and so by the
    import; both give transformers' logits."""
    x = ids()
    hf = hf_model(
        "bamba", rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0}
    )
    hf.save_pretrained(tmp_path / "full")
    lm = LanguageModel.from_pretrained(tmp_path / "full").eval()
    assert "rotary_dim" not in lm.config.mixer_options["attention"]
    with torch.no_grad():
        assert max_diff(lm(x)[0], hf(x).logits) <= ATOL
    hf = hf_model("bamba")
    hf.save_pretrained(tmp_path / "top")
    cfg = json.loads((tmp_path / "top" / "config.json").read_text())
    cfg["rope_parameters"].pop("partial_rotary_factor", None)
    (tmp_path / "top" / "config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 1.0}))
    reread = transformers.BambaForCausalLM.from_pretrained(tmp_path / "top").eval()
    lm = LanguageModel.from_pretrained(tmp_path / "top").eval()
    assert lm.config.mixer_options["attention"]["rotary_dim"] == 6
    with torch.no_grad():
        assert max_diff(lm(x)[0], reread(x).logits) <= ATOL


def _refused(folder, edit: dict, match: str, tmp_path, tag: str) -> None:
    """The saved ``folder`` with the config fields ``edit`` changed is refused with ``match``."""
    out = tmp_path / tag
    out.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **edit}))
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        import_hf(out)


def test_refusals_by_name(made, tmp_path):
    """What mnemo cannot reproduce exactly is refused, the message naming the field and the value."""
    name, _, folder, _ = made
    cases = [({"hidden_act": "gelu"}, r"hidden_act 'gelu'|hidden_act = 'gelu'")]
    if name == "falcon_mamba":
        eps = r"field 'mixer_rms_eps': expected a finite number >= 0, got "
        cases += [
            ({"mixer_rms_eps": "small"}, eps + "'small'"),
            ({"mixer_rms_eps": -1.0}, eps + "-1.0"),
            ({"state_size": 8}, r"weight backbone.layers.0.mixer.\S+ has shape .*state_size = 8"),
        ]
    else:
        heads = r"mamba_n_heads · mamba_d_head = 4 · 5 ≠ mamba_expand · hidden_size = 64"
        cases += [
            ({"mlp_bias": True}, r"Bamba conversion: mlp_bias true is not supported"),
            ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e3, "factor": 2.0}},
             r"rope_type 'linear' is not supported \(only 'default'"),
            ({"attn_layer_indices": [1, 7]}, r"field 'attn_layer_indices': expected .*got \[1, 7\]"),
            ({"mamba_n_groups": 3}, r"mamba_n_groups = 3 does not divide mamba_n_heads = 4"),
            ({"mamba_d_head": 5}, heads),
            ({"attn_rotary_emb": 12}, r"field 'attn_rotary_emb' = 12 .* contradicts the 6 rotary channels"),
            ({"mamba_proj_bias": "yes"}, r"field 'mamba_proj_bias': expected true or false, got 'yes'"),
            ({"mamba_d_state": 4}, r"weight 'model.layers.0.mamba.in_proj.weight' .*mamba_d_state = 4"),
            ({"attention_bias": False}, r"unexpected weights .*self_attn.k_proj.bias"),
        ]  # fmt: skip
    for i, (edit, match) in enumerate(cases):
        _refused(folder, edit, match, tmp_path, f"c{i}")


def test_a_missing_weight_is_named(made, tmp_path):
    """A file without one weight is refused, naming it (Bamba by its name in the file, FalconMamba,
    as Mamba, by the mnemo name it would load into)."""
    from safetensors.torch import save_file

    name, _, folder, _ = made
    weights = load_weights(folder)
    if name == "bamba":
        gone, said = (
            "model.layers.1.self_attn.o_proj.weight",
            r"weight 'model\.layers\.1\.self_attn\.o_proj\.weight' is missing",
        )
    else:
        gone, said = "backbone.layers.1.mixer.dt_proj.bias", r"missing \['blocks\.1\.mixer\.dt_proj\.bias'\]"
    del weights[gone]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=said):
        import_hf(tmp_path)


def test_convert_command(made, tmp_path, capsys):
    """``mnemo convert`` once per family: the written checkpoint loads and computes the logits."""
    from mnemo.cli import main

    _, hf, folder, _ = made
    assert main(["convert", str(folder), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    lm = LanguageModel.from_pretrained(tmp_path / "ck").eval()
    x = ids()
    with torch.no_grad():
        assert max_diff(lm(x)[0], hf(x).logits) <= ATOL
