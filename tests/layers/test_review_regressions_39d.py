"""Regression review of 2224060 (float64 buffers, the retnet preset's value width, RMSNorm checks)
and 03cb509 (``state.nbytes`` docstring)."""

from __future__ import annotations

import json

import torch

from mnemo.layers.state import nbytes, snapshot, tensors, to
from mnemo.models import LanguageModel, build_config


def test_a_retnet_saved_before_the_wider_preset_still_loads(tmp_path):
    """2224060 made the ``retnet`` preset ``expand_v=2.0``. A saved config names only the options
    given (``{"retnet": {"n_heads": 4}}``), so every retnet folder written before it stopped loading
    ("corrupt or incompatible weights file ... size mismatch"), in ``from_pretrained`` and all its
    readers (``mnemo eval``, ``probe``, ``convert``, ``MnemoForCausalLM``). Its weights say the old
    width: it loads with ``expand_v=1.0``, outputs unchanged."""
    torch.manual_seed(0)
    old_cfg = build_config(
        "retnet",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        mixer_options={"retnet": {"n_heads": 4, "expand_v": 1.0}},
    )
    old = LanguageModel(old_cfg).eval()
    old.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["mixer_options"]["retnet"]["expand_v"]  # what the preset wrote before 2224060
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = LanguageModel.from_pretrained(tmp_path).eval()
    assert back.config.mixer_options["retnet"] == {"n_heads": 4, "expand_v": 1.0}
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids)[0], old(ids)[0])
    # a folder of the new width loads as it is (nothing added)
    new = LanguageModel(build_config("retnet", vocab_size=64, d_model=32, n_layers=2))
    new.save_pretrained(tmp_path / "new")
    again = LanguageModel.from_pretrained(tmp_path / "new")
    assert again.config.mixer_options["retnet"] == {"n_heads": 4}
    assert again.blocks[0].mixer.value_dim == 2 * 32 // 4


def test_nbytes_counts_a_shared_tensor_per_place_while_copies_and_moves_hold_it_once():
    """03cb509's docstring said ``nbytes`` is the size "with each entry held on its own (saved,
    copied or moved to another device)"; but ``snapshot`` / ``to`` (``map_tensors``) keep a tensor
    shared between places shared. At a chunk boundary a self-modifying memory's anchor *is* its
    weights: nbytes (and ``state_size_bytes``) count it twice, a copy or a move holds it once."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope", vocab_size=32, d_model=32, n_layers=1))
    with torch.no_grad():
        _, st = m(torch.randint(0, 32, (1, 16)))
    mem = st[0].mixer
    assert all(a is b for a, b in zip(mem.memory, mem.memory_anchor))

    def held(s) -> int:
        return sum({id(t): t.numel() * t.element_size() for t in tensors(s)}.values())

    assert nbytes(st) == m.state_size_bytes(1, 16)
    assert held(snapshot(st)) == held(st) < nbytes(st)
    assert held(to(st, "cpu", copy=True)) == held(st)
    doc = " ".join(nbytes.__doc__.split())
    assert "copied or moved" not in doc
