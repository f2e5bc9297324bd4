"""Leftovers of the day's reviews: the end-of-text stop of ``mnemo generate``, ``~`` in a data glob,
the special ids of a ``MnemoForCausalLM`` folder read by ``AutoConfig``."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _bpe_folder(path):
    """A mnemo checkpoint with a byte-level BPE tokenizer of ``mnemo tokenizer train``."""
    pytest.importorskip("tokenizers")
    from mnemo.commands.tokenizer import train_tokenizer
    from mnemo.data.tokenizer import HFTokenizer
    from mnemo.models import LanguageModel, ModelConfig

    tok = HFTokenizer(train_tokenizer(["the cat sat on the mat and the dog sat on the log " * 4], 262))
    torch.manual_seed(0)
    lm = LanguageModel(
        ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, mixer="mamba", mlp="none")
    )
    lm.save_pretrained(path)
    tok.save(path)
    return tok, lm


@pytest.mark.parametrize("ignore", [False, True])
def test_generate_stops_at_a_bpe_checkpoints_endoftext(tmp_path, monkeypatch, capsys, ignore):
    """``mnemo generate`` ran past a BPE checkpoint's ``<|endoftext|>`` (``checkpoint_eos`` reads only
    declared ids: none for mnemo's own folders), while the harness, ``export_hf`` and
    ``MnemoForCausalLM`` stop there: the end ids it hands to ``generate_text`` are now the
    tokenizer's end-of-text id; ``--ignore-eos`` still gives none."""
    import mnemo.train
    from mnemo.cli import main

    tok, _ = _bpe_folder(tmp_path / "ckpt")
    assert (tok.eot_token, tok.eot_id) == ("<|endoftext|>", 0)
    seen = {}

    def fake(model, tokenizer, prompt, n, **kw):
        seen.update(kw)
        return prompt

    monkeypatch.setattr(mnemo.train, "generate_text", fake)
    args = [
        "generate",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "3",
    ]
    assert main(args + (["--ignore-eos"] if ignore else [])) == 0
    assert capsys.readouterr().out == "the cat\n"
    assert seen["eos"] == (None if ignore else [0])


def test_load_corpus_expands_a_home_folder_in_a_path_and_a_glob(tmp_path, monkeypatch):
    """``load_corpus("~/corpus/*.txt")`` globbed the literal ``~`` (no match: FileNotFoundError) while
    ``mnemo train`` and a sweep expand it first."""
    from mnemo.data.corpus import load_corpus

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("alpha")
    (tmp_path / "corpus" / "b.txt").write_text("beta")
    assert load_corpus("~/corpus/*.txt").documents == ["alpha", "beta"]
    assert load_corpus("~/corpus/a.txt").documents == ["alpha"]
    assert load_corpus("~/corpus").documents == ["alpha", "beta"]


def test_autoconfig_reads_the_special_ids_of_a_saved_mnemo_folder(tmp_path):
    """``AutoConfig.from_pretrained`` of a folder ``MnemoForCausalLM.save_pretrained`` wrote had no
    special ids: mnemo's ``config.json`` left them out (they lived only in ``generation_config.json``
    / ``hf_config_carried.json``, which ``MnemoForCausalLM.from_pretrained`` reads and ``AutoConfig``
    does not). ``config.json`` now holds the ids that are set; mnemo's loaders skip them."""
    transformers = pytest.importorskip("transformers")
    import mnemo.hf  # noqa: F401  (registers the mnemo model type)
    from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM
    from mnemo.models import LanguageModel, ModelConfig

    tok, lm = _bpe_folder(tmp_path / "ckpt")
    m = MnemoForCausalLM.from_pretrained(tmp_path / "ckpt", pad_token_id=3)
    m.save_pretrained(tmp_path / "again")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "again")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (None, tok.eot_id, 3)
    assert LanguageModel.from_pretrained(tmp_path / "again").config == lm.config  # mnemo still loads it
    back = MnemoForCausalLM.from_pretrained(tmp_path / "again")
    assert (back.config.eos_token_id, back.config.pad_token_id) == (tok.eot_id, 3)
    assert (back.generation_config.eos_token_id, back.generation_config.pad_token_id) == (tok.eot_id, 3)
    # MnemoConfig.save_pretrained too; a config without ids writes none (old folders unchanged)
    MnemoConfig.from_model_config(lm.config, bos_token_id=1).save_pretrained(tmp_path / "cfg")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "cfg").bos_token_id == 1
    assert ModelConfig.load(tmp_path / "cfg" / "config.json") == lm.config
    MnemoConfig.from_model_config(lm.config).save_pretrained(tmp_path / "plain")
    written = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & set(written)
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['eos_id'\]"):
        ModelConfig.from_dict({**lm.config.to_dict(), "eos_id": 1})
