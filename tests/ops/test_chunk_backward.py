"""The fast chunk forms' hand-written backward passes (``_GLAChunk``, ``_DeltaChunk``): gradcheck
in float64, agreement with the token-loop reference (every input, gate, ``beta`` and
``initial_state``), the autograd fallback for strong decays, dtypes and ``torch.compile``."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from mnemo.ops import delta_rule, gated_delta_rule, gated_linear_attention, linear_attention
from tests.helpers import assert_close


def _inputs(B=2, T=7, H=2, K=3, V=2, dtype=torch.float64, seed=0, gate=None, strong=False):
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
        "beta": torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.9 + 0.05,
        "S0": torch.randn(B, H, K, V, generator=gen, dtype=dtype),
    }
    if gate is not None:
        shape = (B, T, H) if gate == "scalar" else (B, T, H, K)
        g = F.logsigmoid(torch.randn(shape, generator=gen, dtype=dtype) + 1.0)
        x["g"] = g * 40 if strong else g  # strong: a chunk decays by > 30 nats -> autograd fallback
    return x


def _gla(gate):
    def f(q, k, v, S0, g=None, beta=None, **kw):
        return gated_linear_attention(q, k, v, g, initial_state=S0, output_final_state=True, **kw)

    return f


def _la(feature_map, normalize):
    def f(q, k, v, S0, beta=None, **kw):
        return linear_attention(
            q,
            k,
            v,
            feature_map=feature_map,
            normalize=normalize,
            initial_state=S0,
            output_final_state=True,
            **kw,
        )

    return f


def _delta(q, k, v, S0, beta, g=None, **kw):
    if g is None:
        return delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, **kw)
    return gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True, **kw)


CASES = [
    ("gla_nogate", _gla(None), None, ("q", "k", "v", "S0")),
    ("gla_scalar", _gla("scalar"), "scalar", ("q", "k", "v", "g", "S0")),
    ("gla_channel", _gla("channel"), "channel", ("q", "k", "v", "g", "S0")),
    ("linear_elu_norm", _la("elu", True), None, ("q", "k", "v", "S0")),
    ("delta_rule", _delta, None, ("q", "k", "v", "beta", "S0")),
    ("gated_delta_rule", _delta, "scalar", ("q", "k", "v", "beta", "g", "S0")),
]
IDS = [c[0] for c in CASES]
# (case, strong): the gated cases also with decays strong enough to take the autograd fallback
WITH_FALLBACK = [pytest.param(*c, False, id=f"{c[0]}-fast") for c in CASES] + [
    pytest.param(*c, True, id=f"{c[0]}-fallback") for c in CASES if c[2] is not None
]


@pytest.fixture
def fallback_calls(monkeypatch):
    """Counts calls of the autograd fallbacks (so the tests know which path ran)."""
    dr = importlib.import_module("mnemo.ops.delta_rule")
    gla = importlib.import_module("mnemo.ops.gated_linear_attention")

    calls = []
    for mod, fname in ((gla, "gla_chunk_autograd"), (dr, "delta_chunk_autograd")):
        orig = getattr(mod, fname)

        def spy(*a, _orig=orig, **k):
            calls.append(1)
            return _orig(*a, **k)

        monkeypatch.setattr(mod, fname, spy)
    return calls


def _prepare(name, gate, strong=False, **kw):
    x = _inputs(gate=gate, strong=strong, **kw)
    if name == "linear_elu_norm":  # the normaliser lives in an extra state column
        x["S0"] = torch.cat([x["S0"], x["S0"][..., :1].abs()], -1)
    return x


@pytest.mark.parametrize("name, fn, gate, names, strong", WITH_FALLBACK)
def test_gradcheck_chunk_form(name, fn, gate, names, strong, fallback_calls):
    """torch.autograd.gradcheck of the chunk form (float64, 3 chunks of 3 with padding), every
    differentiable input including gates, beta and the initial state."""
    x = _prepare(name, gate, strong)
    fixed = {n: t for n, t in x.items() if n not in names}

    def f(*args):
        return fn(**dict(zip(names, args)), **fixed, chunk_size=3)

    args = tuple(x[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)
    assert bool(fallback_calls) == strong


@pytest.mark.parametrize("name, fn, gate, names, strong", WITH_FALLBACK)
@pytest.mark.parametrize("T, C", [(1, 8), (8, 8), (29, 8), (40, 64)])
def test_gradients_match_the_reference(name, fn, gate, names, T, C, strong):
    """Output and final-state gradients of the chunk form equal the token loop's (float64, 1e-10)
    w.r.t. every input, gate, beta and the initial state, for one, several and partial chunks."""
    x = _prepare(name, gate, strong, T=T, K=5, V=4)
    results = {}
    for mode in ("recurrent", "chunk"):
        xs = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
        o, s = fn(**xs, mode=mode, chunk_size=C)
        gen = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
        loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
        loss.backward()
        results[mode] = (o, s, {n: xs[n].grad for n in names})
    (o_ref, s_ref, g_ref), (o, s, grads) = results["recurrent"], results["chunk"]
    assert_close(o, o_ref, 1e-10, what=f"{name} output")
    assert_close(s, s_ref, 1e-10, what=f"{name} state")
    for n in names:
        assert_close(grads[n], g_ref[n], 1e-10, what=f"{name} d/d{n}")


@pytest.mark.parametrize("name, fn, gate, names", CASES, ids=IDS)
def test_partial_requires_grad_and_unused_state(name, fn, gate, names):
    """Only some inputs need gradients, and the final state is not used by the loss."""
    x = _prepare(name, gate, T=20, K=4, V=3)
    ref = {n: t.clone().requires_grad_(n == "v") for n, t in x.items()}
    got = {n: t.clone().requires_grad_(n == "v") for n, t in x.items()}
    fn(**ref, mode="recurrent")[0].square().sum().backward()
    fn(**got, chunk_size=8)[0].square().sum().backward()
    assert_close(got["v"].grad, ref["v"].grad, 1e-10)


@pytest.mark.parametrize("op", ["gla_scalar", "gla_channel", "gated_delta_rule"])
def test_bf16_inputs_fp32_states_and_bf16_gradients(op):
    """bf16 inputs accumulate in fp32 (fp32 state), and their gradients come back in bf16, close to
    the fp32 computation on the same (bf16-rounded) values."""
    name, fn, gate, names = next(c for c in CASES if c[0] == op)
    x = {n: t.float() for n, t in _prepare(name, gate, T=70, K=16, V=16).items()}
    x16 = {n: (t.bfloat16() if n != "S0" else t) for n, t in x.items()}
    x32 = {n: t.float() for n, t in x16.items()}
    out = {}
    for key, xs in (("bf16", x16), ("fp32", x32)):
        xs = {n: t.clone().requires_grad_(n in names) for n, t in xs.items()}
        o, s = fn(**xs, chunk_size=32)
        (o.float().square().sum() + s.square().sum()).backward()
        out[key] = (o, s, {n: xs[n].grad for n in names})
    o, s, grads = out["bf16"]
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert_close(s, out["fp32"][1], 1e-6)
    assert_close(o.float(), out["fp32"][0], 1e-2)
    for n in names:
        assert grads[n].dtype == x16[n].dtype
        assert_close(grads[n].float(), out["fp32"][2][n], 2e-2, what=f"d/d{n}")


def test_non_contiguous_inputs():
    """Inputs that are views with unusual strides give the same results and gradients."""
    x = _inputs(T=19, K=4, V=3, gate="scalar")
    names = ("q", "k", "v", "g", "beta")
    ref = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
    o_ref, _ = _delta(**ref, chunk_size=8)
    o_ref.sum().backward()
    # the same values stored transposed (time-major)
    got = {n: t.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(n in names) for n, t in x.items()}
    o, _ = _delta(**got, chunk_size=8)
    o.sum().backward()
    assert_close(o, o_ref, 1e-12)
    for n in names:
        assert_close(got[n].grad, ref[n].grad, 1e-12, what=n)


@pytest.mark.parametrize("op", ["gla", "gated_delta_rule", "selective_scan"])
@pytest.mark.parametrize("cotangent", ["needs grad", "constant"])
def test_graph_of_the_gradient_is_refused(op, cotangent):
    """The hand-written backwards are first order: asking for a graph of the gradient
    (``create_graph=True``) raises a clear error. With a constant cotangent (``o.sum()``) PyTorch's
    ``once_differentiable`` alone would return a constant gradient and silently drop its
    dependence on the inputs (a gradient penalty would miss terms)."""
    from mnemo.ops import gated_delta_rule, selective_scan

    x = _inputs(T=9, gate="scalar")
    assert (x["g"] <= 0).all() and ((x["beta"] > 0) & (x["beta"] < 1)).all()  # a decay and a write strength
    gen = torch.Generator().manual_seed(4)
    A = -torch.rand(x["q"].shape[2] * x["q"].shape[3], 3, generator=gen, dtype=x["q"].dtype)
    Bm = torch.randn(*x["q"].shape[:2], 3, generator=gen, dtype=x["q"].dtype)

    def loss_of(q, mode):
        if op == "gla":
            o = gated_linear_attention(q, x["k"], x["v"], x["g"], chunk_size=4, mode=mode)[0]
        elif op == "gated_delta_rule":
            o = gated_delta_rule(q, x["k"], x["v"], g=x["g"], beta=x["beta"], chunk_size=4, mode=mode)[0]
        else:
            u = q.flatten(2)  # [B, T, H K]
            o = selective_scan(u, u.detach().sigmoid(), A, Bm, Bm, delta_softplus=True, mode=mode)[0]
        return o.square().sum() if cotangent == "needs grad" else o.sum()

    q = x["q"].clone().requires_grad_(True)
    loss = loss_of(q, "chunk")
    with pytest.raises(RuntimeError, match="first order.*create_graph=True.*mode='recurrent'"):
        torch.autograd.grad(loss, q, create_graph=True)
    (g,) = torch.autograd.grad(loss, q)  # first order still works: the token loop's gradient
    q_ref = x["q"].clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(loss_of(q_ref, "recurrent"), q_ref)
    assert_close(g, g_ref, 1e-10)


@pytest.mark.parametrize("op", ["gla_scalar", "gla_channel", "gated_delta_rule"])
def test_torch_compile_matches_eager(op):
    """``torch.compile(op, backend="eager")`` runs (graph breaks allowed) and matches eager, outputs
    and gradients."""
    name, fn, gate, names = next(c for c in CASES if c[0] == op)
    x = {n: t.float() for n, t in _prepare(name, gate, T=40, K=8, V=4).items()}

    def call(**kw):
        return fn(**kw, chunk_size=16)

    compiled = torch.compile(call, backend="eager")
    res = []
    for f in (call, compiled):
        xs = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
        o, s = f(**xs)
        (o.square().sum() + s.sum()).backward()
        res.append((o, s, [xs[n].grad for n in names]))
    (o1, s1, g1), (o2, s2, g2) = res
    assert_close(o2, o1, 1e-6)
    assert_close(s2, s1, 1e-6)
    for a, b in zip(g2, g1):
        assert_close(a, b, 1e-6)


@pytest.mark.parametrize("op", ["gla_channel", "delta_rule", "gated_delta_rule"])
def test_bf16_autocast_keeps_fp32_accumulation(op):
    """Under ``torch.autocast`` (bf16) the chunk forms still compute and accumulate the state in
    float32: the same results as without autocast, gradients included."""
    name, fn, gate, names = next(c for c in CASES if c[0] == op)
    x = {n: t.float() for n, t in _prepare(name, gate, T=50, K=8, V=4).items()}
    res = []
    for enabled in (False, True):
        xs = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            o, s = fn(**xs, chunk_size=16)
            (o.float().square().sum() + s.float().sum()).backward()
        res.append((o, s, [xs[n].grad for n in names]))
    (o1, s1, g1), (o2, s2, g2) = res
    assert o2.dtype == torch.float32 and s2.dtype == torch.float32
    assert_close(o2, o1, 1e-6)
    assert_close(s2, s1, 1e-6)
    for a, b in zip(g2, g1):
        assert_close(a, b, 1e-6)


@pytest.mark.parametrize("name, fn, gate, names", CASES, ids=IDS)
def test_backward_in_head_groups(name, fn, gate, names, monkeypatch):
    """The backward's per-head-group pass (one head per group here) gives the reference gradients."""
    for budget in ("GROUP_BYTES", "GROUP_BYTES_TUNED"):  # whether or not malloc is tuned in this process
        monkeypatch.setattr(importlib.import_module("mnemo.ops._chunked"), budget, 1)
    x = _prepare(name, gate, B=2, T=29, H=3, K=5, V=4)
    results = {}
    for mode in ("recurrent", "chunk"):
        xs = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
        o, s = fn(**xs, mode=mode, chunk_size=8)
        ((o * o.detach().sin()).sum() + s.sum()).backward()
        results[mode] = {n: xs[n].grad for n in names}
    for n in names:
        assert_close(results["chunk"][n], results["recurrent"][n], 1e-10, what=f"{name} d/d{n}")


@pytest.mark.parametrize("op", ["gla", "gated_delta_rule"])
@pytest.mark.parametrize("B,H,V", [(0, 2, 4), (2, 0, 4), (2, 2, 0)])
def test_empty_batch_heads_or_values_in_chunk_mode(op, B, H, V):
    """Empty B, H or V: the chunk form returns what the token loop returns (empty outputs, the
    state passed through) instead of failing on an empty reduction."""
    from mnemo.ops import gated_delta_rule

    T, K = 5, 3
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, g = torch.randn(B, T, H, V), -torch.rand(B, T, H)  # log decays <= 0
    beta = torch.rand(B, T, H) * 0.9 + 0.05  # write strengths in (0, 1)
    S0 = torch.randn(B, H, K, V)
    out = {}
    for mode in ("chunk", "recurrent"):
        if op == "gla":
            out[mode] = gated_linear_attention(
                q, k, v, g, initial_state=S0, output_final_state=True, mode=mode
            )
        else:
            out[mode] = gated_delta_rule(
                q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True, mode=mode
            )
    for (a, b), shape in zip(zip(out["chunk"], out["recurrent"]), [(B, T, H, V), (B, H, K, V)]):
        assert a.shape == b.shape == shape
        assert torch.equal(a, b)


def test_zero_head_dim_is_a_clear_error():
    q = torch.randn(1, 4, 2, 0)
    with pytest.raises(ValueError, match="head dimension K >= 1"):
        gated_linear_attention(q, q, torch.randn(1, 4, 2, 3), None)


# -- strong gates: the chunk is halved before the autograd fallback takes over ------------------

GATED = [c for c in CASES if c[2] is not None]


@pytest.fixture
def fast_chunk_sizes(monkeypatch):
    """Records the chunk size each call of the hand-written chunk Functions ran at."""
    dr = importlib.import_module("mnemo.ops.delta_rule")
    gla = importlib.import_module("mnemo.ops.gated_linear_attention")
    sizes = []
    for cls in (dr._DeltaChunk, gla._GLAChunk):
        orig = cls.apply

        def spy(*a, _orig=orig):
            sizes.append(a[-1])  # the chunk size is the last argument of both
            return _orig(*a)

        monkeypatch.setattr(cls, "apply", spy)
    return sizes


def _with_gate(name, gate, per_token, T):
    """Float64 inputs whose log gates lie in ``per_token`` (a ``(low, high)`` range, nats per token)."""
    x = _prepare(name, gate, T=T, K=5, V=4)
    gen = torch.Generator().manual_seed(11)
    lo, hi = per_token
    x["g"] = -(lo + (hi - lo) * torch.rand(x["g"].shape, generator=gen, dtype=x["g"].dtype))
    return x


@pytest.mark.parametrize("name, fn, gate, names", GATED, ids=[c[0] for c in GATED])
@pytest.mark.parametrize("T", [100, 128])
def test_strong_gates_halve_the_chunk_and_match_the_reference(
    name, fn, gate, names, T, fast_chunk_sizes, fallback_calls
):
    """0.5-0.7 nats a token: a 64-token chunk decays by 32-45 nats (past the factorised form's 30),
    a 32-token one by at most 22.4. The call runs the hand-written form at 32 (no autograd
    fallback) and its outputs, final state and every gradient equal the token loop's (1e-10), for
    a whole and a partial last chunk."""
    x = _with_gate(name, gate, (0.5, 0.7), T)
    results = {}
    for mode in ("recurrent", "chunk"):
        xs = {n: t.clone().requires_grad_(n in names) for n, t in x.items()}
        o, s = fn(**xs, mode=mode, chunk_size=64)
        gen = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
        loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
        loss.backward()
        results[mode] = (o, s, {n: xs[n].grad for n in names})
    assert fast_chunk_sizes == [32] and not fallback_calls
    (o_ref, s_ref, g_ref), (o, s, grads) = results["recurrent"], results["chunk"]
    assert_close(o, o_ref, 1e-10, what=f"{name} output")
    assert_close(s, s_ref, 1e-10, what=f"{name} state")
    for n in names:
        assert_close(grads[n], g_ref[n], 1e-10, what=f"{name} d/d{n}")


@pytest.mark.parametrize("name, fn, gate, names", GATED, ids=[c[0] for c in GATED])
@pytest.mark.parametrize("chunk_size, per_token", [(64, (2.0, 2.5)), (8, (5.0, 6.0)), (64, "reset")])
def test_halving_stops_at_the_floor_then_falls_back(
    name, fn, gate, names, chunk_size, per_token, fast_chunk_sizes, fallback_calls
):
    """2-2.5 nats a token decay by ≥ 32 nats even in a 16-token chunk, the smallest it halves to;
    a chunk of 8 (already below 16) is not halved; a hard reset (``-inf``) decays without bound.
    All three take the autograd form at the caller's chunk size, which matches the token loop."""
    if per_token == "reset":
        x = _with_gate(name, gate, (0.1, 0.2), 40)
        x["g"][:, 17] = -torch.inf
    else:
        x = _with_gate(name, gate, per_token, 40)
    args = {n: x[n] for n in x}
    o, s = fn(**args, mode="chunk", chunk_size=chunk_size)
    assert fallback_calls == [1] and fast_chunk_sizes == []
    o_ref, s_ref = fn(**args, mode="recurrent")
    assert_close(o, o_ref, 1e-10, what=f"{name} output")
    assert_close(s, s_ref, 1e-10, what=f"{name} state")


def test_chunks_within_span_by_hand():
    """The chunk size and cumulative gates of :func:`chunks_within_span` against a hand loop: a
    constant 0.6 nats a token spans 38.4 nats in 64 tokens and 19.2 in 32, so 64 → 32; ``b`` is the
    running sum within each 32-token chunk (zero-padded past ``T``); per-channel gates keep their
    channel axis; a NaN gate keeps the first size; ``-inf`` or a span past the smallest size gives
    ``(None, None)``."""
    from mnemo.ops._chunked import chunks_within_span

    B, T, H, K = 2, 70, 3, 4
    g = torch.full((B, T, H), -0.6, dtype=torch.float64)
    C, b = chunks_within_span(g, 64, torch.float64, 30.0)
    assert C == 32 and b.shape == (B, H, 3, 32, 1)
    for t in range(96):
        expect = -0.6 * (t % 32 + 1) if t < T else -0.6 * (T - 64)  # padding adds zero gates
        assert b[0, 0, t // 32, t % 32, 0].item() == pytest.approx(expect, abs=1e-12)
    gc = torch.full((B, T, H, K), -0.1, dtype=torch.float64)
    gc[..., 0] = -0.6
    C, b = chunks_within_span(gc, 64, torch.float32, 30.0)
    assert C == 32 and b.shape == (B, H, 3, 32, K) and b.dtype == torch.float32
    assert C == chunks_within_span(g, 64, torch.float64, 30.0, min_chunk=32)[0]
    assert chunks_within_span(g, 64, torch.float64, 30.0, min_chunk=33) == (None, None)
    gn = g.clone()
    gn[0, 5, 0] = torch.nan
    assert chunks_within_span(gn, 64, torch.float64, 30.0)[0] == 64
    gi = torch.full((B, T, H), -0.01, dtype=torch.float64)
    gi[1, 40, 2] = -torch.inf
    chunked = importlib.import_module("mnemo.ops._chunked")
    tried = []
    real = chunked.to_chunks
    chunked.to_chunks = lambda x, C, *a, **k: tried.append(C) or real(x, C, *a, **k)
    try:
        assert chunks_within_span(gi, 64, torch.float64, 30.0) == (None, None)
    finally:
        chunked.to_chunks = real
    assert tried == [64]  # a hard reset fits no chunk size: no halving is tried
