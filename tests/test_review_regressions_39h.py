"""Regression review 39h (of 5bb13bc, 210d5ea + e29f097 and 0a81c24): each test failed before its fix."""

from __future__ import annotations

import pytest
import torch

from mnemo.models import LanguageModel, build_config


def test_the_self_modifying_projections_mixer_reads_a_batch_of_zero_rows():
    """5bb13bc let the CMS's ``_mm`` take a batch of 0 rows (``W[0]`` of an empty batch), but its
    twin in :mod:`mnemo.layers.self_modifying_projections` kept ``W[0]``: a model of that mixer
    (no preset uses it, so the every-preset test missed it) crashed with an IndexError where every
    other mixer gives ``[0, T, vocab]`` logits and carries its state."""
    torch.manual_seed(0)
    cfg = build_config(
        "transformer",
        mixer="self_modifying_projections",
        vocab_size=19,
        d_model=16,
        n_layers=1,
        mixer_options={},
    )
    model = LanguageModel(cfg)
    logits, state = model(torch.zeros(0, 5, dtype=torch.long))
    assert logits.shape == (0, 5, 19)
    more, _ = model(torch.zeros(0, 3, dtype=torch.long), state=state)
    assert more.shape == (0, 3, 19)


def test_the_shared_weights_fast_path_of_the_projections_mixer_is_kept():
    """The fix keeps the one ``[B·L, i] @ [i, o]`` product for weights expanded over a batch of
    ``B >= 1`` (same values as the per-sample product)."""
    from mnemo.layers.self_modifying_projections import _mm

    x, w = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    W = w.expand(3, 5, 2)
    assert torch.equal(_mm(x, W), x @ w)
    assert torch.allclose(_mm(x, W), x @ W.contiguous(), rtol=0, atol=1e-12)
    assert _mm(x[:0], W[:0]).shape == (0, 4, 2)


def test_a_numpy_top_k_is_refused_naming_its_type_as_max_new_tokens_is():
    """210d5ea made ``max_new_tokens=np.int64(5)``'s refusal name the type (numpy 1 prints a bare 5,
    which reads as if 5 were wrong), but its twin check in the same function, ``top_k``, kept the
    bare value: ``top_k=np.int64(3)`` read "expected an int >= 1 or None, got 3"."""
    np = pytest.importorskip("numpy")
    model = LanguageModel(build_config("gla", vocab_size=11, d_model=16, n_layers=1))
    with pytest.raises(ValueError, match=r"top_k: expected an int >= 1 or None, got \S*3\)? \(int64\)"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, top_k=np.int64(3))
