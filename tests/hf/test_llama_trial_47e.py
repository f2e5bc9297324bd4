"""What a new user's trial of the Llama-family import and export found (helper 47d), fixed: older
checkpoints' saved rotary buffers, the BOS of ``probe circuits`` / ``probe ablate`` on a converted
checkpoint, the dtype on disk both ways, a tied export's duplicate head, the carried
``max_position_embeddings``, which class an export wrote (and why Qwen2 refuses a trained o bias),
the fields a RoPE refusal names, a tied config over an untied file, the rotary frequencies'
float32 rounding at long positions, quantized checkpoints, and induction heads out of a window.

Tiny random-weight models built and saved by ``transformers`` itself, as in
``test_llama_family_47.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from mnemo.cli import main  # noqa: E402
from mnemo.hf.convert import CARRIED_CONFIG_NAME, convert, export_hf, import_hf  # noqa: E402
from mnemo.hf.llama import import_llama  # noqa: E402
from mnemo.models import LanguageModel  # noqa: E402
from tests.hf.test_llama_family_47 import SMALL, VOCAB  # noqa: E402  (the same tiny models)

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

#: name -> (config class, model class) by name, read from transformers' lazy module when a model is
#: built: collecting this file (and test_interop_48c.py, which imports from it) then does not import
#: their modeling code
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def hf_model(name: str, seed: int = 0, **over):
    """A random-weight ``…ForCausalLM`` (float32), every weight moved off its init."""
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[name])
    torch.manual_seed(seed)
    m = model_cls(config_cls(**{**SMALL, **over})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def ids(length: int = 12, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def saved(name: str, folder, dtype=None, **over):
    """``(model, config dict, state dict)`` of a model saved to ``folder`` (in ``dtype`` when given)."""
    m = hf_model(name, **over)
    (m.to(dtype) if dtype is not None else m).save_pretrained(folder)
    m.float()
    return m, json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


# 1. transformers 4.28-4.31 saved each layer's rotary frequencies -------------------------------


def test_old_rotary_inv_freq_buffers_are_dropped_when_they_agree_and_refused_when_not(tmp_path):
    """transformers 4.28–4.31 wrote ``model.layers.N.self_attn.rotary_emb.inv_freq`` (``1 / θ^{2i/D}``,
    ``[D/2]``) into Llama checkpoints, and its loaders ignore them; the import refused them as
    unexpected weights. They are derived from ``rope_theta`` and ``head_dim``: dropped when they
    agree (also rounded to bfloat16, as a ``.half()`` / bf16 checkpoint holds them), refused by name
    when they describe another base (the config would not describe the checkpoint)."""
    hf, cfg, sd = saved("llama", tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    inv = hf.model.rotary_emb.inv_freq  # [6]
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits
    for buffer in (inv, inv.to(torch.bfloat16)):
        old = {**sd, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": buffer.clone() for i in range(2)}}
        config, state = import_llama(cfg, old)
        assert not any("inv_freq" in k for k in state)
        lm = LanguageModel(config).eval()
        lm.load_state_dict(state, strict=True)
        with torch.no_grad():
            assert max_diff(lm(x)[0], ref) <= 2e-5
    # transformers reads such a file as the same model (it ignores the buffers)
    old = {**sd, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv.clone() for i in range(2)}}
    save_file(old, str(tmp_path / "model.safetensors"), {"format": "pt"})
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert max_diff(back(x).logits, ref) == 0.0
    assert max_diff(LanguageModel.from_pretrained(tmp_path).eval()(x)[0].detach(), ref) <= 2e-5
    # frequencies of another base: the config's rope_theta is not the one the model was saved with
    other = 1.0 / 10000.0 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12)
    bad = {**sd, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": other for i in range(2)}}
    with pytest.raises(ValueError, match=r"rotary_emb.inv_freq.*disagrees with those of rope_theta = 500"):
        import_llama(cfg, bad)
    with pytest.raises(ValueError, match=r"shape \[12\].*expected a float tensor of shape \[6\]"):
        import_llama(cfg, {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(12)})


# 2. the BOS of probe circuits / probe ablate on a converted checkpoint ---------------------------


def _bos_tokenizer(folder, bos: int = 1) -> None:
    """A word-level ``tokenizer.json`` (``w0`` … of the model's vocabulary, ``<s>`` = ``bos``) whose
    post-processor puts ``<s>`` before a text, as Llama's and Mistral's do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {f"w{i}": i for i in range(VOCAB) if i != bos} | {"<s>": bos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(folder / "tokenizer.json"))


def test_probe_circuits_and_ablate_put_the_tokenizers_bos_first_on_a_converted_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """``mnemo generate`` and ``mnemo eval`` start a converted checkpoint's text with the BOS its
    tokenizer's post-processor puts first (``checkpoint_bos``); ``probe circuits`` and ``probe
    ablate`` read only a training run's ``TrainConfig.bos`` and scored the heads on sequences the
    model never saw without it. Now they put it first (position 0 left out of every score, as for a
    run's BOS) and record it in their JSON; a mnemo training run trained without a BOS still gets
    none, whatever its tokenizer's post-processor says."""
    import mnemo.interp.probe as probe_module
    from mnemo.data import load_tokenizer
    from mnemo.hf.special_ids import checkpoint_bos
    from mnemo.interp import circuit_scores

    hf_model("llama").save_pretrained(tmp_path / "hf")
    _bos_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ck")
    ck = tmp_path / "ck"
    assert checkpoint_bos(ck, load_tokenizer(ck)) == 1  # what generate and eval put first
    seen = []
    capture = probe_module.capture_maps
    monkeypatch.setattr(probe_module, "capture_maps", lambda m, x: seen.append(x) or capture(m, x))
    argv = ["probe", "circuits", "--checkpoint", str(ck), "--length", "6", "--batch", "2"]
    assert main([*argv, "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr()
    assert "the tokenizer's BOS (id 1) before each sequence" in out.err
    record = json.loads((tmp_path / "p" / "circuits.json").read_text())
    assert record["bos"] == 1 and json.loads(out.out.strip().splitlines()[-1])["bos"] == 1
    assert (seen[0][:, 0] == 1).all() and (seen[0][:, 1:] != 1).all()
    model = LanguageModel.from_pretrained(ck).eval()
    want = json.loads(json.dumps(circuit_scores(model, 6, 2, 0, bos=1)))
    assert record["layers"] == want
    assert want != json.loads(json.dumps(circuit_scores(model, 6, 2, 0)))  # without it: other scores
    argv = ["probe", "ablate", "--checkpoint", str(ck), "--top-induction", "1", "--draws", "1"]
    assert main([*argv, "--length", "4", "--batch", "1", "--out", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["bos"] == 1
    capsys.readouterr()
    # a mnemo training run (its train_config.json) that trained without a BOS: none, as before
    from mnemo.commands.probe import _run_bos_id

    (ck / "train_config.json").write_text(json.dumps({"bos": None}))
    assert _run_bos_id(ck, model) is None and capsys.readouterr().err == ""


# 3. dtype on disk ------------------------------------------------------------------------------


def test_a_bfloat16_source_is_stored_in_float32_said_and_exported_back_in_bfloat16(tmp_path, capsys):
    """A bf16-saved checkpoint converted to a float32 ``model.safetensors`` silently (twice the size),
    and ``mnemo export`` wrote float32 with ``"dtype": "float32"``. The converted checkpoint stays
    float32 (what mnemo computes, what ``from_pretrained`` of the source folder gives too), and
    ``convert`` says so with the source dtype and the size; the source dtype is carried, so the
    export writes bf16 again — the source's own values (float32 holds every bf16 exactly) — unless
    ``--dtype`` says otherwise."""
    hf, _, sd = saved("llama", tmp_path / "hf", dtype=torch.bfloat16)
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    size = (tmp_path / "ck" / "model.safetensors").stat().st_size / 1e6
    assert f"weights stored as float32 (source bfloat16): {size:.3g} MB" in capsys.readouterr().out
    assert {v.dtype for v in load_file(str(tmp_path / "ck" / "model.safetensors")).values()} == {
        torch.float32
    }
    carried = json.loads((tmp_path / "ck" / CARRIED_CONFIG_NAME).read_text())["fields"]
    assert carried["dtype"] == "bfloat16"
    assert next(LanguageModel.from_pretrained(tmp_path / "ck").parameters()).dtype == torch.float32
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "ex")]) == 0
    said = capsys.readouterr().out
    assert "exported as LlamaForCausalLM, weights stored as bfloat16" in said
    back = load_file(str(tmp_path / "ex" / "model.safetensors"))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)  # the source's values
    assert json.loads((tmp_path / "ex" / "config.json").read_text())["dtype"] == "bfloat16"
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "ex32"), "--dtype", "float32"]) == 0
    assert "weights stored as float32" in capsys.readouterr().out
    assert {v.dtype for v in load_file(str(tmp_path / "ex32" / "model.safetensors")).values()} == {
        torch.float32
    }
    assert json.loads((tmp_path / "ex32" / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match="dtype: expected one of"):
        export_hf(tmp_path / "ck", tmp_path / "bad", dtype="int8")


# 4. a tied export writes no duplicate head -------------------------------------------------------


def test_a_tied_export_has_no_lm_head_and_reloads_with_equal_logits(tmp_path):
    """``save_pretrained`` of a tied model writes the embedding alone; ``export_head`` wrote the
    shared tensor a second time as ``lm_head.weight``. Left out now: transformers ties the head on
    load (equal logits), and mnemo reads the export back tied."""
    hf, _, sd = saved("qwen3", tmp_path / "hf", tie_word_embeddings=True)
    assert "lm_head.weight" not in sd  # transformers' own file
    convert(tmp_path / "hf", tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "ex")
    assert set(load_file(str(tmp_path / "ex" / "model.safetensors"))) == set(sd)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ex").eval()
    assert back.lm_head.weight is back.model.embed_tokens.weight
    x = ids()
    with torch.no_grad():
        assert max_diff(back(x).logits, hf(x).logits) == 0.0
        lm = LanguageModel.from_pretrained(tmp_path / "ex").eval()
        assert lm.config.tie_embeddings and max_diff(lm(x)[0], hf(x).logits) <= 2e-5


# 5. max_position_embeddings carried --------------------------------------------------------------


def test_max_position_embeddings_is_carried_and_derived_only_for_yarn(tmp_path):
    """convert → export lost ``max_position_embeddings`` (the class default came back: 2048 for a
    Llama of 4096; a ``llama3`` one got ``factor × original``, 64). It is carried now; a model of
    mnemo's own gets ``factor × original`` only for YaRN, whose factor transformers derives from
    that ratio where ``factor`` is left out, and no field otherwise (the class default)."""
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    saved("llama", tmp_path / "hf", max_position_embeddings=4096, rope_parameters=rope)
    convert(tmp_path / "hf", tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "ex")
    assert json.loads((tmp_path / "ex" / "config.json").read_text())["max_position_embeddings"] == 4096
    own = LanguageModel.from_pretrained(tmp_path / "ck")  # the same model, no carried fields
    export_hf(own, tmp_path / "own")
    assert "max_position_embeddings" not in json.loads((tmp_path / "own" / "config.json").read_text())
    yarn = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 2.0, "original_max_position_embeddings": 16}
    saved("mistral", tmp_path / "hf2", sliding_window=None, max_position_embeddings=40, rope_parameters=yarn)
    own = LanguageModel.from_pretrained(tmp_path / "hf2")
    export_hf(own, tmp_path / "own2")
    assert json.loads((tmp_path / "own2" / "config.json").read_text())["max_position_embeddings"] == 32
    convert(tmp_path / "hf2", tmp_path / "ck2")
    export_hf(tmp_path / "ck2", tmp_path / "ex2")
    assert json.loads((tmp_path / "ex2" / "config.json").read_text())["max_position_embeddings"] == 40


# 6. which class an export wrote; Qwen2's trained o bias ------------------------------------------


def test_export_says_its_class_and_a_trained_qwen2_o_bias_is_explained(tmp_path, capsys):
    """A converted Qwen2 held a zero, trainable ``o_proj.bias``; once trained, no window: the model
    went out silently as ``LlamaForCausalLM``; with a window the error ended "o_proj.bias is not
    zero". The command now says which class it wrote (and a warning why not the source's), and the
    Qwen2 refusal says the bias was trained and what to do. (Since helper 48c a Qwen2 converts with
    ``bias="qkv"``, no o bias at all: the case lives on in a Qwen2 converted before, ``bias: true``
    with a zero o bias, built here from a new conversion.)"""
    saved("qwen2", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ck")
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "ex")]) == 0
    assert "exported as Qwen2ForCausalLM, weights stored as float32" in capsys.readouterr().out
    lm = _as_converted_before_qkv(LanguageModel.from_pretrained(tmp_path / "ck"))
    with torch.no_grad():
        lm.blocks[0].mixer.o_proj.bias.add_(0.1)  # what fine-tuning does
    lm.save_pretrained(tmp_path / "trained")
    carried = (tmp_path / "ck" / CARRIED_CONFIG_NAME).read_text()
    (tmp_path / "trained" / CARRIED_CONFIG_NAME).write_text(carried)  # still the converted Qwen2
    with pytest.warns(UserWarning, match=r"not as the source's class Qwen2ForCausalLM.*o bias was trained"):
        assert main(["export", str(tmp_path / "trained"), str(tmp_path / "ex2")]) == 0
    assert "exported as LlamaForCausalLM" in capsys.readouterr().out
    saved("qwen2", tmp_path / "hfw", use_sliding_window=True, sliding_window=5, max_window_layers=0)
    lm = _as_converted_before_qkv(LanguageModel.from_pretrained(tmp_path / "hfw"))
    with torch.no_grad():
        lm.blocks[1].mixer.o_proj.bias.add_(0.1)
    with pytest.raises(ValueError, match=r"o_proj.bias is not zero.*the o bias was trained.*frozen"):
        export_hf(lm, tmp_path / "ex3")


def _as_converted_before_qkv(lm: LanguageModel) -> LanguageModel:
    """The converted Qwen2 ``lm`` (``bias="qkv"``) as a conversion before that option made it:
    ``bias: true`` and a zero ``o_proj.bias`` in every layer (the same function)."""
    from mnemo.models import ModelConfig

    d = lm.config.to_dict()
    d["mixer_options"]["attention"]["bias"] = True
    old = LanguageModel(ModelConfig.from_dict(d))
    zeros = {f"blocks.{i}.mixer.o_proj.bias": torch.zeros(d["d_model"]) for i in range(d["n_layers"])}
    old.load_state_dict({**lm.state_dict(), **zeros})
    return old


# 7. the RoPE field a refusal names ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_a_llama3_scaling_refusal_names_the_users_field_and_only_missing_keys(field, tmp_path):
    """``llama3`` without ``low_freq_factor`` / ``high_freq_factor``: the error named them as
    received (passed on as ``None``) and said ``rope_scaling`` for a ``rope_parameters`` config."""
    _, cfg, sd = saved("llama", tmp_path)
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}
    cfg = {**{k: v for k, v in cfg.items() if k != "rope_parameters"}, field: rope}
    with pytest.raises(ValueError) as e:
        import_llama(cfg, sd)
    said = str(e.value)
    assert f"field {field!r}: rope_type 'llama3' needs ['low_freq_factor', 'high_freq_factor']" in said
    assert "got keys ['factor', 'rope_theta', 'rope_type']" in said
    other = "rope_scaling" if field == "rope_parameters" else "rope_parameters"
    assert other not in said
    bad = {**rope, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 16}
    with pytest.raises(
        ValueError, match=rf"field {field!r} \(rope_type 'llama3'\): {field}: .*low_freq_factor <"
    ):
        import_llama({**cfg, field: bad}, sd)


# 8. a tied config over an untied file --------------------------------------------------------------


def test_a_tied_config_with_another_head_imports_untied_as_transformers_loads_it(tmp_path):
    """``tie_word_embeddings: true`` with a different ``lm_head.weight`` in the file: transformers 5
    keeps the file's head (it warns and does not tie them); mnemo refused. It imports untied now,
    with a warning naming the field, and computes transformers' logits."""
    hf, cfg, sd = saved("llama", tmp_path)
    assert not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert ref.lm_head.weight is not ref.model.embed_tokens.weight
    with pytest.warns(UserWarning, match="field 'tie_word_embeddings' is true but the file's lm_head.weight"):
        config, state, _ = import_hf(tmp_path)
    assert not config.tie_embeddings and torch.equal(state["lm_head.weight"], sd["lm_head.weight"])
    lm = LanguageModel(config).eval()
    lm.load_state_dict(state, strict=True)
    x = ids()
    with torch.no_grad():
        assert max_diff(lm(x)[0], ref(x).logits) <= 2e-5 and max_diff(lm(x)[0], hf(x).logits) <= 2e-5


# 9. rotary frequencies as transformers rounds them ---------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ],
    ids=["default", "llama3"],
)  # fmt: skip
def test_converted_llama_frequencies_are_transformers_float32_ones_and_agree_at_position_2000(rope):
    """mnemo computed ``θ^{−2i/D}`` in float32 (``llama3``'s in float64, rounded), transformers
    ``1 / θ^{2i/D}`` in float32: a third of the frequencies one ulp apart, which grew with the
    position to ~8e-5 in the logits at position 3000 (head_dim 64). They are transformers' float32
    numbers now, bit for bit, and the logits agree to 1e-5 at positions 2000–2047."""
    hf = hf_model("llama", head_dim=64, max_position_embeddings=131072, rope_parameters=rope)
    from mnemo.hf.convert import import_hf as _  # noqa: F401  (registers the formats)

    config, state = import_llama(hf.config.to_dict(), hf.state_dict())
    lm = LanguageModel(config).eval()
    lm.load_state_dict(state, strict=True)
    assert torch.equal(lm.blocks[0].mixer.rotary.inv_freq, hf.model.rotary_emb.inv_freq)
    x = ids(length=2048, batch=1)
    with torch.no_grad():
        ours, ref = lm(x)[0], hf(x).logits
    assert max_diff(ours[:, 2000:], ref[:, 2000:]) <= 1e-5


# 10. quantized checkpoints -----------------------------------------------------------------------


def test_a_quantized_checkpoint_is_refused_by_its_field(tmp_path):
    """A GPTQ / AWQ / bitsandbytes / fp8 checkpoint (``quantization_config``) failed with "weight …
    is missing" (its weights are packed integers and scales under other names)."""
    _, cfg, sd = saved("llama", tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    )
    with pytest.raises(ValueError, match=r"field 'quantization_config' \(quant_method 'gptq'\): quantized "):
        import_hf(tmp_path)
    with pytest.raises(ValueError, match="dequantize first"):
        LanguageModel.from_pretrained(tmp_path)


# 12. induction heads out of a window -------------------------------------------------------------


def test_probe_circuits_says_when_the_induction_target_lies_outside_the_window(tmp_path, capsys):
    """With a window of ``W`` keys the induction target of a query (``--length − 1`` tokens back) is
    out of reach once ``--length > W``: every induction score is exactly 0, which read as measured.
    Said now, on stderr and in each such layer's JSON entry; at ``--length W`` the scores are
    measured (and not 0)."""
    saved("mistral", tmp_path / "hf", sliding_window=5)
    convert(tmp_path / "hf", tmp_path / "ck")
    argv = ["probe", "circuits", "--checkpoint", str(tmp_path / "ck"), "--batch", "1"]
    assert main([*argv, "--length", "6", "--out", str(tmp_path / "p6")]) == 0
    err = capsys.readouterr().err
    assert "note: layer 0: the induction target lies 5 tokens back (--length 6 − 1), outside this layer's " \
        "window of 5 keys" in err  # fmt: skip
    layers = json.loads((tmp_path / "p6" / "circuits.json").read_text())["layers"]
    for entry in layers.values():
        assert entry["induction_out_of_window"] is True and entry["induction"] == [0.0] * 4
        assert "--length 5 or less measures them" in entry["induction_note"]
    assert main([*argv, "--length", "5", "--out", str(tmp_path / "p5")]) == 0
    assert "induction target" not in capsys.readouterr().err
    layers = json.loads((tmp_path / "p5" / "circuits.json").read_text())["layers"]
    for entry in layers.values():
        assert "induction_out_of_window" not in entry and min(entry["induction"]) > 0
