"""Second review of the recurrent mixers' faithfulness: defects found against the papers' equations
and the released reference code's conventions (fla, mamba-ssm), each shown by a hand computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import DeltaNet, Mamba2, RMSNorm, ShortConvolution
from tests.helpers import assert_close


# --------------------------------------------------------------------------- short convolution
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
def test_short_conv_names_a_wrong_channel_count_instead_of_broadcasting(T, dtype):
    """A one-channel input to a four-channel conv was broadcast against the taps (``[B, T, 4]``
    out, a ``[B, 1, W-1]`` state back) or failed inside the C kernel without naming ``x``."""
    conv = ShortConvolution(4, 3)
    for C in (1, 2, 8):
        with pytest.raises(
            ValueError, match=r"x: expected shape \[B, T, C\] = \[B, T, 4\], got \[2, \d, \d\]"
        ):
            conv(torch.randn(2, T, C, dtype=dtype))
    with pytest.raises(ValueError, match=r"x: expected shape \[B, T, C\] = \[B, T, 4\], got \[1, 6, 1\]"):
        conv.forward_packed(torch.randn(1, 6, 1), torch.tensor([0, 2, 6]))
    with pytest.raises(ValueError, match=r"x: expected shape .* got \[5, 4\]"):
        conv(torch.randn(5, 4))


def test_short_conv_still_matches_its_formula_after_the_check():
    """``y_t = silu(Σ_i w_i x_{t−W+1+i} + b)`` by hand (zeros before the first token), in one call
    and in two with the returned state."""
    torch.manual_seed(0)
    conv = ShortConvolution(3, 4).double()
    with torch.no_grad():
        conv.bias.normal_()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    w = conv.weight[:, 0, :]
    xp = torch.cat([x.new_zeros(2, 3, 3), x], 1)
    ref = F.silu(
        torch.stack([sum(w[:, i] * xp[:, t + i] for i in range(4)) + conv.bias for t in range(6)], 1)
    )
    with torch.no_grad():
        y, _ = conv(x)
        y1, s = conv(x[:, :2])
        y2, _ = conv(x[:, 2:], s)
    assert_close(y, ref, 1e-14)
    assert_close(torch.cat([y1, y2], 1), ref, 1e-14)


# --------------------------------------------------------------------------- delta rule layers
def test_qk_norm_eps_zero_keeps_a_zero_token_finite():
    """``qk_norm_eps=0`` (documented as allowed) computed ``x · rsqrt(Σx²)``: a zero query/key (an
    all-zero input token, or the zero padding of :meth:`forward_packed`) became NaN and the op
    refused it. The exact L2 normalisation is undefined only at 0; there it now gives 0, so the
    layer equals the ``F.normalize`` one (``qk_norm_eps=None``) exactly."""
    torch.manual_seed(0)
    a = DeltaNet(8, n_heads=2, gated=True, qk_norm_eps=0.0, chunk_size=4).double()
    b = DeltaNet(8, n_heads=2, gated=True, qk_norm_eps=None, chunk_size=4).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    x[:, 4:9] = 0.0  # four zero tokens after the conv's reach: q = k = silu(0) = 0
    with torch.no_grad():
        ya, _ = a(x)
        yb, _ = b(x)
        assert ya.isfinite().all()
        assert_close(ya, yb, 1e-14)
        cu = torch.tensor([0, 2, 12])  # unequal documents: the padded batch has zero rows
        packed = a.forward_packed(x, cu)
        alone = torch.cat([a(x[:, :2])[0], a(x[:, 2:])[0]], 1)
    assert_close(packed, alone, 1e-12)


def test_gated_deltanet_init_range_is_named_in_the_docstring():
    """The reference Gated DeltaNet code (fla ``GatedDeltaNet``, Qwen3-Next) draws
    ``exp(A_log) ~ U[0, 16]``; mnemo draws Mamba-2's ``U[1, 16]``. The deviation is named, and the
    draw is what the docstring says (64 heads: the extremes of the draw lie near both ends)."""
    doc = " ".join(DeltaNet.__doc__.split())
    assert "exp(A_log) ~ U[1, 16]" in doc and "U[0, 16]" in doc
    torch.manual_seed(0)
    A = DeltaNet(64, n_heads=64, head_dim=1, gated=True).A_log.exp()
    assert A.min() >= 1.0 and A.max() <= 16.0
    assert A.min() < 1.5 and A.max() > 15.0


# --------------------------------------------------------------------------- constructor arguments
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DeltaNet(8, norm_eps=-1.0), r"norm_eps: expected a finite number >= 0.*got -1\.0"),
        (lambda: DeltaNet(8, norm_eps=float("nan")), r"norm_eps: expected a finite number >= 0.*got nan"),
        (lambda: Mamba2(8, head_dim=4, norm_eps=-1e-3), r"norm_eps: expected a finite number >= 0"),
        (lambda: RMSNorm(4, -1.0), r"eps: expected a finite number >= 0.*got -1\.0"),
        (lambda: Mamba2(8, head_dim=4, dt_limit=0.1), r"dt_limit: expected \(min, max\).*got 0\.1"),
        (lambda: Mamba2(8, head_dim=4, dt_limit=(0.0, 1.0, 2.0)), r"dt_limit: expected \(min, max\)"),
        (lambda: ShortConvolution(4, 2.5), r"kernel_size must be an int >= 1, got 2\.5"),
        (lambda: ShortConvolution(0, 3), r"channels must be an int >= 1, got 0"),
    ],
)
def test_bad_norm_eps_dt_limit_and_conv_sizes_are_named(make, match):
    """A negative ``norm_eps`` was accepted and made ``mean(x²) + eps`` negative (NaN, or a silently
    wrong scale); ``dt_limit=0.1`` raised ``TypeError: object of type 'float' has no len()``; a
    fractional ``kernel_size`` failed inside ``torch.empty``. Each now names its argument."""
    with pytest.raises(ValueError, match=match):
        make()


def test_negative_norm_eps_used_to_give_nan():
    """What a negative epsilon did: ``x / sqrt(mean(x²) − 1)`` for ``mean(x²) < 1`` is NaN. A zero
    epsilon (the exact RMS) stays allowed and equals the formula by hand."""
    x = torch.full((1, 4), 0.5, dtype=torch.float64)
    assert torch.isnan(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) - 1.0)).all()
    norm = RMSNorm(4, 0.0).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_close(norm(x), x / x.pow(2).mean(-1, keepdim=True).sqrt(), 1e-15)
    assert Mamba2(8, head_dim=4, dt_limit=[0.01, 0.5]).dt_limit == (0.01, 0.5)
