"""Linear attention: the seed formula, feature maps, FAVOR+ convergence to softmax attention."""

from __future__ import annotations

import pytest
import torch

from mnemo.ops import FavorPlus, linear_attention, softmax_attention, taylor
from mnemo.ops.feature_maps import FEATURE_MAPS
from tests.helpers import assert_close, rel_rms


def _inputs(B=2, T=23, H=2, K=4, V=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, generator=g, dtype=dtype) for d in (K, K, V))


def _seed_formula(q, k, v, phi, normalize, eps=1e-6):
    """o_i = Σ_{j≤i} φ(q_i)ᵀφ(k_j) v_j  (/ Σ_{j≤i} φ(q_i)ᵀφ(k_j)) written as explicit sums."""
    qf, kf = phi(q * q.shape[-1] ** -0.5), phi(k)
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for i in range(T):
        w = torch.einsum("bhf,bjhf->bjh", qf[:, i], kf[:, : i + 1])  # [B, i+1, H]
        num = torch.einsum("bjh,bjhv->bhv", w, v[:, : i + 1])
        out[:, i] = num / (w.sum(1)[..., None] + eps) if normalize else num
    return out


# identity features can make the normaliser zero, so the normalised formula is only for positive maps
CASES = [(n, False) for n in ("identity", "elu", "relu", "taylor")] + [
    (n, True) for n in ("elu", "relu", "taylor")
]


@pytest.mark.parametrize("name, normalize", CASES)
@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
def test_matches_seed_formula(name, normalize, mode):
    q, k, v = _inputs()
    if name == "relu" and normalize:
        q, k = q.abs() + 0.1, k.abs() + 0.1  # keep the relu normaliser away from zero
    o, _ = linear_attention(q, k, v, feature_map=name, normalize=normalize, mode=mode, chunk_size=8)
    assert_close(o, _seed_formula(q, k, v, FEATURE_MAPS[name], normalize), 1e-10)


def test_normaliser_lives_in_last_state_column():
    q, k, v = _inputs()
    _, S = linear_attention(q, k, v, feature_map="elu", normalize=True, output_final_state=True)
    kf = FEATURE_MAPS["elu"](k)
    assert S.shape == (2, 2, 4, 4)
    assert_close(S[..., -1], kf.sum(1), 1e-12)


def test_taylor_kernel_is_second_order_exp():
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(10, 5, generator=g, dtype=torch.float64),
        torch.randn(10, 5, generator=g, dtype=torch.float64),
    )
    dot = (x * y).sum(-1)
    assert_close((taylor(x) * taylor(y)).sum(-1), 1 + dot + dot**2 / 2, 1e-12)


def test_favor_plus_converges_to_softmax_attention():
    """The FAVOR+ estimate approaches softmax attention as the number of random features grows
    (Monte-Carlo error ~ 1/sqrt(m)); errors averaged over 8 draws of the projection."""
    q, k, v = _inputs(B=1, T=32, H=2, K=8, V=4, dtype=torch.float64, seed=1)
    q, k = 0.4 * q, 0.4 * k
    exact, _ = softmax_attention(q, k, v)
    errs = {}
    for m in (16, 256, 4096):
        e = [
            rel_rms(
                linear_attention(q, k, v, feature_map=FavorPlus(8, m, seed=s), normalize=True, eps=0.0)[0],
                exact,
            )
            for s in range(8)
        ]
        errs[m] = sum(e) / len(e)
    assert errs[16] > errs[256] > errs[4096], errs
    assert errs[4096] < errs[16] / 5, errs
    assert errs[4096] < 0.05, errs


def test_favor_plus_kernel_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x, y = (
        0.5 * torch.randn(6, 4, generator=g, dtype=torch.float64),
        0.5 * torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    for orthogonal in (False, True):
        fm = FavorPlus(4, 200_000, seed=3, orthogonal=orthogonal)
        est = (fm(x) * fm(y)).sum(-1)
        assert_close(est, (x * y).sum(-1).exp(), 1e-2)


def test_bad_inputs():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="feature_map must be"):
        linear_attention(q, k, v, feature_map="cosine")
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, K, V\] = \[2, 2, 4, 4\]"):
        linear_attention(q, k, v, normalize=True, initial_state=torch.zeros(2, 2, 4, 3, dtype=q.dtype))
    with pytest.raises(ValueError, match="FavorPlus expects inputs with last dim 8"):
        linear_attention(q, k, v, feature_map=FavorPlus(8, 16))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention(q, k, v, chunk_size=0)
