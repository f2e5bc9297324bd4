"""Defects found by a break-it review of the layers (attention, rotary, SSMs, delta rules, linear
attention, MoE), each pinned by a test that failed before its fix."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.layers import (
    Attention,
    DeltaNet,
    GatedLinearAttention,
    LinearAttention,
    Mamba,
    Mamba2,
    MoE,
    ShortConvolution,
)
from mnemo.layers.rotary import RotaryEmbedding


# --- half-precision casts keep the fixed frequencies and decays in float32 ---------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rotary_frequencies_stay_float32_through_a_half_precision_cast(dtype, scaling):
    """``model.to(torch.bfloat16)`` (as ``from_pretrained(dtype=...)`` does) used to round the
    rotary frequencies to bf16 (``0.1 → 0.10009765625``): at position 3000 the rotation was then
    ~0.3 rad off, far beyond the bf16 rounding of the rotated values themselves."""
    ref = RotaryEmbedding(8, scaling=scaling)
    half = RotaryEmbedding(8, scaling=scaling).to(dtype)
    assert half.inv_freq.dtype == half.base_inv_freq.dtype == torch.float32
    assert torch.equal(half.inv_freq, ref.inv_freq)
    x = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    pos = torch.tensor([3000.0, 12345.0])
    err = (half.rotate(x, pos).float() - ref.rotate(x.float(), pos)).abs().max()
    assert err < 8e-3 * x.float().abs().max()  # the output's own rounding (was 0.1-0.9)
    half.set_scaling({"rope_type": "ntk", "factor": 4.0})  # re-scaled after the cast: still float32
    assert half.inv_freq.dtype == torch.float32
    assert RotaryEmbedding(8).double().inv_freq.dtype == torch.float64  # float64 follows the model


def test_attention_in_bf16_rotates_at_float32_frequencies():
    torch.manual_seed(0)
    m = Attention(16, n_heads=2)
    mb = Attention(16, n_heads=2)
    mb.load_state_dict(m.state_dict())
    mb = mb.to(torch.bfloat16)
    assert mb.rotary.inv_freq.dtype == torch.float32
    q = torch.randn(1, 1, 2, 8).bfloat16()
    err = (mb.rotary(q, 5000).float() - m.rotary(q.float(), 5000)).abs().max()
    assert err < 8e-3 * q.float().abs().max()


def test_retnet_log_decay_stays_float32_through_a_bf16_cast():
    """RetNet's fixed ``log γ_h`` buffer was rounded to bf16 by a model cast (up to 0.4% off, and
    in bf16 where the learned gates are float32)."""
    ref = GatedLinearAttention(16, n_heads=4, gate="retnet")
    m = GatedLinearAttention(16, n_heads=4, gate="retnet").to(torch.bfloat16)
    g = m.log_decay(torch.randn(1, 3, 16, dtype=torch.bfloat16))
    assert g.dtype == torch.float32
    assert torch.equal(g[0, 0], ref.log_gamma)
    assert GatedLinearAttention(16, gate="retnet").double().log_gamma.dtype == torch.float64
    m.double().to(torch.bfloat16)  # back down from float64: float32 again (the state stays float32)
    assert m.log_gamma.dtype == torch.float32


# --- bad constructor arguments are named, with the expected and the received value ---------------
BAD_ARGS = [
    (lambda: Attention(16, n_heads=0), "n_heads: expected an int >= 1, got 0"),
    (lambda: Attention(16, n_heads=4, n_kv_heads=0), "n_kv_heads: expected None or an int >= 1, got 0"),
    (lambda: Attention(16, n_heads=4, window=0), "window: expected None or an int >= 1, got 0"),
    (lambda: Attention(16, n_heads=4, window=2.5), "window: expected None or an int >= 1, got 2.5"),
    (lambda: Attention(16, n_heads=4, head_dim=-2), "head_dim: expected None or an int >= 1, got -2"),
    (lambda: Attention(16, n_heads=4, mode="chunk"), r"mode must be one of \('parallel', 'recurrent'\)"),
    (lambda: Attention(16, n_heads=4, rope_theta=0), "rope_theta: expected a finite number > 0"),
    (lambda: Attention(16, n_heads=4, rope_theta=-1.0), "rope_theta: expected a finite number > 0"),
    (lambda: Attention(16, n_heads=4, rope_theta=math.inf), "rope_theta: expected a finite number > 0"),
    (lambda: Mamba(16, d_state=0), "d_state: expected an int >= 1, got 0"),
    (lambda: Mamba(16, expand=0), "expand: expected an int >= 1, got 0"),
    (lambda: Mamba(16, dt_rank=0), "dt_rank: expected None or an int >= 1, got 0"),
    (lambda: Mamba(16, mode="fused"), "mode must be one of"),
    (lambda: Mamba(16, chunk_size=0), "chunk_size must be a positive int, got 0"),
    (lambda: Mamba2(16, head_dim=0), "head_dim: expected an int >= 1, got 0"),
    (lambda: Mamba2(16, head_dim=8, n_groups=0), "n_groups: expected an int >= 1, got 0"),
    (lambda: Mamba2(16, head_dim=8, d_state=0), "d_state: expected an int >= 1, got 0"),
    (lambda: Mamba2(16, head_dim=8, chunk_size=0), "chunk_size must be a positive int, got 0"),
    (lambda: DeltaNet(16, n_heads=0), "n_heads: expected an int >= 1, got 0"),
    (lambda: DeltaNet(2, n_heads=4), "d_model: 2 is smaller than n_heads = 4"),
    (lambda: DeltaNet(16, n_heads=4, value_head_dim=0), "value_head_dim: expected None or an int >= 1"),
    (lambda: DeltaNet(16, n_heads=4, mode="x"), "mode must be one of"),
    (lambda: LinearAttention(16, n_heads=0), "n_heads: expected an int >= 1, got 0"),
    (lambda: LinearAttention(2, n_heads=4), "d_model: 2 is smaller than n_heads = 4"),
    (lambda: LinearAttention(16, n_heads=4, chunk_size=0), "chunk_size must be a positive int, got 0"),
    (lambda: GatedLinearAttention(16, n_heads=0), "n_heads: expected an int >= 1, got 0"),
    (lambda: GatedLinearAttention(16, gate_normalizer=0), "gate_normalizer: expected a finite number > 0"),
    (lambda: GatedLinearAttention(16, expand_k=0), "expand_k: expected a finite number > 0, got 0"),
    (lambda: GatedLinearAttention(16, expand_v=-1.0), "expand_v: expected a finite number > 0"),
    (lambda: RotaryEmbedding(8, theta=0.0), "rope_theta: expected a finite number > 0"),
]


@pytest.mark.parametrize("make, match", BAD_ARGS, ids=[m for _, m in BAD_ARGS])
def test_bad_constructor_arguments_name_the_argument(make, match):
    """Each of these used to be accepted (and failed at the first call, read as a default, built a
    trivial layer — ``d_state=0``: no SSM at all — or produced NaN) or raised ``ZeroDivisionError``."""
    with pytest.raises(ValueError, match=match):
        make()


# --- packed boundaries that do not pack the input are named --------------------------------------
@pytest.mark.parametrize(
    "cu, error, match",
    [
        ([0, 3, 8], ValueError, r"cu_seqlens must start at 0 and end at T = 7, got 0 \.\.\. 8"),
        ([0, 3, 6], ValueError, r"cu_seqlens must start at 0 and end at T = 7, got 0 \.\.\. 6"),
        ([1, 3, 7], ValueError, r"cu_seqlens must start at 0 and end at T = 7, got 1 \.\.\. 7"),
        ([0, 5, 3, 7], ValueError, "cu_seqlens must be non-decreasing"),
    ],
)
def test_packed_short_convolution_names_bad_boundaries(cu, error, match):
    """The packed short convolution (GLA's ``forward_packed`` runs it before the op checks the
    boundaries) raised ``RuntimeError: The size of tensor a (7) must match …`` / ``repeats can
    not be negative``."""
    x = torch.randn(1, 7, 8)
    with pytest.raises(error, match=match):
        GatedLinearAttention(8, n_heads=2, short_conv=True).forward_packed(x, torch.tensor(cu))
    with pytest.raises(error, match=match):
        ShortConvolution(8).forward_packed(x, torch.tensor(cu))


def test_packed_short_convolution_still_packs():
    torch.manual_seed(0)
    conv = ShortConvolution(6).double()
    x = torch.randn(1, 9, 6, dtype=torch.float64)
    y = conv.forward_packed(x, torch.tensor([0, 2, 2, 9]))
    expected = torch.cat([conv(x[:, :2])[0], conv(x[:, 2:])[0]], 1)
    assert torch.allclose(y, expected, atol=1e-14)


# --- MoE: a routing replaced through its hook with experts that do not exist is named -------------
@pytest.mark.parametrize("bad", [4, -1])
def test_moe_replaced_routing_outside_the_experts_is_named(bad):
    """Was ``RuntimeError: index 4 is out of bounds for dimension 1 with size 4`` (from the
    scatter of the counts), naming neither the hook nor the number of experts."""
    m = MoE(8, n_experts=4, top_k=2, expert_hidden=4)
    idx = torch.tensor([[0, 1], [2, bad], [3, 0]])
    m.hook_topk_indices.register_forward_hook(lambda mod, args, out: idx.view(1, 3, 2))
    with pytest.raises(ValueError, match=rf"hook_topk_indices: expected expert indices in \[0, 3\] .*{bad}"):
        m(torch.randn(1, 3, 8))


@pytest.mark.parametrize("name", ["mamba", "attention", "deltanet"])
def test_the_default_packed_form_names_offsets_that_do_not_cover_the_input(name):
    """``Mixer.forward_packed`` (the padded default) called on a layer with offsets ending before the
    input's last token returned fewer tokens than it was given; now a named error. Offsets that do
    cover it still equal each document alone."""
    from mnemo.layers import MIXERS

    torch.manual_seed(0)
    layer = MIXERS[name](16)
    x = torch.randn(1, 7, 16)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 7"):
        layer.forward_packed(x, torch.tensor([0, 3, 6]))
    y = layer.forward_packed(x, torch.tensor([0, 3, 7]))
    first, _ = layer(x[:, :3])
    second, _ = layer(x[:, 3:])
    torch.testing.assert_close(y, torch.cat([first, second], 1))
