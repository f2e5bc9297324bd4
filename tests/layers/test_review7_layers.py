"""Seventh review of the layers (mixers outside attention/MoE/rotary, norms, conv, state helpers)."""

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.conv import ShortConvolution


def _bf16_step(r: torch.Tensor) -> torch.Tensor:
    """One bfloat16 rounding step (ulp) at the magnitude of ``r`` (float32)."""
    e = torch.floor(torch.log2(r.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module_dtype", [torch.float32, "same"])
def test_short_conv_in_half_precision_accumulates_in_float32_on_every_path(dtype, module_dtype):
    """DESIGN §3: bf16/fp16 inputs accumulate in float32. The multi-token pass, the one-token
    decoding step and the packed form all round a float32 sum once: each is within one rounding of
    a float32 hand reference (they were up to a few bf16 steps apart, and from each other)."""
    torch.manual_seed(0)
    C, W, T = 64, 4, 17
    m = ShortConvolution(C, W)
    with torch.no_grad():
        m.bias.normal_()
    if module_dtype == "same":
        m = m.to(dtype)
    x = torch.randn(2, T, C).to(dtype)
    w, b = m.weight[:, 0, :].float(), m.bias.float()
    xp = F.pad(x.float(), (0, 0, W - 1, 0))
    ref = F.silu(sum(xp[:, i : i + T] * w[:, i] for i in range(W)) + b)  # float32 hand reference
    step = _bf16_step(ref) if dtype == torch.bfloat16 else ref.abs().clamp_min(2.0**-14) * 2.0**-10
    y, _ = m(x)
    state, ys = None, []
    for t in range(T):
        yt, state = m(x[:, t : t + 1], state)
        ys.append(yt)
    ys = torch.cat(ys, 1)
    yp = m.forward_packed(x.reshape(1, 2 * T, C), torch.tensor([0, T, 2 * T])).reshape(2, T, C)
    for out in (y, ys, yp):
        assert out.dtype == dtype
        assert ((out.float() - ref).abs() <= step).all()
    assert ((y.float() - ys.float()).abs() <= step).all()
    assert state.dtype == dtype


def _build(cls_name, **kw):
    from mnemo.layers.delta import DeltaNet
    from mnemo.layers.linear_attention import GatedLinearAttention, LinearAttention
    from mnemo.layers.ssm import Mamba, Mamba2

    classes = dict(
        Mamba=Mamba,
        Mamba2=Mamba2,
        DeltaNet=DeltaNet,
        LinearAttention=LinearAttention,
        GatedLinearAttention=GatedLinearAttention,
    )
    if cls_name == "ShortConvolution":
        return ShortConvolution(8, 3, **kw)
    extra = {"Mamba2": dict(head_dim=8)}.get(cls_name, {})
    return classes[cls_name](16, **extra, **kw)


FLAGS = [
    ("Mamba", "selective"),
    ("Mamba", "bias"),
    ("Mamba", "conv_bias"),
    ("Mamba2", "bias"),
    ("Mamba2", "conv_bias"),
    ("Mamba2", "D_has_hdim"),
    ("Mamba2", "norm_before_gate"),
    ("DeltaNet", "output_gate"),
    ("DeltaNet", "gated"),
    ("DeltaNet", "conv_bias"),
    ("DeltaNet", "beta_bias"),
    ("DeltaNet", "allow_neg_eigval"),
    ("LinearAttention", "normalize"),
    ("LinearAttention", "output_norm"),
    ("GatedLinearAttention", "rope"),
    ("ShortConvolution", "activation"),
    ("ShortConvolution", "bias"),
]


@pytest.mark.parametrize("cls_name, flag", FLAGS)
@pytest.mark.parametrize("bad", ["False", 0])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(cls_name, flag, bad):
    """A config's ``"False"`` string switched these options on by truthiness (``Mamba(selective=
    "False")`` built the selective scan, ``rope="False"`` turned rotary positions on, Mamba-2's
    ``bool("False")`` made ``D`` per channel): refused, naming the flag and the value."""
    with pytest.raises(ValueError, match=rf"{flag}: expected a bool, got {bad!r}"):
        _build(cls_name, **{flag: bad})


@pytest.mark.parametrize("cls_name, flag", FLAGS)
def test_flags_given_as_bools_still_build(cls_name, flag):
    for value in (True, False):
        _build(cls_name, **{flag: value})


def test_gla_rope_none_still_means_on_for_retnet_only():
    from mnemo.layers.linear_attention import GatedLinearAttention

    assert GatedLinearAttention(16, gate="retnet").rotary is not None
    assert GatedLinearAttention(16, gate="gla").rotary is None


@pytest.mark.parametrize("bad", [-4, 0, 2.5, True])
def test_linear_attention_heads_from_a_bad_head_dim_name_head_dim(bad):
    """``n_heads=None, head_dim=-4`` gave ``n_heads = 16 // -4 = -4`` and an error naming
    ``n_heads``, an argument the caller did not set."""
    from mnemo.layers.linear_attention import LinearAttention

    with pytest.raises(ValueError, match=rf"head_dim: expected an int >= 1, got {bad!r}"):
        LinearAttention(16, n_heads=None, head_dim=bad)


@pytest.mark.parametrize("bad", [2.0, 0, 3, True])
def test_group_rms_norm_names_a_bad_groups(bad):
    """``GroupRMSNorm(8, groups=2.0)`` built, then failed in ``unflatten`` with a message naming
    neither the argument nor the value."""
    from mnemo.layers.ssm import GroupRMSNorm

    with pytest.raises(ValueError, match=rf"groups: expected an int >= 1 dividing dim \(8\), got {bad!r}"):
        GroupRMSNorm(8, groups=bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_gated_rms_norm_refuses_a_bad_eps_by_name(bad):
    """``gated_rms_norm(..., eps=-1)`` returned a value (NaN, or a wrong scale where mean(x²) > 1):
    the function form now checks ``eps`` as ``RMSNorm`` does."""
    from mnemo.layers.norm import gated_rms_norm

    x, z, w = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
        gated_rms_norm(x, z, w, eps=bad)


@pytest.mark.parametrize("bad", [2.0, True])
def test_gated_rms_norm_names_a_groups_that_is_not_an_int(bad):
    """``groups=2.0`` failed inside the kernel's ``new_empty`` with a TypeError naming no argument."""
    from mnemo.layers.norm import gated_rms_norm

    x, z, w = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match=rf"groups: expected a divisor of D = 8, got {bad!r}"):
        gated_rms_norm(x, z, w, groups=bad)


def test_gated_rms_norm_with_groups_and_eps_zero_still_computes_the_equation():
    from mnemo.layers.norm import gated_rms_norm

    torch.manual_seed(0)
    x, z, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), torch.rand(8)
    w = w.double()
    g = x.unflatten(-1, (2, 4))
    ref = (g / g.pow(2).mean(-1, keepdim=True).sqrt()).flatten(-2) * w * F.silu(z)
    torch.testing.assert_close(gated_rms_norm(x, z, w, eps=0, groups=2), ref, rtol=1e-12, atol=1e-12)
