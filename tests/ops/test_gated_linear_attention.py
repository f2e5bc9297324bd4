"""Gated linear attention beyond the generic contract: gates, extremes, dtypes, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.ops import gated_linear_attention, linear_attention
from tests.helpers import assert_close


def _inputs(B=1, T=40, H=2, K=8, V=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=dtype) for d in (K, K, V))
    return q, k, v, g


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
def test_zero_gate_is_linear_attention(mode):
    q, k, v, _ = _inputs()
    o1, s1 = gated_linear_attention(
        q, k, v, torch.zeros(1, 40, 2, dtype=q.dtype), mode=mode, output_final_state=True
    )
    o2, s2 = linear_attention(q, k, v, mode=mode, output_final_state=True)
    assert_close(o1, o2, 1e-12)
    assert_close(s1, s2, 1e-12)


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
def test_scalar_gate_equals_broadcast_channel_gate(mode):
    q, k, v, gen = _inputs()
    g = F.logsigmoid(torch.randn(1, 40, 2, generator=gen, dtype=q.dtype))
    o1, _ = gated_linear_attention(q, k, v, g, mode=mode, chunk_size=16)
    o2, _ = gated_linear_attention(q, k, v, g[..., None].expand(-1, -1, -1, 8), mode=mode, chunk_size=16)
    assert_close(o1, o2, 1e-12)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
def test_minus_inf_gate_is_a_hard_reset(per_channel, mode):
    """A gate of -inf at position a: the output equals running x[a:] alone, with no NaN."""
    q, k, v, gen = _inputs(T=50)
    shape = (1, 50, 2, 8) if per_channel else (1, 50, 2)
    g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=q.dtype))
    a = 21  # not on a chunk boundary
    g[:, a] = float("-inf")
    S0 = torch.randn(1, 2, 8, 4, dtype=q.dtype, generator=gen)
    o, s = gated_linear_attention(
        q, k, v, g, initial_state=S0, mode=mode, output_final_state=True, chunk_size=16
    )
    g2 = g[:, a:].clone()
    g2[:, 0] = 0.0
    o2, s2 = gated_linear_attention(
        q[:, a:], k[:, a:], v[:, a:], g2, mode=mode, output_final_state=True, chunk_size=16
    )
    assert torch.isfinite(o).all()
    assert_close(o[:, a:], o2, 1e-10)
    assert_close(s, s2, 1e-10)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_decays_stay_finite(per_channel, dtype):
    """Very strong decays (log gate down to -200 per token) over long chunks: finite outputs and
    gradients, and the chunk form still matches the reference."""
    q, k, v, gen = _inputs(T=300, K=16, V=16, dtype=torch.float32)
    shape = (1, 300, 2, 16) if per_channel else (1, 300, 2)
    g = -200 * torch.rand(shape, generator=gen)
    g[:, ::7] = -1e-3  # mix with near-zero decays
    args = [t.to(dtype).requires_grad_(True) for t in (q, k, v, g)]
    o, _ = gated_linear_attention(*args, chunk_size=128)
    o.float().square().sum().backward()
    assert torch.isfinite(o.float()).all()
    for t in args:
        assert torch.isfinite(t.grad.float()).all()
    ref, _ = gated_linear_attention(q.double(), k.double(), v.double(), g.double(), mode="recurrent")
    # cumulative log gates reach -60 * 128 inside a chunk; fp32 keeps ~1e-4 of relative precision there
    assert_close(o.float(), ref, 2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize(
    "safe_span", [float("inf"), 6.0, -1.0], ids=["one-matmul", "sub-block-matmul", "exact"]
)
def test_channel_score_paths_agree_with_the_definition(safe_span):
    """The three ways of forming per-channel intra-chunk scores (chosen by how far the chunk decays)
    all equal ``Σ_k q_tk k_sk exp(b_tk − b_sk)``; the test forces each path."""
    from mnemo.ops.gated_linear_attention import _intra_chunk_channel_scores

    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, 3, 64, 8, generator=gen, dtype=torch.float64),
        torch.randn(2, 3, 64, 8, generator=gen, dtype=torch.float64),
    )
    b = (F.logsigmoid(torch.randn(2, 3, 64, 8, generator=gen, dtype=torch.float64)) / 4).cumsum(-2)
    span_chunk = float(-b[..., -1, :].min())
    span_sub = float(-(b[..., 16:, :] - b[..., :-16, :]).min())
    assert span_sub < 6.0 < span_chunk  # so 6.0 really selects the sub-block path
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    ref = (q[..., :, None, :] * k[..., None, :, :] * (b[..., :, None, :] - b[..., None, :, :]).exp()).sum(-1)
    ref = ref.masked_fill(~mask, 0.0)
    assert_close(_intra_chunk_channel_scores(q, k, b, safe_span=safe_span), ref, 1e-12)


def test_bf16_inputs_accumulate_in_fp32():
    q, k, v, gen = _inputs(T=128, K=16, V=16, dtype=torch.float32)
    g = F.logsigmoid(torch.randn(1, 128, 2, 16, generator=gen)) / 8
    o, s = gated_linear_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), g.bfloat16(), output_final_state=True
    )
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ref, _ = gated_linear_attention(
        q.bfloat16().float(),
        k.bfloat16().float(),
        v.bfloat16().float(),
        g.bfloat16().float(),
        mode="recurrent",
    )
    assert_close(o.float(), ref, 1e-2)


def test_bad_inputs_name_argument_and_shapes():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\] = \[1, 40, 2\]"):
        gated_linear_attention(q, k, v, torch.zeros(1, 40, 3, dtype=q.dtype))
    with pytest.raises(
        ValueError, match=r"k must have shape \[B, T, H, K\] = \[1, 40, 2, 8\], got \[1, 40, 2, 7\]"
    ):
        gated_linear_attention(q, k[..., :7], v, None)
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H, V\]"):
        gated_linear_attention(q, k, v[:, :3], None)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        gated_linear_attention(q.long(), k, v, None)
    with pytest.raises(ValueError, match="mode must be one of"):
        gated_linear_attention(q, k, v, None, mode="fast")
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, K, V\]"):
        gated_linear_attention(q, k, v, None, initial_state=torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 40"):
        gated_linear_attention(q, k, v, None, cu_seqlens=torch.tensor([0, 10, 30]))
    with pytest.raises(ValueError, match="packed into B = 1"):
        gated_linear_attention(
            q.expand(2, -1, -1, -1),
            k.expand(2, -1, -1, -1),
            v.expand(2, -1, -1, -1),
            None,
            cu_seqlens=torch.tensor([0, 40]),
        )
