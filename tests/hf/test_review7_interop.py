"""Seventh review of the Hugging Face interop: a 1-D bool ``logits_to_keep`` as ``transformers`` takes
it, a converted folder's carried fields through save -> reload -> export, a BPE run's
``<|endoftext|>`` as the end-of-text id of the model loaded directly (as of its export)."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from mnemo.hf.convert import CARRIED_CONFIG_NAME, convert, export_hf  # noqa: E402
from mnemo.hf.modeling import MnemoForCausalLM  # noqa: E402
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402

VOCAB = 40


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _mamba_folder(path, **ids):
    """A tiny random ``MambaForCausalLM`` saved to ``path`` (its generation_config.json removed, so
    that the ids live in config.json alone: those convert keeps in hf_config_carried.json)."""
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4, **ids
    )
    transformers.MambaForCausalLM(cfg).save_pretrained(path)
    (path / "generation_config.json").unlink()
    return path


# ---------------------------------------------------------------------------------------------
# part 1: the previous session's leftovers


def test_a_1d_bool_logits_to_keep_keeps_those_positions_of_every_row_as_transformers():
    """``logits_to_keep`` as a 1-D bool ``[T]`` was refused; ``transformers`` 5 (its
    ``slice_logits_to_keep``: ``hidden[:, keep, :]``) keeps those positions of every row, ``[B, kept, V]``.
    A mask of another length is refused naming the expected shape (it was a bare IndexError)."""
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([True, False, False, True, True, False])
    llama = _llama()
    assert llama(ids, logits_to_keep=keep).logits.shape == (2, 3, VOCAB)
    torch.testing.assert_close(
        llama(ids, logits_to_keep=keep).logits, llama(ids).logits[:, [0, 3, 4]], rtol=0, atol=1e-6
    )
    m = tiny_mnemo_for_causal_lm("mamba", 0, VOCAB)
    full = m(ids).logits
    got = m(ids, logits_to_keep=keep).logits
    assert got.shape == (2, 3, VOCAB)
    torch.testing.assert_close(got, full[:, [0, 3, 4]], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"logits_to_keep: a bool mask must be \[T\] = \[6\].*got \[5\]"):
        m(ids, logits_to_keep=keep[:5])
    with pytest.raises(
        ValueError, match=r"logits_to_keep: a bool mask must be \[B, T\] = \[2, 6\].*\[1, 6\]"
    ):
        m(ids, logits_to_keep=keep[None])
    with pytest.raises(ValueError, match=r"logits_to_keep: expected .* got a 0-D torch.bool tensor"):
        m(ids, logits_to_keep=torch.tensor(True))


def test_save_pretrained_of_a_converted_model_keeps_its_carried_fields_through_export(tmp_path):
    """A converted folder loaded and saved again lost ``hf_config_carried.json``: the generation
    config kept the ids, but ``export_hf`` of the saved folder wrote bos / eos / pad as null and
    ``residual_in_fp32`` as the class default (True where the source said False). Now the saved folder
    carries the record and its export equals the export of the converted folder."""
    src = _mamba_folder(
        tmp_path / "src", bos_token_id=3, eos_token_id=5, pad_token_id=7, residual_in_fp32=False
    )
    with pytest.warns(UserWarning, match="holds no tokenizer"):
        convert(src, tmp_path / "conv")
    m = MnemoForCausalLM.from_pretrained(tmp_path / "conv")
    m.save_pretrained(tmp_path / "save1")
    m2 = MnemoForCausalLM.from_pretrained(tmp_path / "save1")
    m2.save_pretrained(tmp_path / "save2")
    record = json.loads((tmp_path / "conv" / CARRIED_CONFIG_NAME).read_text())
    assert json.loads((tmp_path / "save2" / CARRIED_CONFIG_NAME).read_text()) == record
    assert record["fields"] == {
        "bos_token_id": 3,
        "eos_token_id": 5,
        "pad_token_id": 7,
        "residual_in_fp32": False,
    }
    fields = ("bos_token_id", "eos_token_id", "pad_token_id", "residual_in_fp32")
    with pytest.warns(UserWarning, match="holds no tokenizer"):
        export_hf(tmp_path / "save2", tmp_path / "exp")
    exported = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert {k: exported[k] for k in fields} == record["fields"]
    assert (m2.generation_config.bos_token_id, m2.generation_config.eos_token_id) == (3, 5)
    assert (m2.config.pad_token_id, m2.config.eos_token_id) == (7, 5)


def _bpe_folder(path):
    """A mnemo Mamba checkpoint with a byte-level BPE tokenizer of ``mnemo tokenizer train``."""
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
    return tok


def test_a_bpe_checkpoint_ends_text_at_its_endoftext_as_its_export_does(tmp_path):
    """A BPE run's ``<|endoftext|>`` (id 0) is the export's ``eos_token_id`` (config.json,
    tokenizer_config.json's ``eos_token``, hence ``transformers``' generation config), but
    ``MnemoForCausalLM.from_pretrained`` of the checkpoint itself had no end-of-text id: the same
    model generated past the end of a text loaded directly and stopped there loaded from its export.
    Now the direct load takes the tokenizer's end-of-text id too (config and generation config), and
    it survives save_pretrained to a folder without the tokenizer."""
    tok = _bpe_folder(tmp_path / "ckpt")
    assert tok.eot_token == "<|endoftext|>" and tok.eot_id == 0
    export_hf(tmp_path / "ckpt", tmp_path / "exp")
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["eos_token_id"] == tok.eot_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp")
    assert hf.generation_config.eos_token_id == tok.eot_id
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "exp").eos_token_id == tok.eot_id
    m = MnemoForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert m.generation_config.eos_token_id == tok.eot_id and m.config.eos_token_id == tok.eot_id
    assert m.config.bos_token_id is None and m.config.pad_token_id is None
    m.save_pretrained(tmp_path / "again")  # (no tokenizer there: generation_config.json keeps it)
    assert MnemoForCausalLM.from_pretrained(tmp_path / "again").generation_config.eos_token_id == tok.eot_id
    # an id given to from_pretrained still wins
    assert (
        MnemoForCausalLM.from_pretrained(tmp_path / "ckpt", eos_token_id=5).generation_config.eos_token_id
        == 5
    )
