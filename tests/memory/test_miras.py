"""Miras (Behrouz et al. 2025, "It's All Connected", arXiv 2504.13173): Yaad's per-token Huber
switch (Eq. 16) and elastic-net retention (Eq. 22), checked against token loops written from the
paper's equations (plain tensors, one head, float64), against cases with a known answer, and chunk
form against the token-loop reference (outputs, states and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.memory import MemorySpec, init_state, neural_memory, preset
from tests.helpers import assert_close
from tests.memory.test_engine import _run as _engine_run

TOL = 1e-10
DT = torch.float64


# ----------------------------------------------------------------------------------------------
# the paper's equations, written out (no engine code)
# ----------------------------------------------------------------------------------------------


def _soft(x, gamma):
    """S_γ(x) from its definition: 0 where |x| ≤ γ, x − γ·sign(x) elsewhere."""
    return torch.where(x.abs() <= gamma, torch.zeros_like(x), x - gamma * torch.sign(x))


def _mlp(W, x):
    """2-layer MLP memory without residual / norm: gelu(x W1) W2."""
    return F.gelu(x @ W[0]) @ W[1]


def _paper_grad(W, k, v, objective, delta):
    """∇_W ℓ at W for one token. l2: ∇ ½‖M(k) − v‖². huber (Eq. 16): ∇ℓ₂ if ‖M(k) − v‖ ≤ δ,
    else δ ∇ℓ₁ with ℓ₁ = ‖M(k) − v‖₁."""
    if len(W) == 1:  # matrix memory M(k) = kᵀW: hand-written gradients
        e = k @ W[0] - v
        if objective == "l2" or e.norm() <= delta:
            r = e
        else:
            r = delta * torch.sign(e)
        return [torch.outer(k, r)]
    Wg = [w.detach().clone().requires_grad_(True) for w in W]
    e = _mlp(Wg, k) - v
    if objective == "l2" or e.detach().norm() <= delta:
        loss = 0.5 * (e * e).sum()
    else:
        loss = delta * e.abs().sum()
    return list(torch.autograd.grad(loss, Wg))


def _paper_loop(W0, q, k, v, theta, lam, *, objective="huber", delta=None, l1=None, chunk=1):
    """W_t = λ_t W_{t−1} − θ_t ∇ℓ(W_anchor; k_t, v_t), then W_t ← S_{l1·θ_t}(W_t) with elastic-net
    retention (Eq. 22: S_γ(λ W − ζ ∇ℓ), γ = ζ/α); the anchor is W at the start of each chunk of
    ``chunk`` tokens (chunk = 1: the paper's online rule). o_t = M_{W_t}(q_t). Returns (o, W_T, n_small,
    n_large): how many tokens took the ℓ2 / the δ·ℓ1 branch."""
    W = [w.clone() for w in W0]
    outs, n_small, n_large = [], 0, 0
    for t in range(q.shape[0]):
        if t % chunk == 0:
            Wa = [w.clone() for w in W]
        d = None if delta is None else delta[t]
        if d is not None:
            e = (k[t] @ Wa[0] if len(Wa) == 1 else _mlp(Wa, k[t])) - v[t]
            n_small += int(e.norm() <= d)
            n_large += int(e.norm() > d)
        G = _paper_grad(Wa, k[t], v[t], objective, d)
        W = [lam[t] * w - theta[t] * gw for w, gw in zip(W, G)]
        if l1 is not None:
            W = [_soft(w, l1 * theta[t]) for w in W]
        outs.append(q[t] @ W[0] if len(W) == 1 else _mlp(W, q[t]))
    return torch.stack(outs), W, n_small, n_large


# ----------------------------------------------------------------------------------------------
# helpers: one head, tiny sizes
# ----------------------------------------------------------------------------------------------


def _one_head(T, K=3, seed=0, delta_range=(0.3, 1.5)):
    g_ = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(T, K, generator=g_, dtype=DT),
        "k": F.normalize(torch.randn(T, K, generator=g_, dtype=DT), dim=-1),
        "v": torch.randn(T, K, generator=g_, dtype=DT),
        "theta": torch.rand(T, generator=g_, dtype=DT) * 0.5 + 0.1,
        "lam": torch.rand(T, generator=g_, dtype=DT) * 0.2 + 0.8,
        "delta": torch.rand(T, generator=g_, dtype=DT) * (delta_range[1] - delta_range[0]) + delta_range[0],
    }
    return x


def _engine(spec, x, W0, mode, with_delta=True):
    """Run the engine on the one-head tensors (B = H = 1)."""

    def bt(t):
        return t[None, :, None]

    o, s = neural_memory(
        spec,
        bt(x["q"]),
        bt(x["k"]),
        bt(x["v"]),
        bt(x["theta"]),
        g=bt(x["lam"].log()) if spec.decays else None,
        delta=bt(x["delta"]) if with_delta else None,
        initial_state=init_state(spec, [w[None, None] for w in W0]),
        output_final_state=True,
        mode=mode,
        use_closed_form=False,
    )
    return o[0, :, 0], [w[0, 0] for w in s.weights]


def _weights(spec, K=3, seed=1, scale=0.5):
    g_ = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(i, o, generator=g_, dtype=DT) for i, o in spec.layer_dims(K, K)]


_MLP = dict(architecture="mlp", depth=2, expansion=2.0, activation="gelu")


# ----------------------------------------------------------------------------------------------
# (a) the engine against the paper's token loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["matrix", "mlp"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_yaad_matches_paper_loop(arch, chunk, mode):
    """Yaad's update (Eq. 16) with weight decay: ℓ2 step or δ_t·ℓ1 step, switched per token."""
    spec = MemorySpec(
        objective="huber", retention="decay", chunk_size=chunk, **(_MLP if arch == "mlp" else {})
    )
    x = _one_head(13)
    W0 = _weights(spec)
    o_ref, W_ref, n_small, n_large = _paper_loop(
        W0, x["q"], x["k"], x["v"], x["theta"], x["lam"], delta=x["delta"], chunk=chunk
    )
    assert n_small >= 2 and n_large >= 2, (n_small, n_large)  # both branches are exercised
    o, W = _engine(spec, x, W0, mode)
    assert_close(o, o_ref, TOL, what="output")
    for a, b in zip(W, W_ref):
        assert_close(a, b, TOL, what="weights")


@pytest.mark.parametrize("arch", ["matrix", "mlp"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("objective", ["l2", "huber"])
def test_elastic_net_matches_paper_loop(arch, chunk, mode, objective):
    """Elastic-net retention (Eq. 22): W_t = S_{γ_t}(λ_t W_{t−1} − θ_t ∇ℓ), γ_t = l1·θ_t."""
    l1 = 0.4 if arch == "matrix" else 0.05  # a stronger l1 zeroes the whole MLP (a fixed point)
    spec = MemorySpec(
        objective=objective,
        retention="elastic_net",
        l1=l1,
        chunk_size=chunk,
        **(_MLP if arch == "mlp" else {}),
    )
    x = _one_head(13, seed=2)
    W0 = _weights(spec, seed=3, scale=0.5 if arch == "matrix" else 1.0)
    delta = x["delta"] if objective == "huber" else None
    o_ref, W_ref, _, _ = _paper_loop(
        W0, x["q"], x["k"], x["v"], x["theta"], x["lam"], objective=objective, delta=delta, l1=l1, chunk=chunk
    )
    zeros = sum(int((w == 0).sum()) for w in W_ref)
    assert 0 < zeros < sum(w.numel() for w in W_ref)  # the thresholding bites, but not everywhere
    o, W = _engine(spec, x, W0, mode, with_delta=objective == "huber")
    assert_close(o, o_ref, TOL, what="output")
    for a, b in zip(W, W_ref):
        assert_close(a, b, TOL, what="weights")
        assert torch.equal(a == 0, b == 0)  # the same entries are exactly zero


# ----------------------------------------------------------------------------------------------
# (b) known answers
# ----------------------------------------------------------------------------------------------


def _single_token(spec, W0, k, v, theta, delta, q, mode):
    x = {
        "q": q[None],
        "k": k[None],
        "v": v[None],
        "theta": theta.reshape(1),
        "lam": torch.ones(1, dtype=DT),
        "delta": delta.reshape(1),
    }
    return _engine(spec, x, W0, mode, with_delta=spec.objective == "huber")


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("side", ["below", "above"])
def test_huber_token_switch_known_answer(mode, side):
    """‖e‖ just below δ: exactly the ℓ2 (delta-rule) step; just above: exactly δ·sign(e)."""
    g_ = torch.Generator().manual_seed(5)
    K = 4
    W0 = 0.5 * torch.randn(K, K, generator=g_, dtype=DT)
    k = F.normalize(torch.randn(K, generator=g_, dtype=DT), dim=0)
    q = torch.randn(K, generator=g_, dtype=DT)
    u = F.normalize(torch.randn(K, generator=g_, dtype=DT), dim=0)
    delta, theta = torch.tensor(0.7, dtype=DT), torch.tensor(0.3, dtype=DT)
    norm = delta * (1 - 1e-6 if side == "below" else 1 + 1e-6)
    v = k @ W0 - norm * u  # error e = M(k) − v = norm · u
    e = k @ W0 - v
    assert (e.norm() <= delta) == (side == "below")
    r = e if side == "below" else delta * torch.sign(e)
    W_expected = W0 - theta * torch.outer(k, r)
    spec = MemorySpec(objective="huber", retention="none", chunk_size=1)
    o, W = _single_token(spec, [W0], k, v, theta, delta, q, mode)
    assert_close(W[0], W_expected, 1e-14)
    assert_close(o[0], q @ W_expected, 1e-14)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_token_and_coordinate_huber_differ_where_they_should(mode):
    """‖e‖ > δ while every |e_i| < δ: the per-token form takes δ·sign(e), the coordinate-wise one
    (Eq. 14) stays quadratic in every coordinate, i.e. the ℓ2 step."""
    K = 4
    W0 = torch.zeros(K, K, dtype=DT)
    k = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=DT)
    q = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=DT)
    v = torch.tensor([-0.4, 0.3, -0.2, 0.35], dtype=DT)  # e = −v: ‖e‖ ≈ 0.64, max |e_i| = 0.4
    delta, theta = torch.tensor(0.5, dtype=DT), torch.tensor(0.25, dtype=DT)
    e = -v
    W_token = W0 - theta * torch.outer(k, delta * torch.sign(e))
    W_coord = W0 - theta * torch.outer(k, e)
    for hm, W_exp in (("token", W_token), ("coordinate", W_coord)):
        spec = MemorySpec(objective="huber", huber_mode=hm, retention="none", chunk_size=1)
        _, W = _single_token(spec, [W0], k, v, theta, delta, q, mode)
        assert torch.allclose(W[0], W_exp, rtol=0, atol=1e-15), hm


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_soft_thresholding_known_answer(mode):
    """A zero step (dot objective, v = 0) and no decay (λ = 1): W_1 = S_γ(W_0) with γ = l1·θ = 0.1:
    entries with |w| ≤ γ become exactly 0, the others move exactly γ towards 0."""
    W0 = torch.tensor(
        [
            [0.05, -0.1, 0.1, 0.3],
            [-0.25, 0.0, 0.099, -0.101],
            [1.5, -2.0, 0.2, -0.05],
            [0.11, -0.09, 0.7, 0.0],
        ],
        dtype=DT,
    )
    spec = MemorySpec(objective="dot", retention="elastic_net", l1=0.2, chunk_size=1)
    zero = torch.zeros(4, dtype=DT)
    theta = torch.tensor(0.5, dtype=DT)  # γ = 0.2 · 0.5 = 0.1 exactly
    q = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=DT)
    o, W = _single_token(spec, [W0], zero, zero, theta, theta, q, mode)
    gamma = 0.1
    expected = torch.where(W0.abs() <= gamma, torch.zeros_like(W0), W0 - gamma * torch.sign(W0))
    assert torch.equal(W[0], expected)
    assert int((W[0] == 0).sum()) == 8  # 0.05, ±0.1, 0.0 (×2), 0.099, −0.05, −0.09
    assert W[0][2, 0] == 1.5 - 0.1 and W[0][2, 1] == -2.0 + 0.1 and W[0][1, 3] == -0.101 + 0.1
    assert_close(o[0], q @ expected, 1e-15)


def test_elastic_net_with_zero_l1_is_plain_decay():
    spec = MemorySpec(objective="l2", retention="elastic_net", l1=0.0, chunk_size=1)
    x = _one_head(9, seed=7)
    W0 = _weights(spec)
    for mode in ("recurrent", "chunk"):
        o, W = _engine(spec, x, W0, mode, with_delta=False)
        o2, W2 = _engine(spec.replace(retention="decay"), x, W0, mode, with_delta=False)
        assert_close(o, o2, 1e-14)
        assert_close(W[0], W2[0], 1e-14)


# ----------------------------------------------------------------------------------------------
# (c) chunk form == token-loop reference: outputs, states and gradients (float64, B = H = 2)
# ----------------------------------------------------------------------------------------------

B, H, K = 2, 2, 4


def _batch(spec, T, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=g_, dtype=DT),
        "k": F.normalize(torch.randn(B, T, H, K, generator=g_, dtype=DT), dim=-1),
        "v": torch.randn(B, T, H, K, generator=g_, dtype=DT),
        "theta": torch.rand(B, T, H, generator=g_, dtype=DT) * 0.5 + 0.1,
    }
    if spec.decays:
        shape = (B, T, H, K) if spec.decay_per_channel else (B, T, H)
        x["g"] = F.logsigmoid(torch.randn(shape, generator=g_, dtype=DT) + 2)
    if spec.optimizer == "momentum":
        x["eta"] = torch.rand(B, T, H, generator=g_, dtype=DT) * 0.9
    if spec.objective == "huber":
        x["delta"] = torch.rand(B, T, H, generator=g_, dtype=DT) * 1.2 + 0.3
    ws = [0.4 * torch.randn(B, H, i, o, generator=g_, dtype=DT) for i, o in spec.layer_dims(K, K)]
    return x, ws


def _run(spec, x, ws, mode):
    return _engine_run(spec, x, init_state(spec, ws), mode, use_closed_form=False)


_RES = dict(residual=True, norm=True)
SPECS = {
    "yaad-preset": lambda c: preset("yaad", chunk_size=c, expansion=2.0),
    "huber-token-matrix": lambda c: MemorySpec(objective="huber", retention="decay", chunk_size=c),
    "huber-token-mlp-momentum": lambda c: MemorySpec(
        objective="huber", retention="decay", optimizer="momentum", chunk_size=c, **_MLP, **_RES
    ),
    "elastic-matrix": lambda c: MemorySpec(objective="l2", retention="elastic_net", l1=0.5, chunk_size=c),
    "elastic-matrix-channel": lambda c: MemorySpec(
        objective="l2", retention="elastic_net", decay_per_channel=True, l1=0.5, chunk_size=c
    ),
    "elastic-mlp-huber-momentum-clip": lambda c: MemorySpec(
        objective="huber",
        retention="elastic_net",
        optimizer="momentum",
        l1=0.1,
        grad_clip=3.0,  # clips some tokens, not all (a clipped δ·sign step does not depend on δ)
        chunk_size=c,
        **_MLP,
        **_RES,
    ),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("chunk", [1, 4])
def test_chunk_equals_reference_outputs_and_gradients(name, chunk):
    spec = SPECS[name](chunk).validate()
    x, ws = _batch(spec, 11)

    def run(mode):
        xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        w0 = [w.clone().requires_grad_(True) for w in ws]
        o, s = _run(spec, xs, w0, mode)
        (o.square().sum() + sum((w * w).sum() for w in s.weights)).backward()
        return o, s, [xs[n].grad for n in sorted(xs)] + [w.grad for w in w0]

    o1, s1, g1 = run("chunk")
    o2, s2, g2 = run("recurrent")
    assert_close(o1, o2, TOL, what="output")
    for a, b in zip(s1.weights, s2.weights):
        assert_close(a, b, TOL, what="weights")
    if s2.momentum is not None:
        for a, b in zip(s1.momentum, s2.momentum):
            assert_close(a, b, TOL, what="momentum")
    for a, b in zip(g1, g2):
        assert a is not None and b is not None
        assert_close(a, b, TOL, what="gradient")


@pytest.mark.parametrize("name", ["yaad-preset", "elastic-matrix", "elastic-mlp-huber-momentum-clip"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_streaming_any_split_equals_full(name, mode):
    spec = SPECS[name](4).validate()
    x, ws = _batch(spec, 19, seed=3)
    o_full, s_full = _run(spec, x, ws, mode)
    outs, t, st = [], 0, init_state(spec, ws)
    for size in (3, 1, 5, 2, 8):
        xs = {n: v[:, t : t + size] for n, v in x.items()}
        o, st = _engine_run(spec, xs, st, mode)
        outs.append(o)
        t += size
    assert_close(torch.cat(outs, 1), o_full, TOL)
    for a, b in zip(st.weights, s_full.weights):
        assert_close(a, b, TOL)


def test_gradcheck_reference_elastic_huber():
    """torch.autograd.gradcheck of the token-loop reference (one head, matrix memory)."""
    spec = MemorySpec(objective="huber", retention="elastic_net", l1=0.3, chunk_size=2)
    x = _one_head(5, seed=11)

    def f(q, k, v, theta, lam, delta, w):
        o, s = neural_memory(
            spec,
            q[None, :, None],
            k[None, :, None],
            v[None, :, None],
            theta[None, :, None],
            g=lam.log()[None, :, None],
            delta=delta[None, :, None],
            initial_state=init_state(spec, [w[None, None]]),
            output_final_state=True,
            mode="recurrent",
        )
        return o, s.weights[0]

    args = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "theta", "lam", "delta")]
    w = (0.5 * torch.randn(3, 3, generator=torch.Generator().manual_seed(4), dtype=DT)).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (*args, w), eps=1e-7, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------


def test_presets_and_validation():
    assert preset("yaad").huber_mode == "token"
    assert preset("yaad_coordinate").huber_mode == "coordinate"
    assert preset("yaad_coordinate").replace(huber_mode="token") == preset("yaad")
    with pytest.raises(ValueError, match=r"MemorySpec.huber_mode: expected one of \('token', 'coordinate'\)"):
        MemorySpec(objective="huber", huber_mode="norm").validate()
    with pytest.raises(ValueError, match=r"MemorySpec.retention: expected one of .*'elastic_net'"):
        MemorySpec(retention="elastic").validate()
    with pytest.raises(ValueError, match=r"MemorySpec.l1: expected a finite number >= 0"):
        MemorySpec(retention="elastic_net", l1=-0.1).validate()
    with pytest.raises(ValueError, match=r"MemorySpec.decay_first"):
        MemorySpec(retention="elastic_net", decay_first=True).validate()
    spec = MemorySpec(retention="elastic_net")
    q = torch.zeros(1, 2, 1, 3)
    with pytest.raises(ValueError, match="needs the log decay g"):
        neural_memory(spec, q, q, q, torch.ones(1, 2, 1))
    with pytest.raises(ValueError, match="needs delta of shape"):
        neural_memory(preset("yaad"), q, q, q, torch.ones(1, 2, 1), g=torch.zeros(1, 2, 1))
