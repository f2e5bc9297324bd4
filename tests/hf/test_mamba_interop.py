"""Mamba / Mamba-2 checkpoints in and out: transformers' ``MambaForCausalLM`` /
``Mamba2ForCausalLM`` (tiny random-weight models built with transformers itself, saved into
``tmp_path``) and the original mamba-ssm layout, against transformers' own forward pass and cached
decoding. Relative RMS error of the logits: ≤ 1e-10 in float64, ≤ 1e-5 in float32.

transformers computes its Mamba norms, scans and logits in float32 whatever the model's dtype
(``.float()`` / ``.to(torch.float32)`` inside), which alone leaves ~1e-7 between two float64
models. For the float64 comparisons its forward runs under :func:`transformers_in_float64`, which
makes those casts keep float64 for float64 tensors during the call — the same code, computing in
float64.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mnemo.hf.convert import (  # noqa: E402
    ARCHITECTURES,
    convert,
    export_hf,
    find_architecture,
    hf_cache_from_layer_states,
    import_hf,
    layer_states_from_hf,
    layer_states_of_hf_cache,
    layer_states_to_hf,
)
from mnemo.models.config import ModelConfig  # noqa: E402
from mnemo.models.lm import LanguageModel  # noqa: E402
from tests.helpers import rel_rms  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
VOCAB, T, PREFILL, STEPS = 40, 9, 3, 4


@contextlib.contextmanager
def transformers_in_float64():
    """While active, ``Tensor.float()`` and ``Tensor.to(torch.float32)`` leave float64 tensors in
    float64 (test-only; restored on exit)."""
    orig_float, orig_to = torch.Tensor.float, torch.Tensor.to

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else orig_float(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return orig_to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to = float_, to
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = orig_float, orig_to


def _precise(dtype):
    return transformers_in_float64() if dtype == torch.float64 else contextlib.nullcontext()


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, so that each one (biases, norm weights, D) matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.rand(p.shape, generator=g, dtype=torch.float64)
            n = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("A_log"):
                v = r * 1.5 - 0.5
            elif name.endswith("dt_proj.bias") or name.endswith("dt_bias"):
                v = r * 2 - 3
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight") or "mixer_norm" in name:
                v = 1 + 0.2 * n
            else:
                v = 0.3 * n
            p.copy_(v.to(p.dtype))


CASES = {
    "mamba": ("mamba", dict(use_conv_bias=True)),
    "mamba_no_conv_bias_rank3_untied_bias": (
        "mamba",
        dict(use_conv_bias=False, time_step_rank=3, tie_word_embeddings=False, use_bias=True),
    ),
    "mamba2_groups1": ("mamba2", dict(n_groups=1, tie_word_embeddings=True)),
    "mamba2_groups4_untied": ("mamba2", dict(n_groups=4, tie_word_embeddings=False, use_conv_bias=False)),
}


def _hf_model(kind: str, opts: dict, dtype=torch.float64):
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, conv_kernel=4, expand=2)
    if kind == "mamba":
        cfg = transformers.MambaConfig(state_size=4, **common, **opts)
        model = transformers.MambaForCausalLM(cfg)
    else:
        cfg = transformers.Mamba2Config(state_size=4, head_dim=4, num_heads=8, chunk_size=4, **common, **opts)
        model = transformers.Mamba2ForCausalLM(cfg)
    _randomise(model)
    return model.to(dtype).eval()


def _ids(seed=3, n=T):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _hf_decode(hf, ids, dtype):
    """transformers' own cached decoding: prefill, then one token at a time."""
    with torch.no_grad(), _precise(dtype):
        out = hf(ids[:, :PREFILL], use_cache=True)
        logits = [out.logits]
        cache = out.cache
        for t in range(PREFILL, ids.shape[1]):
            out = hf(ids[:, t : t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1), out.cache


def _mnemo_decode(lm, ids, state=None, start=0):
    logits = []
    with torch.no_grad():
        if state is None:
            lg, state = lm(ids[:, :PREFILL])
            logits.append(lg)
            start = PREFILL
        for t in range(start, ids.shape[1]):
            lg, state = lm(ids[:, t : t + 1], state)
            logits.append(lg)
    return torch.cat(logits, 1), state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_import_matches_transformers(case, dtype, tmp_path):
    kind, opts = CASES[case]
    hf = _hf_model(kind, opts, dtype)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    if dtype == torch.float64:
        config, state, tok = import_hf(tmp_path / "hf")
        assert [p.name for p in tok] == ["tokenizer.json"]
        lm = LanguageModel(config).double().eval()
        lm.load_state_dict(state, strict=True)
    else:  # the in-memory conversion of from_pretrained (a float32 model)
        lm = LanguageModel.from_pretrained(tmp_path / "hf").eval()
        config = lm.config
    assert config.mixer == kind and config.tie_embeddings == hf.config.tie_word_embeddings
    tol = TOL[dtype]
    ids = _ids()
    with torch.no_grad(), _precise(dtype):
        ref = hf(ids).logits
    assert ref.dtype == dtype
    assert rel_rms(lm(ids)[0], ref) <= tol

    # cached decoding against transformers' cached decoding
    ref_dec, hf_cache = _hf_decode(hf, ids, dtype)
    assert rel_rms(ref_dec, ref) <= tol
    got, state = _mnemo_decode(lm, ids)
    assert rel_rms(got, ref_dec) <= tol

    # caches: transformers' → mnemo continues; mnemo's → transformers continues
    ids2 = torch.cat([ids, _ids(seed=4, n=3)], 1)
    with torch.no_grad(), _precise(dtype):
        ref_full = hf(ids2).logits[:, T:]
    mn_states = layer_states_from_hf(config, layer_states_of_hf_cache(hf_cache), offset=T)
    cont, _ = _mnemo_decode(lm, ids2, mn_states, start=T)
    assert rel_rms(cont, ref_full) <= tol
    cache = hf_cache_from_layer_states(hf.config, layer_states_to_hf(state))
    with torch.no_grad(), _precise(dtype):
        outs = []
        for t in range(T, ids2.shape[1]):
            out = hf(ids2[:, t : t + 1], cache=cache, use_cache=True)
            outs.append(out.logits)
            cache = out.cache
    assert rel_rms(torch.cat(outs, 1), ref_full) <= tol


def _mnemo_model(mixer: str, options: dict, tie=True):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=2,
        mixer=mixer,
        mixer_options={mixer: options},
        mlp="none",
        tie_embeddings=tie,
    )
    lm = LanguageModel(cfg).double().eval()
    _randomise(lm, seed=5)
    return lm


EXPORT_CASES = {
    "mamba": ("mamba", dict(d_state=4, dt_rank=3, bias=True, conv_bias=False), False),
    "mamba2": ("mamba2", dict(d_state=4, head_dim=4, n_groups=4, dt_limit=(0.0, 5.0)), True),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_round_trip(case, tmp_path):
    mixer, opts, tie = EXPORT_CASES[case]
    lm = _mnemo_model(mixer, opts, tie)
    out = export_hf(lm, tmp_path / "hf")
    cls = transformers.MambaForCausalLM if mixer == "mamba" else transformers.Mamba2ForCausalLM
    hf = cls.from_pretrained(out, dtype=torch.float64).eval()
    ids = _ids()
    with torch.no_grad(), transformers_in_float64():
        ref = hf(ids).logits
    assert rel_rms(lm(ids)[0], ref) <= TOL[torch.float64]
    # and back: identical weights
    config, state, _ = import_hf(out)
    mine = lm.state_dict()
    assert set(state) == set(mine)
    for k, v in mine.items():
        assert torch.equal(state[k], v), k
    assert LanguageModel(config).config.mixer_options[mixer]["d_state"] == 4


def _write_mamba_ssm(hf, folder, ssm_cfg: dict, tie: bool):
    """An original mamba-ssm folder: its config fields and ``pytorch_model.bin`` with
    ``backbone.embedding.weight`` (the tied head stored too, as mamba-ssm's state dict has it)."""
    folder.mkdir()
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in hf.state_dict().items()}
    if tie:
        sd["lm_head.weight"] = sd["backbone.embedding.weight"].clone()
    torch.save(sd, folder / "pytorch_model.bin")
    cfg = dict(
        d_model=hf.config.hidden_size,
        d_intermediate=0,
        n_layer=hf.config.num_hidden_layers,
        vocab_size=VOCAB,
        ssm_cfg=ssm_cfg,
        attn_layer_idx=[],
        attn_cfg={},
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=8,
        tie_embeddings=tie,
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_mamba_ssm_layout(kind, tmp_path):
    if kind == "mamba":
        hf = _hf_model("mamba", dict(time_step_rank=2))
        ssm_cfg = {"d_state": 4, "d_conv": 4, "expand": 2, "dt_rank": 2, "dt_min": 0.001}
    else:
        hf = _hf_model("mamba2", dict(n_groups=2, tie_word_embeddings=True))
        ssm_cfg = {"layer": "Mamba2", "d_state": 4, "headdim": 4, "ngroups": 2, "chunk_size": 4}
    _write_mamba_ssm(hf, tmp_path / "ssm", ssm_cfg, tie=True)
    assert find_architecture(json.loads((tmp_path / "ssm" / "config.json").read_text())).name == "mamba_ssm"
    config, state, _ = import_hf(tmp_path / "ssm")
    lm = LanguageModel(config).double().eval()
    lm.load_state_dict(state, strict=True)
    ids = _ids()
    with torch.no_grad(), transformers_in_float64():
        ref = hf(ids).logits
    assert rel_rms(lm(ids)[0], ref) <= TOL[torch.float64]
    # convert writes a normal mnemo checkpoint folder
    out = convert(tmp_path / "ssm", tmp_path / "mnemo")
    assert json.loads((out / "config.json").read_text())["mixer"] == kind
    again = LanguageModel.from_pretrained(out)
    assert rel_rms(again(ids)[0], ref) <= TOL[torch.float32]


def test_sharded_safetensors(tmp_path):
    from safetensors.torch import save_file

    hf = _hf_model("mamba", {})
    hf.save_pretrained(tmp_path / "one")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(sd)
    d = tmp_path / "sharded"
    d.mkdir()
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(d / name), {"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    a, b = import_hf(d)[1], import_hf(tmp_path / "one")[1]
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_refusals(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: MambaForCausalLM"):
        import_hf(d)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LanguageModel.from_pretrained(d)
    # options with no exact equivalent are named
    hf = _hf_model("mamba", {})
    hf.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        import_hf(tmp_path / "m")
    ssm = tmp_path / "ssm"
    cfg = _write_mamba_ssm(hf, ssm, {"d_state": 4}, tie=True)
    (ssm / "config.json").write_text(json.dumps({**cfg, "d_intermediate": 64}))
    with pytest.raises(ValueError, match="d_intermediate"):
        import_hf(ssm)
    (ssm / "config.json").write_text(json.dumps({**cfg, "ssm_cfg": {"layer": "Mamba3"}}))
    with pytest.raises(ValueError, match="Mamba3"):
        import_hf(ssm)
    # exports that transformers' classes cannot express
    for mixer, opts, kw, what in [
        ("mamba2", dict(d_state=4, head_dim=4, D_has_hdim=True), {}, "D_has_hdim"),
        ("mamba2", dict(d_state=4, head_dim=4, norm_before_gate=True), {}, "norm_before_gate"),
        ("mamba", dict(d_state=4, selective=False), {}, "selective"),
        ("mamba", dict(d_state=4), dict(mlp="swiglu"), "mlp"),
        ("mamba", dict(d_state=4), dict(pos_embedding="learned"), "pos_embedding"),
        ("mamba", dict(d_state=4), dict(layers=["mamba", "mamba2"]), "mixers"),
        ("linear_attention", {}, {}, "mixers"),
        # attention layers go to the Qwen3-Next exporter, which names what it cannot express
        ("attention", {}, {}, "Qwen3-Next conversion: mlp 'none'"),
    ]:
        cfg = ModelConfig(
            vocab_size=VOCAB,
            d_model=16,
            n_layers=2,
            mixer=mixer,
            mixer_options={mixer: opts},
            **{"mlp": "none", **kw},
        )
        with pytest.raises(ValueError, match=what):
            export_hf(LanguageModel(cfg), tmp_path / f"x_{what}")
    assert {"MambaForCausalLM", "Mamba2ForCausalLM", "mamba_ssm"} <= set(ARCHITECTURES)


def test_commands(tmp_path, capsys):
    from mnemo.cli import main

    hf = _hf_model("mamba2", dict(n_groups=2), torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "ck" / "tokenizer_config.json").is_file()
    lm = LanguageModel.from_pretrained(tmp_path / "ck")
    # a non-empty OUT is refused without --force
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--force"]) == 0
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "back"), "--format", "hf"]) == 0
    assert (tmp_path / "back" / "tokenizer_config.json").is_file()
    back = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = _ids()
    with torch.no_grad():
        assert rel_rms(lm(ids)[0], back(ids).logits) <= TOL[torch.float32]
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "argument src: expected an existing folder" in capsys.readouterr().err


def _strict_json(path):
    """``path`` read as strict JSON (``Infinity`` / ``NaN`` are not JSON: other readers refuse them)."""

    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_mamba2_export_writes_an_infinite_limit_as_transformers_does(tmp_path):
    """Mamba-2's default ``time_step_limit`` (0, inf): the export writes the upper bound as
    transformers 5 itself does (``{"__float__": "Infinity"}``, valid JSON), and it reads back as
    inf in transformers and in mnemo; a finite limit stays a plain number."""
    hf = _hf_model("mamba2", dict(n_groups=2), torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    theirs = _strict_json(tmp_path / "hf" / "config.json")["time_step_limit"]
    assert theirs == [0.0, {"__float__": "Infinity"}]
    convert(tmp_path / "hf", tmp_path / "mn")
    export_hf(tmp_path / "mn", tmp_path / "ex")
    assert _strict_json(tmp_path / "ex" / "config.json")["time_step_limit"] == theirs
    back = transformers.Mamba2Config.from_pretrained(tmp_path / "ex")
    assert tuple(back.time_step_limit) == (0.0, float("inf"))
    config, _, _ = import_hf(tmp_path / "ex")
    assert "dt_limit" not in config.mixer_options["mamba2"]  # (0, inf): the default, as it came in
    lm = _mnemo_model("mamba2", dict(d_state=4, head_dim=4, n_groups=4, dt_limit=(0.01, 5.0)))
    export_hf(lm, tmp_path / "finite")
    assert _strict_json(tmp_path / "finite" / "config.json")["time_step_limit"] == [0.01, 5.0]


def _saved_with(tmp_path, name, hf, **config_over):
    """``hf`` saved into ``tmp_path / name`` with ``config_over`` written over its config.json."""
    d = tmp_path / name
    hf.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config_over}))
    return d


#: a bad field of a saved Mamba2ForCausalLM's config.json and what the error says
BAD_MAMBA2_FIELDS = [
    (dict(time_step_limit=[0.0, "abc"]), "field 'time_step_limit': expected [min, max], two numbers"),
    (dict(time_step_limit=[0.0, 0.1, 0.2]), "got [0.0, 0.1, 0.2]"),
    (dict(time_step_limit=[0.1]), "field 'time_step_limit': expected [min, max]"),
    (dict(time_step_limit=0.1), "field 'time_step_limit': expected [min, max]"),
    (dict(time_step_limit=[0.2, 0.1]), "min <= max, got [0.2, 0.1]"),
    (dict(expand="2"), "field 'expand': expected a positive int, got '2'"),
    (dict(expand=0), "field 'expand': expected a positive int, got 0"),
    (dict(expand=-2), "field 'expand': expected a positive int, got -2"),
    (
        dict(n_groups=1),
        "conv1d.bias has shape [48], but the config (hidden_size = 16, expand = 2, n_groups = 1",
    ),
    (
        dict(state_size=8),
        "state_size = 8, conv_kernel = 4) gives [64]: the config and the weights disagree",
    ),
    (dict(conv_kernel=3), "conv1d.weight has shape [48, 1, 4], but the config"),
    (dict(num_heads=4, head_dim=8), "A_log has shape [8], but the config (num_heads = 4, head_dim = 8"),
    (dict(bos_token_id="<s>"), "field 'bos_token_id': expected a token id (an int or null), got '<s>'"),
    (dict(architectures="Mamba2ForCausalLM"), "field 'architectures': expected a list of class names"),
]


@pytest.mark.parametrize(
    "over, message", BAD_MAMBA2_FIELDS, ids=[json.dumps(o)[:40] for o, _ in BAD_MAMBA2_FIELDS]
)
def test_bad_mamba2_fields_are_named(over, message, tmp_path):
    """Each bad field is refused by name with the received value (review: unpacking errors,
    mnemo's internal shape errors); nothing is written."""
    d = _saved_with(tmp_path, "hf", _hf_model("mamba2", dict(n_groups=2), torch.float32), **over)
    with pytest.raises(ValueError) as e:
        convert(d, tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_bad_mamba_fields_and_files_are_named(tmp_path):
    """Mamba-1 shapes name their fields; a corrupt shard index names its file; a saved
    ``MambaModel`` (the backbone without the head) names the architecture."""
    hf = _hf_model("mamba", {}, torch.float32)
    for over, message in [
        (dict(time_step_rank=2), "dt_proj.weight has shape [32, 1], but the config (hidden_size = 16, "
         "expand = 2, time_step_rank = 2) gives [32, 2]"),
        (dict(state_size=8), "A_log has shape [32, 4], but the config (hidden_size = 16, expand = 2, "
         "state_size = 8)"),
    ]:  # fmt: skip
        name = next(iter(over))
        with pytest.raises(ValueError) as e:
            import_hf(_saved_with(tmp_path, name, hf, **over))
        assert message in str(e.value)
    d = tmp_path / "sharded"
    hf.save_pretrained(d)
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": ')
    with pytest.raises(
        ValueError, match=f"corrupt index file {d / 'model.safetensors.index.json'}: not JSON"
    ):
        import_hf(d)
    (d / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(
        ValueError, match="corrupt index file .*expected a JSON object with a non-empty 'weight_map'"
    ):
        import_hf(d)
    transformers.MambaModel(hf.config).save_pretrained(tmp_path / "backbone")
    with pytest.raises(
        ValueError, match=r"unsupported architecture MambaModel \(model_type 'mamba'\).*lm_head"
    ):
        import_hf(tmp_path / "backbone")
    with pytest.raises(ValueError, match="MambaModel"):
        LanguageModel.from_pretrained(tmp_path / "backbone")


def _hf_tokenizer(folder, chat_template: str):
    """A byte-level BPE tokenizer with special tokens and a chat template, saved by transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:30],
        show_progress=False,
    )
    tok.train_from_iterator(["hello world"] * 5, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(folder)


def test_options_and_files_carried_through_convert_and_export(tmp_path):
    """``residual_in_fp32: false``, the bos / eos / pad ids, ``generation_config.json`` and the chat
    template (``chat_template.jinja``) go through convert and export unchanged (the review: they
    came back as true / defaults / missing); a model of mnemo's own exports null ids, not the
    transformers class's defaults."""
    pytest.importorskip("tokenizers")
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    hf = _hf_model("mamba2", dict(n_groups=2, residual_in_fp32=False), torch.float32)
    hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id = 0, 1, 2
    hf.generation_config.bos_token_id, hf.generation_config.eos_token_id = 0, 1
    hf.generation_config.pad_token_id = 2
    hf.generation_config.max_new_tokens = 7
    hf.save_pretrained(tmp_path / "hf")
    _hf_tokenizer(tmp_path / "hf", template)
    assert (tmp_path / "hf" / "chat_template.jinja").is_file()
    convert(tmp_path / "hf", tmp_path / "mn")
    carried = json.loads((tmp_path / "mn" / "hf_config_carried.json").read_text())
    assert carried == {
        "source_architecture": "Mamba2ForCausalLM",
        "fields": {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "residual_in_fp32": False},
    }
    LanguageModel.from_pretrained(tmp_path / "mn")  # still an ordinary mnemo checkpoint
    export_hf(tmp_path / "mn", tmp_path / "ex")
    for name in ("generation_config.json", "chat_template.jinja"):
        assert (tmp_path / "ex" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    back = transformers.Mamba2Config.from_pretrained(tmp_path / "ex")
    assert back.residual_in_fp32 is False
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (0, 1, 2)
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "ex")
    assert (gen.eos_token_id, gen.max_new_tokens) == (1, 7)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "ex").chat_template == template
    # a transformers folder exported as it is (converted in memory) keeps them too
    export_hf(tmp_path / "hf", tmp_path / "direct")
    direct = _strict_json(tmp_path / "direct" / "config.json")
    assert direct == _strict_json(tmp_path / "ex" / "config.json")
    # a model built in mnemo: no ids known, so none is claimed (Mamba2Config would say eos 2, pad 1)
    export_hf(_mnemo_model("mamba2", dict(d_state=4, head_dim=4, n_groups=4)), tmp_path / "native")
    cfg = _strict_json(tmp_path / "native" / "config.json")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (None, None, None)
    assert cfg["residual_in_fp32"] is True
    # a damaged record is named, not silently dropped
    (tmp_path / "mn" / "hf_config_carried.json").write_text('{"fields": {"eos_token_id": "x"}}')
    with pytest.raises(ValueError, match="hf_config_carried.json: field 'eos_token_id': expected a token id"):
        export_hf(tmp_path / "mn", tmp_path / "ex2")
