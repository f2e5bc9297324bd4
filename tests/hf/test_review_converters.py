"""Review of the checkpoint converters (mnemo/hf/convert.py, qwen3_next.py, mamba.py): each test
failed before its fix. Tiny random-weight models built with ``transformers`` itself."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mnemo.hf.convert import convert, export_hf, import_hf  # noqa: E402
from mnemo.hf.qwen3_next import import_qwen3_next  # noqa: E402
from tests.hf.test_mamba_interop import _hf_model  # noqa: E402
from tests.hf.test_qwen3_next_interop import hf_config, hf_model, saved  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A saved tiny Qwen3-Next checkpoint: ``(folder, config dict, state dict)``."""
    d = tmp_path_factory.mktemp("qwen")
    cfg, sd = saved(hf_model(hf_config(), torch.float32), d)
    return d, cfg, sd


def _with_config(d, cfg):
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_qwen3_next_legacy_rope_scaling_beside_rope_parameters_is_refused(qwen, tmp_path):
    """transformers reads a non-empty legacy ``rope_scaling`` in place of ``rope_parameters``
    (here: linear scaling); the import read only ``rope_parameters`` and accepted the model as plain
    RoPE, whose logits differ. Refused now, naming the field, and nothing is written."""
    d, cfg, sd = qwen
    bad = {**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert transformers.Qwen3NextConfig(**bad).rope_parameters["rope_type"] == "linear"
    with pytest.raises(ValueError, match=r"rope_scaling: rope_type 'linear' is not supported"):
        import_qwen3_next(bad, sd)
    try:
        with pytest.raises(ValueError, match=r"rope_type 'linear'"):
            convert(_with_config(d, bad), tmp_path / "out")
        assert not (tmp_path / "out").exists()
    finally:
        _with_config(d, cfg)
    # a legacy plain rope_scaling is what transformers reads too: accepted, its theta used
    plain = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    plain |= {"rope_scaling": {"type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}}
    config, _ = import_qwen3_next(plain, sd)
    assert config.mixer_options["attention"]["rope_theta"] == 1000.0


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(rope_parameters="default"), "field 'rope_parameters': expected an object"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "'rope_parameters.rope_theta'"),
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": "x"}), "partial_rotary_factor'"),
        (dict(rope_parameters={"rope_theta": -5.0}), "'rope_parameters.rope_theta': expected a positive"),
        (
            dict(rope_parameters={"partial_rotary_factor": 2.0}),
            "partial_rotary_factor': expected a number in",
        ),
        (dict(num_experts=4, decoder_sparse_step=0), "field 'decoder_sparse_step': expected a positive int"),
        (dict(mlp_only_layers=3), "field 'mlp_only_layers': expected a list of layer indices, got 3"),
        (dict(num_experts="0"), "field 'num_experts': expected an int >= 0"),
        (dict(layer_types="full_attention"), "field 'layer_types': expected a list"),
        (dict(initializer_range="x"), "field 'initializer_range': expected a number >= 0, got 'x'"),
    ],
    ids=[
        "rp-str",
        "theta-str",
        "factor-str",
        "theta-neg",
        "factor-2",
        "step-0",
        "only",
        "experts",
        "types",
        "init",
    ],
)
def test_qwen3_next_bad_fields_are_named(qwen, over, message):
    """Each was a raw error (AttributeError, ZeroDivisionError, ``could not convert string to
    float``, "layer_types has 14 entries") or accepted (a negative rope_theta inside
    ``rope_parameters``, refused only later by mnemo's own attention check without the field)."""
    _, cfg, sd = qwen
    with pytest.raises(ValueError) as e:
        import_qwen3_next({**cfg, **over}, sd)
    assert message in str(e.value)
    assert str(e.value).startswith("Qwen3-Next conversion: ")


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_mamba_tied_config_with_a_distinct_head_is_refused(kind, tmp_path):
    """A config saying ``tie_word_embeddings: true`` over a file whose ``lm_head.weight`` differs
    from the embedding: transformers 5 keeps the head apart (it warns and does not tie); the import
    dropped the head and tied it to the embedding, so its logits differed (max |Δ| ≈ 5.8 here)."""
    hf = _hf_model(kind, dict(tie_word_embeddings=False), torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    _with_config(tmp_path / "hf", {**cfg, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="tie_word_embeddings is true but lm_head.weight differs"):
        import_hf(tmp_path / "hf")
    # a truly tied file (both names, equal values, as a .bin writes them) still converts
    hf = _hf_model(kind, dict(tie_word_embeddings=True), torch.float32)
    hf.save_pretrained(tmp_path / "tied")
    config, state, _ = import_hf(tmp_path / "tied")
    assert config.tie_embeddings and state["lm_head.weight"] is state["embed.weight"]


@pytest.mark.parametrize(
    "top, ssm, message",
    [
        (
            {},
            {"norm_before_gate": "false"},
            "field 'ssm_cfg.norm_before_gate': expected true or false, got 'false'",
        ),
        ({}, {"headdim": 4.5}, "field 'ssm_cfg.headdim': expected a positive int, got 4.5"),
        ({}, {"ngroups": "2"}, "field 'ssm_cfg.ngroups': expected a positive int, got '2'"),
        ({"d_model": "16"}, {}, "field 'd_model': expected a positive int, got '16'"),
        ({"tie_embeddings": "false"}, {}, "field 'tie_embeddings': expected true or false, got 'false'"),
        ({"ssm_cfg": "Mamba2"}, None, "field 'ssm_cfg': expected an object of Mamba options, got 'Mamba2'"),
    ],
    ids=["norm-before-gate", "headdim", "ngroups", "d_model", "tie", "ssm_cfg"],
)
def test_mamba_ssm_fields_of_the_wrong_kind_are_named(top, ssm, message, tmp_path):
    """The mamba-ssm layout's fields were read with ``int()`` / truthiness: ``"norm_before_gate":
    "false"`` built a norm-before-gate model (logits off by ~4.6 from the checkpoint's), ``"2"`` and
    ``4.5`` were read as 2 and 4, and a ``ssm_cfg`` that is not an object raised a bare ``dict()``
    error. Each is refused now, naming the field and the received value; nothing is written."""
    from tests.hf.test_mamba_interop import _write_mamba_ssm

    hf = _hf_model("mamba2", dict(n_groups=2, tie_word_embeddings=True), torch.float32)
    ssm_cfg = {"layer": "Mamba2", "d_state": 4, "headdim": 4, "ngroups": 2}
    cfg = _write_mamba_ssm(hf, tmp_path / "ssm", ssm_cfg, tie=True)
    import_hf(tmp_path / "ssm")  # as written: converts
    cfg = {**cfg, **top}
    if ssm is not None:
        cfg["ssm_cfg"] = {**ssm_cfg, **ssm}
    _with_config(tmp_path / "ssm", cfg)
    with pytest.raises(ValueError) as e:
        convert(tmp_path / "ssm", tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_force_never_deletes_a_source_inside_out(tmp_path):
    """``convert(OUT/hf, OUT, force=True)`` (and ``export_hf`` of a checkpoint inside OUT) read the
    source into memory, then replaced OUT whole: the conversion succeeded and the source was gone.
    Refused now, naming OUT and the source; both stay as they were."""
    hf = _hf_model("mamba", {}, torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "out")  # a mnemo checkpoint folder
    before = sorted(p.name for p in out.iterdir())
    (tmp_path / "hf").rename(out / "hf")  # the source kept inside it
    with pytest.raises(ValueError, match=r"OUT: .*out holds the source .*hf; replacing OUT \(--force\)"):
        convert(out / "hf", out, force=True)
    assert (out / "hf" / "config.json").is_file()
    convert(out / "hf", tmp_path / "ckpt")
    (tmp_path / "ckpt").rename(out / "ckpt")
    with pytest.raises(ValueError, match=r"holds the source .*ckpt"):
        export_hf(out / "ckpt", out, force=True)
    assert (out / "ckpt" / "config.json").is_file()
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "hf", "ckpt"])


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    """A binary ``config.json`` raised a bare ``UnicodeDecodeError`` (no file named) from
    ``import_hf`` and from ``is_foreign_checkpoint``."""
    from mnemo.hf.convert import is_foreign_checkpoint

    (tmp_path / "config.json").write_bytes(b'\xff\xfe{"model_type": "mamba"}')
    assert is_foreign_checkpoint(tmp_path) is False
    with pytest.raises(ValueError, match=r"corrupt config .*config\.json: not JSON"):
        import_hf(tmp_path)


def test_qwen3_next_export_of_a_rotary_dim_that_r_over_d_rounds_down():
    """``partial_rotary_factor = R / D`` rounds below ``R / D`` for some sizes (``D = 47, R = 6``:
    ``int(47 · (6 / 47)) = 5``), and the export refused such a model; it now writes the next float
    up, which ``transformers`` reads as ``R`` rotary channels: the logits match."""
    from mnemo.hf.qwen3_next import export_qwen3_next
    from mnemo.models import ModelConfig
    from mnemo.models.lm import LanguageModel
    from tests.hf.test_qwen3_next_interop import VOCAB, _ids, max_rel

    attn = dict(
        n_heads=2, n_kv_heads=1, head_dim=47, rotary_dim=6, qk_norm=True, output_gate=True, norm_eps=1e-6
    )
    config = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=1, layers=["attention"], mixer_options={"attention": attn},
        mlp_hidden=24, norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = LanguageModel(config).eval()
    hf_cfg, hf_sd = export_qwen3_next(config, lm.state_dict())
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hf_cfg)).eval()
    hf.load_state_dict(hf_sd, strict=True)
    assert 2 * hf.model.rotary_emb.inv_freq.shape[0] == 6
    ids = _ids(T=12)
    with torch.no_grad():
        assert max_rel(lm(ids)[0], hf(ids).logits) <= 1e-5
