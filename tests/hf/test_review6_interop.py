"""Sixth review of the Hugging Face interop: ``logits_to_keep`` tensors as ``transformers`` slices them,
special token ids of the config through save -> reload, and the defects of the break-it pass."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM  # noqa: E402
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402

VOCAB = 40


def _mnemo(mixer: str = "mamba", seed: int = 0, **over) -> MnemoForCausalLM:
    return tiny_mnemo_for_causal_lm(mixer, seed, VOCAB, **over)


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


# ---------------------------------------------------------------------------------------------
# part 1: the previous session's leftovers


@pytest.mark.parametrize(
    "keep",
    [
        torch.tensor(3),  # 0-d: transformers indexes ONE position (the axis goes), not "the last 3"
        torch.tensor(0),
        torch.tensor([1, 4]),
        torch.tensor([[0, 5], [2, 3]]),  # 2-D integer: positions per row
        torch.tensor([[False, True, False, False, False, False], [False, False, False, False, True, True]]),
    ],
    ids=["0d", "0d-zero", "1d", "2d-int", "2d-bool"],
)
def test_logits_to_keep_tensors_are_sliced_as_transformers_slices_them(keep):
    """``logits_to_keep=torch.tensor(3)`` (and a 2-D tensor) was refused; ``transformers`` (5.x, its
    ``slice_logits_to_keep``) takes every tensor: a 0-d one is the index of one position (the logits
    come back ``[B, V]``), a 2-D integer one positions per row, a 2-D bool one a mask (flattened)."""
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    ref = _llama()
    with torch.no_grad():
        ref_full, ref_kept = ref(ids).logits, ref(ids, logits_to_keep=keep).logits
    m = _mnemo()
    with torch.no_grad():
        full, kept = m(ids).logits, m(ids, logits_to_keep=keep).logits
    assert kept.shape == ref_kept.shape
    # the same selection of positions from each model's full logits
    # (transformers slices before its head: the same values up to float32 rounding; mnemo after)
    for full_, kept_, tol in ((ref_full, ref_kept, 1e-6), (full, kept, 0.0)):
        if keep.ndim == 2 and keep.dtype == torch.bool:
            want = full_[keep]
        elif keep.ndim == 2:
            want = torch.stack([full_[b, keep[b]] for b in range(2)])
        else:
            want = full_[:, keep]
        torch.testing.assert_close(kept_, want, rtol=tol, atol=tol)


def test_logits_to_keep_refuses_a_float_tensor_by_name():
    with pytest.raises(ValueError, match=r"logits_to_keep: .*got a 0-D torch.float32 tensor"):
        _mnemo()(torch.tensor([[1, 2, 3]]), logits_to_keep=torch.tensor(1.0))


def test_special_ids_of_the_config_survive_save_and_reload(tmp_path):
    """``from_pretrained(path, pad_token_id=3)`` sets ``config.pad_token_id``; after ``save_pretrained``
    and a reload only ``generation_config`` had it (mnemo's ``config.json`` holds no token ids). A
    ``transformers`` model keeps it in its config; now the reloaded config takes it back from
    ``generation_config.json``."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", pad_token_id=3, eos_token_id=5)
    ref.save_pretrained(tmp_path / "gpt2-again")
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2-again")
    assert (ref.config.pad_token_id, ref.config.eos_token_id) == (3, 5)

    _mnemo().save_pretrained(tmp_path / "m")
    m = MnemoForCausalLM.from_pretrained(tmp_path / "m", pad_token_id=3, eos_token_id=5, bos_token_id=1)
    m.save_pretrained(tmp_path / "again")
    back = MnemoForCausalLM.from_pretrained(tmp_path / "again")
    assert (back.config.pad_token_id, back.config.eos_token_id, back.config.bos_token_id) == (3, 5, 1)
    assert (back.generation_config.pad_token_id, back.generation_config.eos_token_id) == (3, 5)
    # and once more (save -> reload -> save -> reload)
    back.save_pretrained(tmp_path / "third")
    third = MnemoForCausalLM.from_pretrained(tmp_path / "third")
    assert (third.config.pad_token_id, third.config.eos_token_id, third.config.bos_token_id) == (3, 5, 1)
    # an argument still wins over the folder's; an old folder (no generation_config.json) has none
    assert MnemoForCausalLM.from_pretrained(tmp_path / "third", pad_token_id=7).config.pad_token_id == 7
    old = MnemoForCausalLM.from_pretrained(tmp_path / "m")
    assert (old.config.pad_token_id, old.config.eos_token_id, old.config.bos_token_id) == (None,) * 3
    # (declared, as transformers' model configs declare them: None, not an AttributeError)
    assert (MnemoConfig().pad_token_id, MnemoConfig().bos_token_id, MnemoConfig().eos_token_id) == (None,) * 3
    # through the Auto class too
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "third")
    assert (auto.config.pad_token_id, auto.config.eos_token_id) == (3, 5)


def test_a_converted_folder_config_takes_the_source_config_ids(tmp_path):
    """A converted folder holding both ``generation_config.json`` (end ids ``[5, 6]``) and the source's
    ``config.json`` ids (``hf_config_carried.json``, eos 5): as ``transformers`` loads the source, the
    config's ids are the source config's and the generation config's its file's."""
    from mnemo.hf.convert import CARRIED_CONFIG_NAME

    _mnemo().save_pretrained(tmp_path)
    (tmp_path / CARRIED_CONFIG_NAME).write_text(
        json.dumps(
            {"source_architecture": "MambaForCausalLM", "fields": {"eos_token_id": 5, "bos_token_id": 0}}
        )
    )
    transformers.GenerationConfig(eos_token_id=[5, 6], bos_token_id=0).save_pretrained(tmp_path)
    m = MnemoForCausalLM.from_pretrained(tmp_path)
    assert (m.config.eos_token_id, m.config.bos_token_id, m.config.pad_token_id) == (5, 0, None)
    assert m.generation_config.eos_token_id == [5, 6]


# ---------------------------------------------------------------------------------------------
# part 2: the break-it pass


def test_save_pretrained_on_a_non_main_process_writes_nothing(tmp_path):
    """``transformers.Trainer`` calls ``save_pretrained(dir, state_dict=..., is_main_process=False)`` on
    every rank but the writer; mnemo ignored ``is_main_process`` and every rank wrote the same files at
    once. As ``transformers``: only the main process writes."""
    m = _mnemo()
    m.save_pretrained(tmp_path / "other", is_main_process=False)
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())
    m.save_pretrained(tmp_path / "main", is_main_process=True, state_dict=None)
    assert (tmp_path / "main" / "model.safetensors").is_file()


def test_save_pretrained_refuses_a_state_dict_it_would_not_write(tmp_path):
    """A ``state_dict`` given to ``save_pretrained`` (FSDP's gathered one, an edited one) was silently
    replaced by the model's own weights. The model's own (or a ``torch.compile`` wrapper's, as the
    ``Trainer`` passes it) is accepted; another is refused by name."""
    m = _mnemo()
    own = m.state_dict()
    m.save_pretrained(tmp_path / "own", state_dict=own)
    m.save_pretrained(tmp_path / "compiled", state_dict={f"_orig_mod.{k}": v for k, v in own.items()})
    back = MnemoForCausalLM.from_pretrained(tmp_path / "compiled")
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(back(ids).logits, m(ids).logits, rtol=0, atol=0)
    edited = {k: v.clone() for k, v in own.items()}
    edited["model.embed.weight"] += 1
    with pytest.raises(NotImplementedError, match=r"state_dict: .*differs in \['model.embed.weight'"):
        m.save_pretrained(tmp_path / "edited", state_dict=edited)
    with pytest.raises(NotImplementedError, match=r"state_dict: .*differs in \['model.embed.weight'\]"):
        m.save_pretrained(tmp_path / "missing", state_dict={k: v for k, v in own.items() if "embed" not in k})
