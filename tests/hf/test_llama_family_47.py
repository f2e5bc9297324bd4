"""The dense Llama family (Llama, Qwen2, Qwen3, Mistral) in and out of mnemo: tiny random-weight
models built and saved by ``transformers`` itself are converted, and their logits, greedy
generations and exports are compared with ``transformers``' own classes; what mnemo cannot express
exactly is refused by name.

Each format runs with grouped-query heads (4 query, 2 key/value) and ``head_dim`` 12 ≠
hidden/heads = 8, on 12 tokens: past the window of 5 where the format has one (Qwen2, Mistral),
with each RoPE kind that maps exactly (Llama 3.1's on Llama, linear on Qwen2, YaRN on Mistral,
plain on Qwen3). Measured (float32, CPU): max |Δlogits| ≤ 1e-6 (logits of size ~1–10); the tests
bound it by 2e-5.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from mnemo.hf.convert import convert, export_hf  # noqa: E402
from mnemo.hf.llama import import_llama, import_mistral, import_qwen2, import_qwen3  # noqa: E402
from mnemo.layers.rotary import RotaryEmbedding, llama3_inv_freq  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

VOCAB, T, WINDOW = 53, 12, 5
ATOL = 2e-5  # float32; measured ≤ 1e-6
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)  # fmt: skip

#: name -> (config class, model class, options beyond SMALL); the classes by name, read from
#: transformers' lazy module when a model is built, so collecting this file (and the files that
#: import from it) does not import their modeling code (~5 s a pytest process)
FORMATS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
             rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(sliding_window=WINDOW, max_position_embeddings=32, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000.0, "factor": 2.0, "original_max_position_embeddings": 16,
        }),
    ),
}  # fmt: skip


def hf_model(name: str, seed: int = 0, eager: bool = False, **over):
    """A random-weight ``…ForCausalLM`` (float32), every weight moved off its init (norms, biases);
    transformers' default attention (SDPA), or its ``eager`` one, which returns the probabilities."""
    config_name, model_name, opts = FORMATS[name]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(seed)
    m = model_cls(config_cls(**{**SMALL, **opts, **over})).eval()
    if eager:
        m.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(FORMATS))
def made(request, tmp_path_factory):
    """``(name, transformers model, its saved folder, mnemo model read from the folder)``."""
    name = request.param
    hf = hf_model(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, folder, LanguageModel.from_pretrained(folder).eval()


def test_logits_equal_transformers(made):
    """Full-pass logits equal transformers' (float32) on 12 tokens, past the window where there is
    one; the converted model has the format's window, heads and head size, so the comparison
    covers them (without the window the logits differ: the window is reached)."""
    name, hf, _, lm = made
    x = ids()
    with torch.no_grad():
        ours, ref = lm(x)[0], hf(x).logits
    assert (ours - ref).abs().max().item() <= ATOL
    opts = lm.config.mixer_options["attention"]
    assert (opts["n_heads"], opts["n_kv_heads"], opts["head_dim"]) == (4, 2, 12)
    assert opts["window"] == (WINDOW if name in ("qwen2", "mistral") else None)
    assert opts["qk_norm"] == (name == "qwen3") and lm.config.tie_embeddings == (name == "qwen3")
    if opts["window"] is not None:
        full = LanguageModel(
            ModelConfig.from_dict(
                {**lm.config.to_dict(), "mixer_options": {"attention": {**opts, "window": None}}}
            )
        ).eval()
        full.load_state_dict(lm.state_dict())
        with torch.no_grad():
            assert (full(x)[0] - ref).abs().max().item() > 1e-3


def test_greedy_generation_equals_transformers(made):
    """mnemo's prefill + one-token KV-cache decoding picks transformers' greedy tokens, for a
    prompt of 4 and 10 new tokens (past the window of 5 where there is one)."""
    _, hf, _, lm = made
    prompt = ids(length=4, seed=2)
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 10, temperature=0), ref)


def test_export_round_trip(made, tmp_path):
    """``mnemo convert`` then ``mnemo export --format hf``: transformers reloads the folder as the
    source class, with the same config fields that matter and the same logits."""
    name, hf, folder, _ = made
    convert(folder, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    for k in ("num_key_value_heads", "head_dim", "tie_word_embeddings", "sliding_window"):
        assert getattr(back.config, k, None) == getattr(hf.config, k, None), k
    assert back.config.rope_parameters["rope_type"] == hf.config.rope_parameters["rope_type"]
    x = ids()
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() <= ATOL


#: mnemo attention options -> the class an export of mnemo's own model picks
PICKS = [
    ({}, "LlamaForCausalLM"),  # the `transformer` preset's options
    ({"bias": True}, "LlamaForCausalLM"),  # attention_bias: q, k, v and o
    ({"window": WINDOW}, "MistralForCausalLM"),
    ({"qk_norm": True, "window": WINDOW}, "Qwen3ForCausalLM"),
    ({"bias": True, "window": WINDOW}, "Qwen2ForCausalLM"),  # (with a zero o bias)
]


def test_export_picks_the_class(tmp_path):
    """mnemo's own attention stacks export as the first class that expresses them (the
    ``transformer`` preset as ``LlamaForCausalLM``), which computes the same logits; a converted
    Mistral without a window goes back as Mistral, although Llama could express it too; a gated
    attention stack still goes to Qwen3-Next; attention sinks are refused by every candidate, each
    naming what it cannot express."""
    x = ids()
    for i, (opts, arch) in enumerate(PICKS):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, mixer="attention",
                          mixer_options={"attention": {"n_heads": 4, "n_kv_heads": 2, **opts}})  # fmt: skip
        lm = LanguageModel(cfg).eval()
        with torch.no_grad():
            for name, p in lm.named_parameters():
                p.add_(0.2 * torch.randn_like(p))
                if arch.startswith("Qwen2") and name.endswith("o_proj.bias"):
                    p.zero_()
        out = tmp_path / f"{i}-{arch}"
        export_hf(lm, out)
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(back).__name__ == arch
        with torch.no_grad():
            assert (back(x).logits - lm(x)[0]).abs().max().item() <= ATOL
    hf = hf_model("mistral", sliding_window=None)
    hf.save_pretrained(tmp_path / "mistral")
    convert(tmp_path / "mistral", tmp_path / "mistral-ck")
    export_hf(tmp_path / "mistral-ck", tmp_path / "mistral-back")
    assert json.loads((tmp_path / "mistral-back" / "config.json").read_text())["architectures"] == [
        "MistralForCausalLM"
    ]
    gated = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, mixer="attention", norm_eps=1e-6,
                        mixer_options={"attention": {"n_heads": 4, "qk_norm": True, "output_gate": True,
                                                     "norm_eps": 1e-6}})  # fmt: skip
    export_hf(LanguageModel(gated), tmp_path / "gated")
    assert json.loads((tmp_path / "gated" / "config.json").read_text())["architectures"] == [
        "Qwen3NextForCausalLM"
    ]
    sinks = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, mixer="attention",
                        mixer_options={"attention": {"n_heads": 4, "window": 8, "n_sink": 2}})  # fmt: skip
    with pytest.raises(
        ValueError, match=r"exports as none of LlamaForCausalLM.*n_sink=2 has no Mistral"
    ) as e:
        export_hf(LanguageModel(sinks), tmp_path / "sinks")
    assert "Qwen3NextForCausalLM: Qwen3-Next conversion" in str(e.value)
    assert not (tmp_path / "sinks").exists()


def test_llama3_frequencies_equal_transformers():
    """Llama 3.1's RoPE frequencies equal transformers' ``_compute_llama3_parameters`` (float32 there,
    float64 here), with frequencies in all three bands: kept, divided by the factor, in between."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, rope_parameters=rope)
    ref = _compute_llama3_parameters(cfg)[0].double()
    ours = RotaryEmbedding(32, 10000.0, scaling={k: v for k, v in rope.items() if k != "rope_theta"}).inv_freq
    assert torch.allclose(ours.double(), ref, rtol=2e-6, atol=0)
    plain = 10000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    assert torch.allclose(llama3_inv_freq(10000.0, 32, 8.0, 1.0, 4.0, 64), ours.double(), rtol=1e-6)
    kept, divided = torch.isclose(ref, plain, rtol=2e-6), torch.isclose(ref, plain / 8, rtol=2e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def _saved(name: str, tmp_path, **over) -> tuple[dict, dict]:
    hf_model(name, **over).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text()), load_file(str(tmp_path / "model.safetensors"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Per format, the checkpoint as files, read back: ``(config dict, state dict)``."""
    return {name: _saved(name, tmp_path_factory.mktemp(f"files-{name}")) for name in FORMATS}


def test_fields_left_out_or_legacy_are_read_as_transformers_reads_them(files):
    """A ``config.json`` leaves out the fields equal to its class's defaults, and older ones keep
    ``rope_theta`` / ``rope_scaling`` at the top level: mnemo reads what ``transformers`` reads —
    Mistral's default window 4096, Qwen3's default ``head_dim`` 128 (named in the shape error), a
    Llama 3.1-style legacy ``rope_scaling`` as the same ``llama3`` scaling."""
    m, m_sd = files["mistral"]
    left_out = {k: v for k, v in m.items() if k != "sliding_window"}
    assert transformers.MistralConfig(**left_out).sliding_window == 4096
    assert import_mistral(left_out, m_sd)[0].mixer_options["attention"]["window"] == 4096
    q3, q3_sd = files["qwen3"]
    left_out = {k: v for k, v in q3.items() if k != "head_dim"}
    assert transformers.Qwen3Config(**left_out).head_dim == 128
    with pytest.raises(ValueError, match=r"q_proj.weight' has shape \[48, 32\], expected \[512, 32\] .*"
                       r"head_dim = 128 \(default\)"):  # fmt: skip
        import_qwen3(left_out, q3_sd)
    cfg, sd = files["llama"]
    rope = cfg["rope_parameters"]
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "llama3"}
        | {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")},
    }
    read = transformers.LlamaConfig(**legacy).rope_parameters
    assert {k: v for k, v in read.items() if k != "type"} == rope
    assert import_llama(legacy, sd)[0] == import_llama(cfg, sd)[0]


def test_refusals_are_named(files, tmp_path):
    """What mnemo cannot express exactly is refused naming the field or weight: another
    activation, ``dynamic`` RoPE, Qwen2 with sliding and full layers, Llama's ``mlp_bias``, a
    missing, mis-shaped or unexpected weight; through ``convert`` nothing is written."""
    cfg, sd = files["llama"]
    with pytest.raises(
        ValueError, match=r"Llama conversion: hidden_act 'gelu_pytorch_tanh' is not supported"
    ):
        import_llama({**cfg, "hidden_act": "gelu_pytorch_tanh"}, sd)
    dynamic = {**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}}
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' is not supported .*: it recomputes"):
        import_llama(dynamic, sd)
    with pytest.raises(ValueError, match=r"mlp_bias true is not supported"):
        import_llama({**cfg, "mlp_bias": True}, sd)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"weight 'model.layers.1.self_attn.k_proj.weight' is missing"):
        import_llama(cfg, missing)
    with pytest.raises(ValueError, match=r"unexpected weights .*\['model.layers.0.mlp.up_proj.bias'\]"):
        import_llama(cfg, {**sd, "model.layers.0.mlp.up_proj.bias": torch.zeros(40)})
    with pytest.raises(ValueError, match=r"gate_proj.weight' has shape \[40, 32\], expected \[48, 32\].*"
                       r"intermediate_size = 48"):  # fmt: skip
        import_llama({**cfg, "intermediate_size": 48}, sd)
    mixed_cfg, mixed_sd = _saved("qwen2", tmp_path / "qwen2", max_window_layers=1)
    assert transformers.Qwen2Config(**mixed_cfg).layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"Qwen2 conversion: layers \[1\] use sliding-window attention"):
        import_qwen2(mixed_cfg, mixed_sd)
    with pytest.raises(ValueError, match=r"layers \[1\] use sliding-window"):
        convert(tmp_path / "qwen2", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # all full (the window starts past the last layer): accepted, no window
    full_cfg = {**mixed_cfg, "max_window_layers": 2, "layer_types": None}
    assert import_qwen2(full_cfg, mixed_sd)[0].mixer_options["attention"]["window"] is None
    q3, q3_sd = files["qwen3"]
    with pytest.raises(
        ValueError, match=r"Qwen3 conversion: weight 'model.layers.0.self_attn.q_norm.weight'"
    ):
        import_qwen3(q3, {k: v for k, v in q3_sd.items() if "layers.0.self_attn.q_norm" not in k})
    m, m_sd = files["mistral"]
    with pytest.raises(
        ValueError, match=r"Mistral conversion: field 'sliding_window': expected a positive int"
    ):
        import_mistral({**m, "sliding_window": 0}, m_sd)


def test_sharded_checkpoint(tmp_path):
    """A checkpoint saved in shards (``model.safetensors.index.json``) reads as the single file."""
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    lm = LanguageModel.from_pretrained(tmp_path).eval()
    x = ids()
    with torch.no_grad():
        assert (lm(x)[0] - hf(x).logits).abs().max().item() <= ATOL


def test_probe_circuits_reads_a_converted_llama(tmp_path, capsys):
    """``mnemo probe circuits`` on a converted Llama: its induction score of every head equals the
    score computed from transformers' own attention probabilities on the same repeated tokens."""
    from mnemo.cli import main
    from mnemo.interp.scores import repeated_random_tokens

    hf = hf_model("llama", eager=True)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ck")
    L = 6
    argv = ["probe", "circuits", "--checkpoint", str(tmp_path / "ck"), "--length", str(L), "--batch", "2",
            "--out", str(tmp_path / "circ")]  # fmt: skip
    assert main(argv) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[0])["layers"]
    x = repeated_random_tokens(2, L, VOCAB, torch.Generator().manual_seed(0))
    with torch.no_grad():
        attentions = hf(x, output_attentions=True).attentions
    i = torch.arange(L, 2 * L)
    for layer, probs in enumerate(attentions):  # [B, H, 2L, 2L]
        expected = probs[:, :, i, i - L + 1].mean((0, 2))
        got = torch.tensor(scores[str(layer)]["induction"])
        assert torch.allclose(got, expected, atol=1e-5), (layer, got, expected)
        previous = torch.diagonal(probs, offset=-1, dim1=-2, dim2=-1).mean((0, 2))
        assert torch.allclose(torch.tensor(scores[str(layer)]["previous_token"]), previous, atol=1e-5)
