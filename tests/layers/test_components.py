"""Short convolution, rotary embeddings, RMSNorm, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mnemo.layers import RMSNorm, RotaryEmbedding, ShortConvolution, SwiGLU
from tests.helpers import assert_close


def test_short_conv_is_causal_depthwise_conv():
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    y, _ = conv(x)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, conv.bias, groups=6).transpose(1, 2)
    assert_close(y, F.silu(ref), 1e-12)


def test_short_conv_streams_in_pieces_shorter_than_its_width():
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(1, 9, 5, dtype=torch.float64)
    full, _ = conv(x)
    outs, state = [], None
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 9)]:
        y, state = conv(x[:, a:b], state)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full, 1e-12)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8).double()
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64),
    )

    def score(m, n):
        return (rope(q, m) * rope(k, n)).sum()

    assert torch.allclose(score(5, 2), score(103, 100))
    assert torch.allclose(score(0, 0), (q * k).sum())
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_rmsnorm_and_swiglu_shapes_and_values():
    x = torch.randn(3, 4, 16)
    n = RMSNorm(16)
    assert_close(n(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt(), 1e-6)
    mlp = SwiGLU(16)
    assert mlp(x).shape == x.shape
    assert mlp.w_in.out_features == 2 * 64  # 8/3 * 16 -> 42 -> rounded up to a multiple of 32
