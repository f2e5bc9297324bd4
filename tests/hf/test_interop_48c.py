"""Helper 48c: a fine-tuned converted checkpoint keeps the record of its source
(``hf_config_carried.json``, ``generation_config.json``), and Qwen2 imports with biases on q, k and v
only (``bias="qkv"``), so a fine-tuned Qwen2 exports as Qwen2.

Tiny random-weight models built and saved by ``transformers`` itself, as in
``test_llama_family_47.py``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from mnemo.hf.convert import CARRIED_CONFIG_NAME, CARRIED_FILES, convert, export_hf  # noqa: E402
from mnemo.models import LanguageModel, ModelConfig  # noqa: E402
from mnemo.train import TrainConfig, Trainer, resolve_checkpoint  # noqa: E402
from mnemo.train.build import SOURCE_FILES  # noqa: E402
from tests.hf.test_llama_family_47 import VOCAB  # noqa: E402  (the same tiny models)
from tests.hf.test_llama_trial_47e import hf_model, ids  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer:UserWarning")

ATOL = 2e-5  # float32, as test_llama_family_47 (measured ≤ 1e-6)


def word_tokenizer(folder) -> None:
    """A word-level ``tokenizer.json`` over the model's vocabulary (``w0`` … ``w52``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def fine_tune(
    ck, out, text, steps: int = 2, resume: bool = False, model_changes=None, **attention
) -> Trainer:
    """``steps`` steps of text training from the converted checkpoint ``ck`` (its model, given as
    ``model_overrides`` of the ``attention`` mixer's default model, with the attention options
    ``attention`` and the model fields ``model_changes`` changed; its tokenizer)."""
    model = ModelConfig.load(ck / "config.json").to_dict()
    model.pop("vocab_size")
    model["mixer_options"]["attention"].update(attention)
    model.update(model_changes or {})
    cfg = TrainConfig(
        model="attention", model_overrides=model, init_from=str(ck), tokenizer=str(ck), data=str(text),
        seq_len=8, batch_size=2, steps=steps, eval_interval=steps, eval_batches=1, warmup_steps=1,
        lr=1e-2, sample_tokens=0, device="cpu",
    )  # fmt: skip
    if resume:
        t = Trainer({"steps": steps}, out, resume=True, reschedule="stretch", progress=False)
    else:
        t = Trainer(cfg, out, progress=False)
    t.fit()
    return t


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``(converted checkpoint, text file)``: a bfloat16 Llama with ``max_position_embeddings`` 4096
    and token ids 1 / 2 / 0 in its config and a ``generation_config.json``, converted."""
    root = tmp_path_factory.mktemp("llama")
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    m = hf_model("llama", max_position_embeddings=4096,
                 rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    m.to(torch.bfloat16).save_pretrained(root / "hf")
    assert (root / "hf" / "generation_config.json").is_file()
    word_tokenizer(root / "hf")
    convert(root / "hf", root / "ck")
    g = torch.Generator().manual_seed(0)
    text = root / "words.txt"
    text.write_text(" ".join(f"w{i}" for i in torch.randint(3, VOCAB, (1200,), generator=g).tolist()))
    return root / "ck", text


def test_the_carried_file_names_are_converts(converted):
    """The files a run carries are those ``convert`` writes beside the weights for the way back
    (``mnemo.train`` does not import ``mnemo.hf``: the names are written twice)."""
    assert set(SOURCE_FILES) == {CARRIED_CONFIG_NAME, *CARRIED_FILES}
    ck, _ = converted
    assert all((ck / n).is_file() for n in SOURCE_FILES)


def test_a_fine_tuned_converted_llama_exports_its_sources_fields(converted, tmp_path):
    """``mnemo train --init-from`` a converted Llama wrote checkpoints without
    ``hf_config_carried.json``, so the export of the fine-tuned model fell back to the class's
    defaults (``max_position_embeddings`` 4096 -> 2048, float32 instead of the source's bfloat16,
    the token ids null). The run's checkpoints carry the source's files byte for byte (a resumed
    run's too), and the export writes the source's fields back around the trained weights."""
    ck, text = converted
    source = json.loads((ck / "config.json").read_text())  # (mnemo's config of the converted model)
    fine_tune(ck, tmp_path / "run", text)
    last = resolve_checkpoint(tmp_path / "run")
    for n in SOURCE_FILES:
        assert (last / n).read_bytes() == (ck / n).read_bytes(), n
    trained, before = load_file(str(last / "model.safetensors")), load_file(str(ck / "model.safetensors"))
    assert not torch.equal(trained["blocks.0.mixer.q_proj.weight"], before["blocks.0.mixer.q_proj.weight"])
    assert json.loads((last / "config.json").read_text()) == source  # the same model
    export_hf(tmp_path / "run", tmp_path / "ex")
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    fields = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    assert [cfg[k] for k in fields] == [4096, 1, 2, 0]
    assert (tmp_path / "ex" / "generation_config.json").read_bytes() == (
        ck / "generation_config.json"
    ).read_bytes()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ex").eval()
    assert back.config.max_position_embeddings == 4096 and back.dtype == torch.bfloat16
    # a resumed run carries them on (from the checkpoint it continues)
    fine_tune(ck, tmp_path / "run", text, steps=3, resume=True)
    last = resolve_checkpoint(tmp_path / "run")
    assert last.name == "ckpt-000003"
    assert (last / CARRIED_CONFIG_NAME).read_bytes() == (ck / CARRIED_CONFIG_NAME).read_bytes()


def test_train_init_from_a_converted_checkpoint_fine_tunes_its_architecture(converted, tmp_path, capsys):
    """``mnemo train --init-from DIR --tokenizer DIR`` with no ``--model`` trained the default
    ``transformer`` and failed ("the weights do not fit model 'transformer'", review 49i): for a
    converted checkpoint it now takes the checkpoint's architecture (its config, the tokenizer's
    vocabulary), and the run's model config is the checkpoint's; a given ``--model`` is still used."""
    from mnemo.cli import main

    ck, text = converted
    common = ["--tokenizer", str(ck), "--data", str(text), "--seq-len", "8", "--batch-size", "2",
              "--steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--sample-tokens", "0",
              "--device", "cpu"]  # fmt: skip
    assert main(["train", "--init-from", str(ck), "--out", str(tmp_path / "run"), *common]) == 0
    last = resolve_checkpoint(tmp_path / "run")
    assert json.loads((last / "config.json").read_text()) == json.loads((ck / "config.json").read_text())
    capsys.readouterr()
    code = main(
        ["train", "--init-from", str(ck), "--model", "transformer", "--out", str(tmp_path / "r2"), *common]
    )
    assert code != 0 and "do not fit model 'transformer'" in capsys.readouterr().err


def test_a_run_that_changes_the_model_carries_no_stale_fields(converted, tmp_path):
    """The rule (``mnemo.train.build.source_files``): the fields describe the converted model, so a
    run whose model differs from it (here the RoPE base: the same shapes, another model) carries
    none of them, with a warning naming the difference; its export writes the class's defaults."""
    ck, text = converted
    rope = json.loads((ck / "config.json").read_text())["mixer_options"]["attention"]["rope_theta"]
    with pytest.warns(
        UserWarning, match=r"not carried .*mixer_options.attention.rope_theta 500.0 there, 1000.0"
    ):
        fine_tune(ck, tmp_path / "run", text, rope_theta=1000.0)
    assert rope == 500.0
    last = resolve_checkpoint(tmp_path / "run")
    assert not any((last / n).exists() for n in SOURCE_FILES)
    export_hf(tmp_path / "run", tmp_path / "ex")
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert "max_position_embeddings" not in cfg and cfg["dtype"] == "float32"


def test_a_run_that_changes_only_init_std_carries_the_fields(converted, tmp_path):
    """``init_std`` only draws the initial weights, which ``init_from`` replaces: a run that changes
    it alone still has the checkpoint's model, and carries the files without a warning (review 48e)."""
    ck, text = converted
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not carried")
        fine_tune(ck, tmp_path / "run", text, steps=1, model_changes={"init_std": 0.5})
    last = resolve_checkpoint(tmp_path / "run")
    assert json.loads((last / "config.json").read_text())["init_std"] == 0.5
    for n in SOURCE_FILES:
        assert (last / n).read_bytes() == (ck / n).read_bytes(), n


# Qwen2's biases: q, k and v, none on o ---------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """``(transformers model, its converted checkpoint)``: a Qwen2 with a window of 5 in every layer."""
    root = tmp_path_factory.mktemp("qwen2")
    hf = hf_model("qwen2", use_sliding_window=True,
                  sliding_window=5, max_window_layers=0, max_position_embeddings=64)  # fmt: skip
    hf.save_pretrained(root / "hf")
    convert(root / "hf", root / "ck")
    return hf, root / "ck"


def test_a_qwen2_imports_with_no_o_bias_and_equal_logits(qwen2):
    """A converted Qwen2 carried a zero ``o_proj.bias`` (mnemo's one bias flag covered q, k, v and o)
    that then trained; it has ``bias="qkv"`` now: q, k and v biased, no o bias parameter, and its
    logits still equal transformers' (float32, 12 tokens, past the window)."""
    hf, ck = qwen2
    lm = LanguageModel.from_pretrained(ck).eval()
    assert lm.config.mixer_options["attention"]["bias"] == "qkv"
    names = {n for n, _ in lm.named_parameters()}
    assert not any(n.endswith("o_proj.bias") for n in names)
    assert {"blocks.0.mixer.q_proj.bias", "blocks.0.mixer.kv_proj.bias"} <= names
    x = ids()
    with torch.no_grad():
        assert (lm(x)[0] - hf(x).logits).abs().max().item() <= ATOL


def test_a_fine_tuned_qwen2_exports_as_qwen2(qwen2, tmp_path, recwarn):
    """One optimizer step on the converted Qwen2 (its q/k/v biases train, there is no o bias to
    train), then ``mnemo export``: it goes out as ``Qwen2ForCausalLM`` (before: as Llama with a
    warning, or refused with a window), which transformers reloads with the fine-tuned logits."""
    _, ck = qwen2
    lm = LanguageModel.from_pretrained(ck)
    before = lm.blocks[0].mixer.q_proj.bias.detach().clone()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    x = ids(length=12)
    logits = lm(x[:, :-1])[0]
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
    opt.step()
    assert not torch.equal(lm.blocks[0].mixer.q_proj.bias, before)
    lm.save_pretrained(tmp_path / "trained")
    (tmp_path / "trained" / CARRIED_CONFIG_NAME).write_bytes((ck / CARRIED_CONFIG_NAME).read_bytes())
    export_hf(tmp_path / "trained", tmp_path / "ex")
    assert not [w for w in recwarn if "not as the source's class" in str(w.message)]
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["sliding_window"] == 5
    assert not any(k.endswith("o_proj.bias") for k in load_file(str(tmp_path / "ex" / "model.safetensors")))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ex").eval()
    assert type(back) is transformers.Qwen2ForCausalLM
    lm.eval()
    with torch.no_grad():
        assert (back(x).logits - lm(x)[0]).abs().max().item() <= ATOL
    # back in: the same model (bias="qkv"), the same weights
    again = LanguageModel.from_pretrained(tmp_path / "ex")
    assert again.config == lm.config
    assert all(torch.equal(v, lm.state_dict()[k]) for k, v in again.state_dict().items())


def test_bias_true_configs_load_unchanged_and_qkv_is_qwen2s_alone(tmp_path):
    """A saved config with ``bias: true`` (every checkpoint before ``"qkv"``) builds the same
    parameters as before (q, k, v, gate and o biases) and loads its file; ``bias`` takes true,
    false or ``"qkv"``, anything else refused naming it. A model of mnemo's own with ``bias="qkv"``
    exports as Qwen2 (Llama's ``attention_bias`` would bias o too), with equal logits."""
    opts = {"n_heads": 4, "n_kv_heads": 2, "output_gate": True}
    old = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, mixer="attention",
                      mixer_options={"attention": {**opts, "bias": True}})  # fmt: skip
    LanguageModel(old).save_pretrained(tmp_path / "old")
    saved = json.loads((tmp_path / "old" / "config.json").read_text())
    assert saved["mixer_options"]["attention"]["bias"] is True
    lm = LanguageModel.from_pretrained(tmp_path / "old")
    biases = sorted(n for n, _ in lm.named_parameters() if n.endswith(".bias"))
    assert biases == [f"blocks.0.mixer.{p}.bias" for p in ("gate_proj", "kv_proj", "o_proj", "q_proj")]
    qkv = ModelConfig.from_dict({**saved, "mixer_options": {"attention": {**opts, "bias": "qkv"}}})
    biases = sorted(n for n, _ in LanguageModel(qkv).named_parameters() if n.endswith(".bias"))
    assert biases == ["blocks.0.mixer.kv_proj.bias", "blocks.0.mixer.q_proj.bias"]
    for bad in ("qk", 1):
        bad_config = {**saved, "mixer_options": {"attention": {**opts, "bias": bad}}}
        with pytest.raises(ValueError, match=r"bias"):
            LanguageModel(ModelConfig.from_dict(bad_config))
        # the config's own validation (a sweep spec's, before any run) names the values it takes
        with pytest.raises(
            ValueError, match=r"\['bias'\]: expected true or false or 'qkv' .*got " + repr(bad)
        ):
            ModelConfig.from_dict(bad_config).validate()
    from mnemo.layers.attention import Attention

    with pytest.raises(ValueError, match=r"bias: expected True .*False .* or 'qkv' .*got 'qk'"):
        Attention(32, 4, bias="qk")
    torch.manual_seed(0)
    own_cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, mixer="attention",
                          mixer_options={"attention": {"n_heads": 4, "bias": "qkv"}})  # fmt: skip
    own = LanguageModel(own_cfg).eval()
    with torch.no_grad():
        for p in own.parameters():
            p.add_(0.2 * torch.randn_like(p))
    export_hf(own, tmp_path / "own")
    assert json.loads((tmp_path / "own" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own").eval()
    x = ids()
    with torch.no_grad():
        assert (back(x).logits - own(x)[0]).abs().max().item() <= ATOL
