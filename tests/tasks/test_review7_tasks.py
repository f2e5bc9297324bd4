"""Seventh break-it review of the recall tasks, the task metrics and the circuit scores."""

from __future__ import annotations

import re

import torch

from mnemo.data.tasks import IGNORE_INDEX, MQAR, build_task

# --------------------------------------------------------------------------------------------
# MQAR's random filler against Zoology's
# --------------------------------------------------------------------------------------------


def test_mqar_names_where_its_random_filler_leaves_zoology():
    """Zoology's published configs use filler 0 (``random_non_queries=False``, here ``"pad"``); its
    code's default (``random_non_queries=True``) replaces every filler 0 by a token drawn from the
    whole vocabulary ``[0, V)``, keys included; here ``filler="random"`` (the default) draws from
    the value half only, neither of the two. The docstring said "as in Zoology" for the layout and
    named no deviation for the filler."""
    V, N, T = 16, 2, 24
    x, y = build_task("mqar", vocab_size=V, num_pairs=N).sample(64, T, seed=0)
    rest = y == IGNORE_INDEX
    rest[:, : 2 * N] = False
    rest &= x < V // 2  # filler that looks like a key: the query keys only, here
    assert not rest.any()
    doc = " ".join(MQAR.__doc__.split())
    assert "random_non_queries=False" in doc and "random_non_queries=True" in doc and "[0, V)" in doc
    assert "Not Zoology's random filler" in doc


# --------------------------------------------------------------------------------------------
# the copying score's product, as its docstring names it
# --------------------------------------------------------------------------------------------


def test_the_copying_score_docstring_names_the_d_by_d_product_it_computes():
    """The docstring named the ``D × D`` product ``W_V^h W_O^h W_U W_E``, which with the shapes of
    :meth:`Attention.ov_matrices` (``W_V^h [d_model, D]``) is ``d_model × d_model``; the code
    computes ``W_O^h W_U W_E W_V^h``. The named product, evaluated, must be ``D × D`` and give the
    score (its eigenvalues are the ``V × V`` OV circuit's, less zeros)."""
    from mnemo.interp import copying_score
    from mnemo.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=11,
        d_model=8,
        n_layers=1,
        mixer="attention",
        mixer_options={"attention": {"n_heads": 2}},
        tie_embeddings=False,
    )
    m = LanguageModel(cfg).double()
    doc = " ".join(copying_score.__doc__.split())
    named = re.search(r"``D × D`` product[^`]*``([^`]+)``", doc).group(1).split()
    got = copying_score(m, 0)
    for h, (Wv, Wo) in enumerate(m.blocks[0].mixer.ov_matrices()):
        mats = {
            "W_V^h": Wv,
            "W_O^h": Wo,
            "W_E": m.embed.weight.detach(),
            "W_U": m.lm_head.weight.detach().T,
        }
        prod = mats[named[0]]
        for name in named[1:]:
            prod = prod @ mats[name]
        D = Wv.shape[1]
        assert D != Wv.shape[0] and prod.shape == (D, D)
        lam = torch.linalg.eigvals(prod)
        assert abs(float((lam.sum() / lam.abs().sum()).real) - float(got[h])) < 1e-12
        # and the V × V circuit by hand: the same score
        full = torch.linalg.eigvals(mats["W_E"] @ Wv @ Wo @ mats["W_U"])
        assert abs(float((full.sum() / full.abs().sum()).real) - float(got[h])) < 1e-10
