"""Fifth break-it pass over the layers outside attention/MoE/rotary and the memories (review 6):
the short convolution's streaming tail, the state helpers on integer scalars and on offsets that
differ, and the mixers' ``conv_size`` errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mnemo.layers import MIXERS
from mnemo.layers import state as st
from mnemo.layers.conv import ShortConvolution

D = 16
CONV_MIXERS = [
    ("mamba", {}),
    ("mamba2", {"d_state": 4, "head_dim": 8}),
    ("deltanet", {}),
    ("gated_deltanet", {"n_v_heads": 8}),
    ("gla", {"short_conv": True}),
    ("retnet", {"short_conv": True}),
    ("linear_attention", {"short_conv": True}),
]


def _mixer(name, opts, seed=0):
    torch.manual_seed(seed)
    m = MIXERS[name](D, **opts).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name, opts", CONV_MIXERS, ids=[n for n, _ in CONV_MIXERS])
def test_conv_tail_after_a_long_call_holds_only_its_own_bytes(name, opts):
    """The conv tail ``[B, C, W − 1]`` was a view of the padded input ``[B, W − 1 + T, C]`` of the
    call: after a prefill of ``T`` tokens the state kept all of it alive (``T · C`` values per layer
    through the whole decoding, 270x the declared bytes here) while ``nbytes`` and ``state_spec``
    declared ``(W − 1) · C``. Now the tail is its own tensor, and the stream continues as before."""
    m = _mixer(name, opts)
    x = torch.randn(2, 300, D, dtype=torch.float64)
    with torch.no_grad():
        y, S = m(x)
        conv = S.conv
        assert conv.untyped_storage().nbytes() == conv.numel() * conv.element_size()
        for t in st.tensors(S):  # no entry of the state holds more than its own values
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        y1, s1 = m(x[:, :299])
        y2, s2 = m(x[:, 299:], s1)  # one decoding step from the prefill's state
        assert _rel(torch.cat([y1, y2], 1), y) < 1e-13
        assert s2.conv.untyped_storage().nbytes() == s2.conv.numel() * s2.conv.element_size()


@pytest.mark.parametrize("T", [1, 7])
def test_short_conv_tail_is_a_copy_even_when_its_view_would_be_contiguous(T):
    """``B = 1`` with two taps: the tail's transpose ``[1, C, 1]`` is contiguous, so a plain
    ``.contiguous()`` would still have returned the view of the padded input; the tail equals the
    last input by hand and owns its storage."""
    conv = ShortConvolution(5, 2).double()
    x = torch.randn(1, T, 5, dtype=torch.float64)
    _, tail = conv(x)
    assert torch.equal(tail, x[:, -1:].transpose(1, 2))
    assert tail.untyped_storage().nbytes() == 5 * 8


@pytest.mark.parametrize(
    "rows", [torch.tensor(1), np.int64(1), torch.tensor([0.2, 3.0, -1.0]).argmax(), torch.tensor(-2)]
)
def test_select_rows_with_an_integer_scalar_keeps_the_batch_dimension(rows):
    """An ``argmax`` (a 0-d tensor) or a NumPy integer indexed every tensor as it was, dropping the
    batch dimension (``[H, K, V]`` instead of ``[1, H, K, V]``), so the selected state could not
    continue (the next call failed on its shape). They now count as the int they are."""
    m = _mixer("gated_deltanet", {})
    x = torch.randn(3, 9, D, dtype=torch.float64)
    with torch.no_grad():
        y, _ = m(x)
        _, S = m(x[:, :4])
        picked = st.select_rows(S, rows)
        want = st.select_rows(S, int(rows))
        for a, b in zip(st.tensors(picked), st.tensors(want), strict=True):
            assert a.shape == b.shape and a.shape[0] == 1 and torch.equal(a, b)
        i = int(rows) % 3
        y2, _ = m(x[i : i + 1, 4:], picked)
    assert _rel(y2, y[i : i + 1, 4:]) < 1e-13


def test_cat_rows_names_the_non_tensor_field_that_differs():
    """States of streams of different lengths differ in ``offset``: the error printed the two values
    alone (``a non-tensor field differs between states: (5, 4)``), now it names the field."""
    m = MIXERS["gla"](D)
    a, b = m(torch.randn(2, 5, D))[1], m(torch.randn(2, 4, D))[1]
    with pytest.raises(ValueError, match=r"non-tensor field \[0\]\.offset differs between states: \(5, 4\)"):
        st.cat_rows([[a], [b]])
    with pytest.raises(ValueError, match=r"non-tensor field \.offset differs"):
        st.cat_rows([a, b])
    joined = st.cat_rows([a, m(torch.randn(1, 5, D))[1]])  # same offsets: joined as before
    assert joined.memory.shape[0] == 3 and joined.offset == 5


@pytest.mark.parametrize(
    "name, opts",
    [
        ("mamba", {}),
        ("mamba2", {"head_dim": 8}),
        ("deltanet", {}),
        ("gated_deltanet", {}),
        ("gla", {"short_conv": True}),
        ("linear_attention", {"short_conv": True}),
    ],
)
@pytest.mark.parametrize("bad", [0, 2.0])
def test_a_bad_conv_size_is_named_by_the_mixer_argument(name, opts, bad):
    """``Mamba(d, conv_size=0)`` said ``kernel_size must be an int >= 1, got 0``: the
    convolution's argument, not the one the caller gave. Now ``conv_size``, expected vs got."""
    with pytest.raises(ValueError, match=rf"conv_size: expected an int >= 1, got {bad!r}"):
        MIXERS[name](D, conv_size=bad, **opts)


def test_conv_size_is_not_checked_where_no_convolution_is_built():
    """Without a short convolution ``conv_size`` is unused and stays unchecked, as before."""
    assert MIXERS["gla"](D, conv_size=0).conv is None
    assert MIXERS["deltanet"](D, short_conv=False, conv_size=0).conv is None
