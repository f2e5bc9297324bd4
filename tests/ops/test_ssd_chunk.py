"""SSD's grouped chunk form (``mnemo.ops._ssd_chunk``, what ``ssd(mode="chunk")`` runs): outputs,
final state and the hand-written gradients of every input against the token-loop reference
(``mode="recurrent"``) and against a loop written here from the equation, in float64, for groups,
odd lengths, strong decays, hard resets, no decay, an initial state and split calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.ssm import Mamba2
from mnemo.ops._ssd_chunk import ssd_chunk
from tests.helpers import assert_close
from tests.ops.test_ssd import _run  # ssd(x, ..., mode) on the dict of inputs

NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "h0")


def _inputs(Bsz=2, T=21, H=4, P=3, N=5, G=2, decay="normal", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    x = {
        "x": r(Bsz, T, H, P),
        "dt": r(Bsz, T, H) - 1.0,
        "A": -(0.5 * r(H)).exp(),
        "B": r(Bsz, T, G, N),
        "C": r(Bsz, T, G, N),
        "D": r(H),
        "dt_bias": 0.5 * r(H),
        "h0": r(Bsz, H, N, P),
    }
    if decay == "strong":  # A ~ -16, dt ~ 2-4: ~40 nats per token, hundreds per 8-token chunk
        x["A"] = -16.0 - x["A"].abs()
        x["dt"] = x["dt"].abs() + 2.0
    elif decay == "reset":  # g = dt · A = -1e4 at a few tokens (clamped at -60): a hard reset
        x["A"] = torch.full((H,), -1.0, dtype=torch.float64)
        x["dt"][:, T // 2] = 1e4
        x["dt"][:, 0, 0] = 1e4
    elif decay == "zero":
        x["A"] = torch.zeros(H, dtype=torch.float64)
    return x


def _hand_loop(x, chunk_size=None):
    """From the equation, per head h of group γ = h // (H / G):
    h_t = exp(Δ_t A_h) h_{t−1} + B_{t,γ} (Δ_t x_t)ᵀ,   y_t = h_tᵀ C_{t,γ} + D_h x_t."""
    X = x["x"]
    Bsz, T, H, P = X.shape
    per = H // x["B"].shape[2]
    dt = F.softplus(x["dt"] + x["dt_bias"])
    h = [x["h0"][:, j] for j in range(H)]
    ys = []
    for t in range(T):
        y_t = []
        for j in range(H):
            g = j // per
            a = torch.exp(dt[:, t, j] * x["A"][j])[:, None, None]
            h[j] = a * h[j] + x["B"][:, t, g, :, None] * (dt[:, t, j, None] * X[:, t, j])[:, None, :]
            y_t.append(torch.einsum("bnp,bn->bp", h[j], x["C"][:, t, g]) + x["D"][j] * X[:, t, j])
        ys.append(torch.stack(y_t, 1))
    return torch.stack(ys, 1), torch.stack(h, 1)


def _grads(x, fn):
    x = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    y, h = fn(x)
    gen = torch.Generator().manual_seed(5)
    wy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    wh = torch.randn(h.shape, generator=gen, dtype=h.dtype)
    ((y * wy).sum() + (h * wh).sum()).backward()
    return (y.detach(), h.detach()), {n: x[n].grad for n in NAMES}


CASES = [
    # (G, T, chunk_size, decay)
    (1, 21, 8, "normal"),
    (2, 21, 8, "normal"),  # odd T: the last chunk padded
    (2, 5, 8, "normal"),  # T < chunk_size
    (1, 1, 8, "normal"),  # T = 1
    (2, 24, 8, "strong"),  # > 100 nats per chunk
    (1, 19, 8, "reset"),
    (2, 19, 4, "zero"),
]


@pytest.mark.parametrize("G, T, chunk_size, decay", CASES)
def test_chunk_matches_recurrent_and_hand_loop(G, T, chunk_size, decay):
    x = _inputs(T=T, G=G, decay=decay)
    (y, h), got = _grads(x, lambda a: _run(a, "chunk", chunk_size))
    (y_r, h_r), ref = _grads(x, lambda a: _run(a, "recurrent"))
    (y_h, h_h), hand = _grads(x, _hand_loop)
    for name, (yy, hh) in (("recurrent", (y_r, h_r)), ("hand loop", (y_h, h_h))):
        assert_close(y, yy, 1e-12, what=f"y vs {name}")
        assert_close(h, hh, 1e-12, what=f"final state vs {name}")
    # ∂L/∂g is a within-chunk reverse sum of O(1) terms that cancel where the decay is strong (the
    # true gradient of A is then ~1e-13): errors are measured against max(RMS of the gradient, 1e-2)
    for n in NAMES:
        assert got[n] is not None, f"no gradient reached {n}"
        assert_close(got[n], ref[n], 1e-10, floor=1e-2, what=f"d/d{n} vs recurrent")
        assert_close(got[n], hand[n], 1e-10, floor=1e-2, what=f"d/d{n} vs hand loop")


def test_strong_decay_really_spans_many_nats():
    """The 'strong' case is what the old fast path could not factorise (> 30 nats per chunk)."""
    x = _inputs(T=24, G=2, decay="strong")
    g = F.softplus(x["dt"] + x["dt_bias"]) * x["A"]
    assert float(g[:, :8].sum(1).max()) < -100.0


def test_gradcheck_tiny():
    x = _inputs(Bsz=1, T=5, H=2, P=2, N=3, G=1, seed=3)
    args = [x[n].clone().requires_grad_(True) for n in NAMES]

    def f(*a):
        return _run(dict(zip(NAMES, a)), "chunk", chunk_size=2)

    assert torch.autograd.gradcheck(f, args, atol=1e-8, rtol=1e-6)


def test_kernel_gradcheck_strong_gates_and_groups():
    """The kernel itself (grouped ``C``, ``B``; per-head ``v``, ``g``; an initial state) with gates of
    tens of nats per token."""
    gen = torch.Generator().manual_seed(7)
    Cg, Bg = (torch.randn(1, 6, 2, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 6, 4, 2, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 6, 4, generator=gen, dtype=torch.float64) * torch.tensor([0.1, 1.0, 10.0, 35.0])
    S0 = torch.randn(1, 4, 3, 2, generator=gen, dtype=torch.float64)
    args = [t.requires_grad_(True) for t in (Cg, Bg, v, g, S0)]
    assert torch.autograd.gradcheck(lambda *a: ssd_chunk(*a, 4), args, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("G", [1, 2])
def test_split_run_equals_one_run(G):
    x = _inputs(T=23, G=G)
    y, h = _run(x, "chunk")
    t1 = 10
    first = {n: (t[:, :t1] if n in ("x", "dt", "B", "C") else t) for n, t in x.items()}
    y1, h1 = _run(first, "chunk")
    second = {n: (t[:, t1:] if n in ("x", "dt", "B", "C") else t) for n, t in x.items()}
    second["h0"] = h1
    y2, h2 = _run(second, "chunk")
    assert_close(torch.cat([y1, y2], 1), y, 1e-12, what="split y")
    assert_close(h2, h, 1e-12, what="split final state")


def test_float32_inputs_compute_in_float32_and_match():
    x = _inputs(T=30, G=2, decay="strong")
    x32 = {n: t.float() for n, t in x.items()}
    y, h = _run(x32, "chunk")
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    y_ref, h_ref = _run(x, "recurrent")
    assert_close(y, y_ref, 1e-4)
    assert_close(h, h_ref, 1e-4)


def _mamba2(G=2, seed=0):
    torch.manual_seed(seed)
    return Mamba2(32, d_state=8, head_dim=8, n_groups=G, chunk_size=8).double()


@pytest.mark.parametrize("G", [1, 2])
def test_mamba2_chunk_equals_recurrent_with_gradients(G):
    m = _mamba2(G)
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    outs = {}
    for mode in ("chunk", "recurrent"):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        y, st = m(xi, mode=mode)
        (y.square().sum() + st.ssm.square().sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        outs[mode] = (y.detach(), st.ssm.detach(), xi.grad, grads)
    (y, h, gx, gp), (y_r, h_r, gx_r, gp_r) = outs["chunk"], outs["recurrent"]
    assert_close(y, y_r, 1e-12, what="y")
    assert_close(h, h_r, 1e-12, what="state")
    assert_close(gx, gx_r, 1e-10, what="d/dx")
    for n in gp:
        assert_close(gp[n], gp_r[n], 1e-10, what=f"d/d{n}")


def test_mamba2_hooks_on_B_C_keep_their_meaning():
    """A read-only hook sees per-head ``B``/``C`` and changes nothing; a hook that replaces ``B`` is
    honoured (the call then runs gated linear attention on the replacement)."""
    m = _mamba2(G=2)
    x = torch.randn(1, 13, 32, dtype=torch.float64)
    y0, _ = m(x)
    seen = {}
    handle = m.hook_B.add(lambda v, name: seen.__setitem__("B", v))
    y1, _ = m(x)
    handle.remove()
    assert seen["B"].shape == (1, 13, m.n_heads, 8)
    assert_close(y1, y0, 0.0, what="read-only hook")
    outs = {}
    for mode in ("chunk", "recurrent"):
        handle = m.hook_B.add(lambda v, name: v * 0.5)
        outs[mode], _ = m(x, mode=mode)
        handle.remove()
    assert_close(outs["chunk"], outs["recurrent"], 1e-12, what="replaced B: chunk vs recurrent")
    assert (outs["chunk"] - y0).abs().max() > 1e-3
