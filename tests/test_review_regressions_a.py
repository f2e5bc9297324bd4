"""Regressions found by reviewing the day's break-it fixes (interventions, hook points, capacity,
the equivalence contract): input those fixes began to refuse although it worked before."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mnemo.interp.capacity import recall_accuracy
from mnemo.interp.interventions import induction_ablation, logit_difference
from mnemo.models import LanguageModel, build_config

V = 17


@pytest.mark.parametrize("position", [np.int64(-2), torch.tensor(-2), 3], ids=["numpy", "tensor", "int"])
def test_logit_difference_takes_an_integer_position_of_numpy_or_torch(position):
    """dd1a52e made ``position`` an ``int`` instance only: a numpy or 0-d torch integer (an index
    taken from an array), which indexed the logits before, was refused at once."""
    logits = torch.randn(2, 5, V, generator=torch.Generator().manual_seed(0))
    want = (logits[:, -2, 1] - logits[:, -2, 2]).mean()
    torch.testing.assert_close(logit_difference(1, 2, position=position)(logits), want)
    for bad in (1.0, True, torch.tensor(1.5)):  # still refused
        with pytest.raises(ValueError, match="position: expected an int"):
            logit_difference(1, 2, position=bad)


def test_induction_ablation_takes_a_numpy_integer_draw_count():
    """dd1a52e: ``draws=np.int64(1)`` (``draws < 1`` accepted it) was refused; the result records a
    plain int (JSON-serialisable)."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("transformer", vocab_size=V, d_model=32, n_layers=2)).double().eval()
    with warnings.catch_warnings():  # an untrained model: maybe no in-context gain to remove
        warnings.simplefilter("ignore")
        out = induction_ablation(m, 1, draws=np.int64(1), length=4, batch=2)
    assert out["draws"] == 1 and type(out["draws"]) is int


def test_recall_of_ordinary_reads_rounds_as_the_published_rule():
    """32ea3d4 rescaled every read by its largest entry before normalising (meant for reads whose
    squared norm overflows): the cosines of all reads then round differently, and near-ties flip
    (a reported cell of docs/results/titans_capacity_chunk8 moved: mlp_equal, 32 pairs, seed 1,
    0.22021 -> 0.22009). Reads of an ordinary norm keep ``F.normalize``'s cosines; only a tie
    (equal cosines) is now a miss. Here each stream's two values have equal cosines with the read
    in exact arithmetic (one is the other reflected in a plane holding the read), so float32
    rounding alone decides."""
    g = torch.Generator().manual_seed(0)
    B, D = 2048, 16
    y = torch.randn(B, D, generator=g, dtype=torch.float64) * 3
    v = torch.randn(B, D, generator=g, dtype=torch.float64)
    u = torch.randn(B, D, generator=g, dtype=torch.float64)
    u = F.normalize(u - (u * y).sum(-1, keepdim=True) / (y * y).sum(-1, keepdim=True) * y, dim=-1)
    w = v - 2 * (u * v).sum(-1, keepdim=True) * u  # reflected in the plane orthogonal to u (holds y)
    reads = y.float()[:, None, None].expand(B, 2, 1, D).contiguous()  # [B, N=2, H=1, D]: one read twice
    values = torch.stack([v, w], 1).float()[:, :, None]
    sim = torch.einsum("bihd,bjhd->bhij", F.normalize(reads, dim=-1), F.normalize(values, dim=-1))[:, 0]
    own, other = sim.diagonal(dim1=-2, dim2=-1), sim.flip(-1).diagonal(dim1=-2, dim2=-1)
    want = (own > other).float().mean(-1)
    assert torch.equal(recall_accuracy(reads, values), want)
