"""Mixer layers: forms agree, streaming in any split (incl. shorter than the conv width), grads."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import (
    MIXERS,
    Attention,
    DeltaNet,
    GatedLinearAttention,
    LinearAttention,
    Mamba,
    Mamba2,
    MultiHeadLatentAttention,
)
from mnemo.layers.state import nbytes, tensors
from tests.helpers import assert_close, assert_directional_derivatives

D = 32
TOL = 1e-10

# small options per registered mixer (chunk sizes below T so the chunk form really chunks)
OPTIONS = {
    "mamba": {"d_state": 8, "chunk_size": 8},
    "mamba2": {"d_state": 8, "head_dim": 16, "chunk_size": 8},
    "kda": {"n_heads": 2, "chunk_size": 8},
}
# (id, constructor) — every registered mixer, plus variants (short conv, windows, groups, LTI)
# the test-time-trained memories (NeuralMemory, MAC/MAG/MAL) have their own file: test_titans.py;
# self-modifying Titans (mnemo/layers/self_modifying.py) is tested in tests/nested/
TTT_MIXERS = {
    "neural_memory",
    "titans_mac",
    "titans_mag",
    "titans_mal",
    "self_modifying_titans",
    "self_modifying_projections",
}
CASES = [
    (name, lambda name=name: MIXERS[name](D, **OPTIONS.get(name, {"n_heads": 2})))
    for name in sorted(MIXERS)
    if name not in TTT_MIXERS
] + [
    ("linear_attention+conv", lambda: LinearAttention(D, n_heads=2, short_conv=True)),
    ("linear_attention_favor", lambda: LinearAttention(D, n_heads=2, feature_map="favor", num_features=24)),
    ("gla+conv", lambda: GatedLinearAttention(D, n_heads=2, gate="gla", short_conv=True, chunk_size=8)),
    ("scalar_gate", lambda: GatedLinearAttention(D, n_heads=2, gate="scalar", chunk_size=8)),
    ("attention_gqa_window", lambda: Attention(D, n_heads=4, n_kv_heads=2, window=5)),
    (
        "deltanet_noconv_nogate",
        lambda: DeltaNet(D, n_heads=2, short_conv=False, output_gate=False, chunk_size=8),
    ),
    ("gated_deltanet_chunk8", lambda: DeltaNet(D, n_heads=2, gated=True, chunk_size=8)),
    ("mamba_lti", lambda: Mamba(D, d_state=8, selective=False, chunk_size=8)),
    ("mamba2_groups", lambda: Mamba2(D, d_state=8, head_dim=16, n_groups=2, chunk_size=8)),
    (  # compressed queries, unequal query/value widths, biases
        "mla_q_lora_bias",
        lambda: MultiHeadLatentAttention(
            D,
            n_heads=2,
            q_lora_rank=12,
            kv_lora_rank=20,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=10,
            bias=True,
        ),
    ),
]


def _make(ctor, seed=0):
    torch.manual_seed(seed)
    m = ctor().double()
    with torch.no_grad():
        for p in m.parameters():  # larger than init so every path matters numerically
            p.add_(0.1 * torch.randn_like(p))
    return m


def _x(T, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _modes(m):
    attention = isinstance(m, (Attention, MultiHeadLatentAttention))
    return ("parallel", "recurrent") if attention else ("chunk", "parallel", "recurrent")


@pytest.mark.parametrize("name, ctor", CASES, ids=[c[0] for c in CASES])
def test_forms_agree(name, ctor):
    m = _make(ctor)
    x = _x(21)
    ys = {mode: m(x, mode=mode)[0] for mode in _modes(m)}
    ref = ys.pop("recurrent")
    for mode, y in ys.items():
        assert_close(y, ref, TOL, what=f"{name} {mode}")


@pytest.mark.parametrize("name, ctor", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("a", [1, 2, 3, 8, 9, 17])
def test_split_streaming_equals_full(name, ctor, a):
    m = _make(ctor)
    x = _x(20)
    full, _ = m(x)
    y1, s = m(x[:, :a])
    y2, s = m(x[:, a:], s)
    assert_close(torch.cat([y1, y2], 1), full, TOL, what=f"{name} split at {a}")
    assert s.offset == 20


@pytest.mark.parametrize("name, ctor", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("prefill", [1, 2, 5])
def test_token_by_token_after_short_prefill(name, ctor, prefill):
    """Prefills shorter than the conv width (4) included; decoding uses the T = 1 path."""
    m = _make(ctor)
    x = _x(12)
    full, _ = m(x)
    outs = []
    y, s = m(x[:, :prefill])
    outs.append(y)
    for t in range(prefill, 12):
        y, s = m(x[:, t : t + 1], s)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full, TOL, what=f"{name} decode after {prefill}")


@pytest.mark.parametrize("name, ctor", CASES, ids=[c[0] for c in CASES])
def test_every_parameter_gets_a_gradient(name, ctor):
    m = _make(ctor)
    x = _x(10)
    y, _ = m(x)
    y.square().sum().backward()
    for pname, p in m.named_parameters():
        assert p.grad is not None, pname
        assert p.grad.abs().sum() > 0, f"{name}: no gradient signal reaches {pname}"
    assert_directional_derivatives(m, x, name)


@pytest.mark.parametrize("name, ctor", CASES, ids=[c[0] for c in CASES])
def test_state_size_accounts_for_the_state(name, ctor):
    m = ctor()
    _, s = m(torch.randn(1, 9, D))
    assert m.state_size_bytes(1, 9) == nbytes(s)
    # the declared state has the returned state's structure, shapes and dtypes
    declared = m.state_spec(1, 9)
    assert type(declared) is type(s) and declared.offset == s.offset == 9
    assert [(tuple(t.shape), t.dtype) for t in tensors(declared)] == [
        (tuple(t.shape), t.dtype) for t in tensors(s)
    ]


@pytest.mark.parametrize("name, ctor", CASES, ids=[c[0] for c in CASES])
def test_float32_chunk_matches_float64_reference(name, ctor):
    m = _make(ctor)
    x = _x(150, B=1)
    ref, _ = m(x, mode="recurrent")
    y, _ = m.float()(x.float())
    assert y.dtype == torch.float32
    assert_close(y, ref, 2e-5, what=name)  # the documented float32 tolerance; measured at most 4.4e-7


def test_bad_input_shape_is_named():
    m = LinearAttention(D, n_heads=2)
    with pytest.raises(
        ValueError, match=r"x must have shape \[B, T, d_model\] = \[B, T, 32\], got \[2, 5, 16\]"
    ):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="gate must be one of"):
        GatedLinearAttention(D, gate="mamba")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Attention(D, n_heads=4, n_kv_heads=3)


def test_retnet_decays_follow_the_paper():
    m = MIXERS["retnet"](D, n_heads=4)
    g = m.log_decay(torch.zeros(1, 3, D))
    gamma = 1 - 2.0 ** (-5 - torch.arange(4.0))
    assert torch.allclose(g[0, 0].exp(), gamma)
