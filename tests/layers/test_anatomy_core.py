"""The anatomy of the core mixers (softmax attention, linear / gated linear attention, DeltaNet,
Mamba, Mamba-2): each intermediate passes its hook point once, as the op consumes it — a replaced
value takes effect downstream —; ``mixing`` rebuilds the op's output from the recorded values and
agrees with an independent reconstruction from the mixer's sub-modules; the declared state
(``state_spec``) is the state ``forward`` returns, also in bfloat16 and float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat

from mnemo.layers import MIXERS, Attention, DeltaNet, GatedLinearAttention, LinearAttention, Mamba, Mamba2
from mnemo.layers.attention import AttentionState
from mnemo.layers.delta import inverse_softplus
from mnemo.layers.linear_attention import MatrixState
from mnemo.layers.ssm import Mamba2State, MambaState
from mnemo.layers.state import nbytes, tensors
from mnemo.ops import (
    delta_rule,
    delta_rule_map,
    gated_delta_rule,
    gated_linear_attention,
    gated_linear_attention_map,
    linear_attention,
    selective_scan,
    selective_scan_map,
    softmax_attention,
    softmax_attention_map,
)
from tests.helpers import assert_close

D = 32

CASES = {
    "attention": lambda: Attention(D, n_heads=4),
    "attention_gqa_window": lambda: Attention(D, n_heads=4, n_kv_heads=2, window=5),
    "linear_attention": lambda: LinearAttention(D, n_heads=2),
    "linear_attention+conv": lambda: LinearAttention(D, n_heads=2, short_conv=True, feature_map="relu"),
    "gla": lambda: GatedLinearAttention(D, n_heads=2, gate="gla", chunk_size=8),
    "retnet": lambda: GatedLinearAttention(D, n_heads=2, gate="retnet", expand_k=1.0, chunk_size=8),
    "scalar_gate+conv": lambda: GatedLinearAttention(
        D, n_heads=2, gate="scalar", short_conv=True, chunk_size=8
    ),
    "deltanet": lambda: DeltaNet(D, n_heads=2, chunk_size=8),
    "deltanet_noconv_nogate": lambda: DeltaNet(
        D, n_heads=2, short_conv=False, output_gate=False, chunk_size=8
    ),
    "gated_deltanet": lambda: DeltaNet(D, n_heads=2, gated=True, chunk_size=8),
    "mamba": lambda: Mamba(D, d_state=8, chunk_size=8),
    "mamba_lti": lambda: Mamba(D, d_state=8, selective=False, chunk_size=8),
    "mamba2": lambda: Mamba2(D, d_state=8, head_dim=16, chunk_size=8),
    "mamba2_groups": lambda: Mamba2(D, d_state=8, head_dim=16, n_groups=2, chunk_size=8),
}
NAMES = list(CASES)


def _make(name, seed=0):
    torch.manual_seed(seed)
    m = CASES[name]().double()
    with torch.no_grad():
        for p in m.parameters():  # larger than init so every path matters numerically
            p.add_(0.1 * torch.randn_like(p))
    return m


def _x(T=13, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _hook_names(m):
    return sorted(n for n, _ in m.named_children() if n.startswith("hook_"))


def _record(m, x, names=None, state=None, replace=None, **kw):
    """Run ``m(x, state)`` recording the hooks ``names`` (default: all but ``hook_pattern``);
    ``replace``: ``{name: fn(value) -> replacement}``. Returns ``(y, state, acts)``."""
    names = [n for n in _hook_names(m) if n != "hook_pattern"] if names is None else names
    acts, handles = {}, []
    for n in names:
        handles.append(getattr(m, n).add(lambda v, _, n=n: acts.__setitem__(n, v)))
    for n, fn in (replace or {}).items():
        handles.append(getattr(m, n).add(lambda v, _, fn=fn: fn(v)))
    try:
        y, s = m(x, state, **kw)
    finally:
        for h in handles:
            h.remove()
    return y, s, acts


# ------------------------------------------------------------------------------------------------
# hook names and shapes
# ------------------------------------------------------------------------------------------------

B_, T_ = 2, 13


def _expected_shapes(m):
    """The documented hook shapes (``None``: not a tensor / checked elsewhere)."""
    B, T = B_, T_
    if isinstance(m, Attention):
        H, Hk, K = m.n_heads, m.n_kv_heads, m.head_dim
        return {
            "hook_q": (B, T, H, K),
            "hook_k": (B, T, Hk, K),
            "hook_v": (B, T, Hk, K),
            "hook_pattern": (B, H, T, T),
            "hook_o": (B, T, H, K),
            "hook_state": None,
        }
    if isinstance(m, DeltaNet):
        H, K = m.n_heads, m.head_dim
        shapes = {
            "hook_q": (B, T, H, K),
            "hook_k": (B, T, H, K),
            "hook_v": (B, T, H, K),
            "hook_beta": (B, T, H),
            "hook_o": (B, T, H, K),
            "hook_state": (B, H, K, K),
        }
        if m.gated:
            shapes["hook_g"] = (B, T, H)
        return shapes
    if isinstance(m, Mamba):
        Dm, N = m.d_inner, m.d_state
        return {
            "hook_v": (B, T, Dm),
            "hook_dt": (B, T, Dm),
            "hook_B": (B, T, N),
            "hook_C": (B, T, N),
            "hook_g": (B, T, Dm, N),
            "hook_o": (B, T, Dm),
            "hook_state": (B, Dm, N),
        }
    if isinstance(m, Mamba2):
        H, P, N = m.n_heads, m.head_dim, m.d_state
        return {
            "hook_v": (B, T, H, P),
            "hook_dt": (B, T, H),
            "hook_B": (B, T, H, N),
            "hook_C": (B, T, H, N),
            "hook_g": (B, T, H),
            "hook_o": (B, T, H, P),
            "hook_state": (B, H, N, P),
        }
    H, K, V = m.n_heads, m.key_dim, m.value_dim
    shapes = {
        "hook_q": (B, T, H, K),
        "hook_k": (B, T, H, K),
        "hook_v": (B, T, H, V),
        "hook_o": (B, T, H, V),
        "hook_state": (B, H, m._state_key_dim(), m._state_value_dim()),
    }
    if isinstance(m, GatedLinearAttention):
        shapes["hook_g"] = (B, T, H, K) if m.gate == "gla" else (B, T, H)
    return shapes


@pytest.mark.parametrize("name", NAMES)
def test_hooks_have_the_documented_names_and_shapes(name):
    m = _make(name)
    expected = _expected_shapes(m)
    assert _hook_names(m) == sorted(expected)
    y, s, acts = _record(m, _x(T_, B_), names=_hook_names(m))
    assert sorted(acts) == sorted(expected)  # every hook fires (hook_pattern / hook_g while attached)
    for n, shape in expected.items():
        if shape is not None:
            assert tuple(acts[n].shape) == shape, (name, n)
    # each hook fires once per call, and the state hook holds the returned state
    counts = {n: 0 for n in expected}
    handles = [getattr(m, n).add(lambda v, _, n=n: counts.__setitem__(n, counts[n] + 1)) for n in expected]
    m(_x(T_, B_))
    for h in handles:
        h.remove()
    assert set(counts.values()) == {1}
    assert all(a is b for a, b in zip(tensors(acts["hook_state"]), tensors(_memory(s)), strict=True))
    # recording changes nothing (hook_g of Mamba and hook_pattern switch paths only when attached)
    ref, _ = m(_x(T_, B_))
    assert_close(y, ref, 1e-12, what=name)
    assert not any(getattr(m, n).active for n in expected)


# ------------------------------------------------------------------------------------------------
# replaced values take effect
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_zero_values_silence_the_mixer(name):
    m = _make(name)
    y, _, _ = _record(m, _x(), names=[], replace={"hook_v": torch.zeros_like})
    assert y.abs().max() == 0


@pytest.mark.parametrize("name", NAMES)
def test_every_replaced_hook_changes_what_follows(name):
    """Perturbing any hook's value changes the output (or, for ``hook_state``, the returned state):
    no intermediate is recomputed behind its hook."""
    m = _make(name)
    x = _x()
    ref, ref_state = m(x)
    for n in _hook_names(m):
        if n == "hook_state":
            _, s, _ = _record(m, x, names=[], replace={n: lambda v: _map(lambda t: 2 * t, v)})
            for a, b in zip(tensors(_memory(s)), tensors(_memory(ref_state)), strict=True):
                assert torch.equal(a, 2 * b)
            continue
        y, _, _ = _record(m, x, names=[], replace={n: lambda v: 1.1 * v + 0.01})
        assert (y - ref).abs().max() > 1e-6, f"{name}: replacing {n} changed nothing"


def _memory(s):
    """The part of a state that passes ``hook_state`` (the cache / memory, not the conv tail)."""
    return s.kv if isinstance(s, AttentionState) else s.memory if isinstance(s, MatrixState) else s.ssm


def _map(fn, v):
    if isinstance(v, torch.Tensor):
        return fn(v)
    return type(v)(*(fn(t) for t in v))  # a KVCache


@pytest.mark.parametrize("name", NAMES)
def test_zero_read_out(name):
    m = _make(name)
    y, _, acts = _record(m, _x(), replace={"hook_o": torch.zeros_like})
    if isinstance(m, Mamba):  # the D skip and the gate remain
        z = m.in_proj(_x()).chunk(2, -1)[1]
        expected = m.o_proj(acts["hook_v"] * m.D * F.silu(z))
        assert_close(y, expected, 1e-12, what=name)
    elif isinstance(m, Mamba2):
        z = m.in_proj(_x())[..., : m.d_inner]
        skip = rearrange(acts["hook_v"] * m.D[:, None], "b t h p -> b t (h p)")
        assert_close(y, m.o_proj(m.norm(skip * F.silu(z))), 1e-12, what=name)
    else:
        assert y.abs().max() == 0


def _with(name, edit):
    m = _make(name)
    with torch.no_grad():
        edit(m)
    return m


@pytest.mark.parametrize(
    "name, hook, replace, edit",
    [
        # half the log decay = half of A
        ("mamba", "hook_g", lambda g: g / 2, lambda m: m.A_log.sub_(math.log(2))),
        ("mamba_lti", "hook_g", lambda g: g / 2, lambda m: m.A_log.sub_(math.log(2))),
        ("mamba2", "hook_g", lambda g: g / 2, lambda m: m.A_log.sub_(math.log(2))),
        ("gated_deltanet", "hook_g", lambda g: g / 2, lambda m: m.A_log.sub_(math.log(2))),
        # a step computed with the bias + 1
        ("mamba", "hook_dt", lambda d: F.softplus(inverse_softplus(d) + 1), lambda m: m.dt_proj.bias.add_(1)),
        ("mamba2", "hook_dt", lambda d: F.softplus(inverse_softplus(d) + 1), lambda m: m.dt_bias.add_(1)),
        (
            "deltanet",
            "hook_beta",
            lambda b: torch.sigmoid(torch.logit(b) + 1),
            lambda m: m.beta_proj.bias.add_(1),
        ),
    ],
)
def test_a_replacement_is_what_the_op_consumes(name, hook, replace, edit):
    """Replacing a gate with the value a changed parameter would give equals that changed mixer —
    through a split stream too (the replacement path carries the state)."""
    m, ref_m = _make(name), _with(name, edit)
    x = _x(20)
    for mode in ("chunk", "recurrent"):
        want, _ = ref_m(x, mode=mode)
        got, _, _ = _record(m, x, names=[], replace={hook: replace}, mode=mode)
        assert_close(got, want, 1e-10, what=f"{name} {hook} {mode}")
    y1, s, _ = _record(m, x[:, :7], names=[], replace={hook: replace})
    y2, s, _ = _record(m, x[:, 7:], names=[], state=s, replace={hook: replace})
    assert_close(torch.cat([y1, y2], 1), ref_m(x)[0], 1e-10, what=f"{name} {hook} split")


@pytest.mark.parametrize("name", ["mamba", "mamba_lti"])
def test_mamba_identical_log_decay_replacement_agrees_with_the_scan(name):
    """A replaced ``hook_g`` (here: a copy) runs the per-channel gated form; it equals the scan."""
    m = _make(name)
    x = _x(20)
    ref, ref_s = m(x)
    y, s, _ = _record(m, x, names=[], replace={"hook_g": torch.clone})
    assert_close(y, ref, 1e-10, what=name)
    assert_close(s.ssm, ref_s.ssm, 1e-10, what=name)
    y1, s, _ = _record(m, x[:, :1], names=[], replace={"hook_g": torch.clone})
    y2, s, _ = _record(m, x[:, 1:], names=[], state=s, replace={"hook_g": torch.clone})
    assert_close(torch.cat([y1, y2], 1), ref, 1e-10, what=name)


# ------------------------------------------------------------------------------------------------
# softmax attention: the pattern
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["attention", "attention_gqa_window"])
def test_attention_pattern_is_built_only_when_hooked_and_used(name):
    m = _make(name)
    x = _x(20)
    ref, ref_s = m(x)
    y, s, acts = _record(m, x, names=["hook_pattern", "hook_q", "hook_k"])
    P = acts["hook_pattern"]
    assert P.shape == (2, 4, 20, 20)
    torch.testing.assert_close(P, softmax_attention_map(acts["hook_q"], acts["hook_k"], m.window))
    assert_close(y, ref, 1e-12, what=name)
    for a, b in zip(s.kv, ref_s.kv):
        assert torch.equal(a, b)
    # streaming with the pattern hooked: [B, H, T, S] over cached + new keys, same outputs
    y1, s1, _ = _record(m, x[:, :9], names=["hook_pattern"])
    y2, s2, acts2 = _record(m, x[:, 9:], names=["hook_pattern"], state=s1)
    assert acts2["hook_pattern"].shape == (2, 4, 11, s1.kv.k.shape[1] + 11)
    assert_close(torch.cat([y1, y2], 1), ref, 1e-12, what=f"{name} split")
    for a, b in zip(s2.kv, ref_s.kv):
        assert_close(a, b, 1e-12, what=f"{name} cache")

    # a replaced pattern is used: uniform causal weights give the running mean of the values
    def uniform(p):
        w = (p > 0).to(p.dtype)
        return w / w.sum(-1, keepdim=True)

    y, _, acts = _record(m, x, names=["hook_v"], replace={"hook_pattern": uniform})
    v = repeat(acts["hook_v"], "b t h d -> b t (h g) d", g=m.n_heads // m.n_kv_heads)
    P = uniform(softmax_attention_map(_q(m, x), _k(m, x), m.window))
    o = einsum(P, v, "b h t s, b s h d -> b t h d")
    assert_close(y, m.o_proj(rearrange(o, "b t h d -> b t (h d)")), 1e-12, what=name)


def _q(m, x):
    return m.rotary(rearrange(m.q_proj(x), "b t (h d) -> b t h d", h=m.n_heads), 0)


def _k(m, x):
    k = rearrange(m.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=m.n_kv_heads)[0]
    return m.rotary(k, 0)


# ------------------------------------------------------------------------------------------------
# implicit attention
# ------------------------------------------------------------------------------------------------


def reference_mixing(mixer, x):
    """``(maps, values, output)`` rebuilt from the mixer's sub-modules, not from its hooks (the
    reconstruction ``mnemo.interp.maps.mixing`` used before the mixers exposed their anatomy)."""
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    if isinstance(mixer, Attention):
        a = mixer
        q, k = _q(a, x), _k(a, x)
        v = rearrange(a.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=a.n_kv_heads)[1]
        out, _ = softmax_attention(q, k, v, window=a.window)
        G = a.n_heads // a.n_kv_heads
        k, v = (repeat(t, "b t h d -> b t (h g) d", g=G) for t in (k, v))
        scores = torch.einsum("bthd,bshd->bhts", q, k) * a.head_dim**-0.5
        mask = causal if a.window is None else causal & ~torch.ones_like(causal).tril(-a.window)
        return scores.masked_fill(~mask, float("-inf")).softmax(-1), v, out
    if isinstance(mixer, LinearAttention):
        q, k, v, _ = mixer._qkv(x, None)
        out, _ = linear_attention(q, k, v, feature_map=mixer.feature_map, normalize=mixer.normalize)
        phi = mixer.feature_map
        M = gated_linear_attention_map(phi(q * q.shape[-1] ** -0.5), phi(k), scale=1.0)
        if mixer.normalize:
            M = M / (M.sum(-1, keepdim=True) + 1e-6)
        return M, v, out
    if isinstance(mixer, GatedLinearAttention):
        q, k, v, _ = mixer._qkv(x, None)
        if mixer.rotary is not None:
            q, k = mixer.rotary(q, 0), mixer.rotary(k, 0)
        g = mixer.log_decay(x)
        out, _ = gated_linear_attention(q, k, v, g)
        return gated_linear_attention_map(q, k, g), v, out
    if isinstance(mixer, DeltaNet):
        qkv = mixer.qkv_proj(x)
        qkv = mixer.conv(qkv)[0] if mixer.conv is not None else F.silu(qkv)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b t h d", three=3, h=mixer.n_heads)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = torch.sigmoid(mixer.beta_proj(x))
        if mixer.gated:
            g = mixer.log_decay(x)
            out, _ = gated_delta_rule(q, k, v, g=g, beta=beta)
        else:
            g = None
            out, _ = delta_rule(q, k, v, beta)
        return delta_rule_map(q, k, beta, g), v, out
    if isinstance(mixer, Mamba):
        u, _ = mixer.conv(mixer.in_proj(x).chunk(2, dim=-1)[0])
        if mixer.selective:
            dt, Bm, Cm = mixer.x_proj(u).split([mixer.dt_rank, mixer.d_state, mixer.d_state], dim=-1)
        else:
            Bsz, T = x.shape[:2]
            dt = mixer.dt_lti.expand(Bsz, T, -1)
            Bm, Cm = mixer.B_lti.expand(Bsz, T, -1), mixer.C_lti.expand(Bsz, T, -1)
        delta = F.softplus(F.linear(dt, mixer.dt_proj.weight) + mixer.dt_proj.bias)
        A = -mixer.A_log.exp()
        out, _ = selective_scan(u, delta, A, Bm, Cm)
        return selective_scan_map(delta, A, Bm, Cm), u[..., None], out[..., None]
    if isinstance(mixer, Mamba2):
        G, N = mixer.n_groups, mixer.d_state
        _, xBC, dt = mixer.in_proj(x).split([mixer.d_inner, mixer.d_inner + 2 * G * N, mixer.n_heads], dim=-1)
        xBC, _ = mixer.conv(xBC)
        xs, Bm, Cm = xBC.split([mixer.d_inner, G * N, G * N], dim=-1)
        xs = rearrange(xs, "b t (h p) -> b t h p", p=mixer.head_dim)
        Bm, Cm = (
            repeat(rearrange(t, "b t (g n) -> b t g n", g=G), "b t g n -> b t (g r) n", r=mixer.n_heads // G)
            for t in (Bm, Cm)
        )
        dt = F.softplus(dt + mixer.dt_bias)
        A = -mixer.A_log.exp()
        from mnemo.ops import ssd

        out, _ = ssd(xs, dt, A, Bm, Cm)
        M = gated_linear_attention_map(Cm, Bm, dt * A, scale=1.0) * rearrange(dt, "b s h -> b h 1 s")
        return M, xs, out
    raise AssertionError(type(mixer))


@pytest.mark.parametrize("name", NAMES)
def test_mixing_is_the_ops_output_and_matches_an_independent_reconstruction(name):
    m = _make(name)
    x = _x(13)
    with torch.no_grad():
        _, _, acts = _record(m, x, names=list(m.mixing_hooks))
        mx = m.mixing(acts)
        ref = reference_mixing(m, x)
    B, T = x.shape[:2]
    assert mx.maps.shape[:1] + mx.maps.shape[2:] == (B, T, T) and mx.maps.shape[1] == mx.values.shape[2]
    got = einsum(mx.maps, mx.values, "b h t s, b s h v -> b t h v")
    torch.testing.assert_close(got, mx.output, rtol=1e-10, atol=1e-12)
    assert torch.all(mx.maps.triu(1) == 0)  # causal
    for a, b, what in zip(mx, ref, ("maps", "values", "output")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{name}: {what}")


# ------------------------------------------------------------------------------------------------
# typed states
# ------------------------------------------------------------------------------------------------

STATE_TYPES = {
    Attention: AttentionState,
    LinearAttention: MatrixState,
    GatedLinearAttention: MatrixState,
    DeltaNet: MatrixState,
    Mamba: MambaState,
    Mamba2: Mamba2State,
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_declared_state_is_the_returned_state(name, dtype):
    """``state_spec`` has the returned state's type, shapes and dtypes (a bf16 cache is 2 bytes a
    value, recurrent memories stay float32), and ``state_size_bytes`` is its ``nbytes``."""
    m = _make(name).to(dtype)
    for T in (3, 9):
        _, s = m(_x(T, B=3).to(dtype))
        assert type(s) is STATE_TYPES[type(m)]
        declared = m.state_spec(3, T)
        assert type(declared) is type(s) and declared.offset == s.offset == T
        assert [(tuple(t.shape), t.dtype) for t in tensors(declared)] == [
            (tuple(t.shape), t.dtype) for t in tensors(s)
        ]
        assert all(t.device.type == "meta" for t in tensors(declared))
        assert m.state_size_bytes(3, T) == nbytes(s) == nbytes(declared)
    # an explicit activation dtype overrides the parameters'
    assert m.state_size_bytes(3, 9, dtype=torch.float16) == nbytes(m.state_spec(3, 9, torch.float16))


def test_state_sizes_match_the_formulas():
    """The declared states give the closed-form sizes (float32 model, batch 2)."""
    att = Attention(D, n_heads=4, n_kv_heads=2, window=5)
    assert att.state_size_bytes(2, 3) == 2 * 2 * 3 * 2 * 8 * 4
    assert att.state_size_bytes(2, 100) == 2 * 2 * 4 * 2 * 8 * 4  # window − 1 kept
    gdn = DeltaNet(D, n_heads=4, gated=True)
    assert gdn.state_size_bytes(2, 50) == 2 * (4 * 8 * 8 * 4 + 3 * D * 3 * 4)
    mamba = Mamba(D, d_state=16)
    assert mamba.state_size_bytes(2) == 2 * 2 * D * (16 * 4 + 3 * 4)
    m2 = Mamba2(D, d_state=8, head_dim=16, n_groups=2)
    assert m2.state_size_bytes(2) == 2 * (4 * 8 * 16 * 4 + (2 * D + 2 * 2 * 8) * 3 * 4)
    la = LinearAttention(D, n_heads=2, normalize=True)
    assert la.state_size_bytes(2) == 2 * 2 * 16 * 17 * 4


def test_states_are_pytrees_and_stream():
    """The typed states go through the generic state functions (rows, joins) and keep streaming."""
    from mnemo.layers.state import cat_rows, select_rows

    for name in ("attention", "gated_deltanet", "mamba", "mamba2"):
        m = _make(name)
        x = _x(10, B=3)
        full, _ = m(x)
        _, s = m(x[:, :6])
        s = cat_rows([select_rows(s, 0), select_rows(s, slice(1, 3))])
        y, _ = m(x[:, 6:], s)
        assert_close(y, full[:, 6:], 1e-12, what=name)


def test_the_core_mixers_register_themselves():
    expected = {
        "attention": (Attention, {}),
        "linear_attention": (LinearAttention, {}),
        "gated_linear_attention": (GatedLinearAttention, {}),
        "gla": (GatedLinearAttention, {"gate": "gla"}),
        "retnet": (GatedLinearAttention, {"gate": "retnet", "expand_k": 1.0, "expand_v": 2.0}),
        "deltanet": (DeltaNet, {}),
        "gated_deltanet": (DeltaNet, {"gated": True}),
        "mamba": (Mamba, {}),
        "mamba2": (Mamba2, {}),
    }
    for name, (cls, kw) in expected.items():
        ctor = MIXERS[name]
        assert getattr(ctor, "func", ctor) is cls, name
        assert getattr(ctor, "keywords", {}) == kw, name
