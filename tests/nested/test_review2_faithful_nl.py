"""Review 2 of the Nested Learning memories against hand loops written here from the paper's
equations (Behrouz et al. 2025, arXiv 2512.24695): the CMS step of Eq. 71 (when each level steps,
what it sums, partial periods and streaming splits, every inner optimizer), the outer gradients of
a stream cut inside periods, self-modifying Titans' two forms from a carried state, the
self-modifying projections' rewrite, and M3 (Algorithm 1) step by step; plus the docstrings that
name where mnemo reads the paper's equations in its own way."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import mnemo.layers.cms as cms_module
import mnemo.layers.self_modifying_projections as smp_module
from mnemo.layers import SelfModifyingProjections
from mnemo.layers.cms import CMSLevel, ContinuumMemory, Level, LevelState
from mnemo.train.m3 import M3
from tests.helpers import assert_close
from tests.nested.test_self_modifying import _model

D = 4


def _x(T, B=2, d=D, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _perturbed(module, seed=1, scale=0.3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))
    return module


# ------------------------------------------------------------------------------------------------
# CMS: one level against a token loop of Eq. 71 (every optimizer, carry and flush, cut streams)
# ------------------------------------------------------------------------------------------------


def _eq71_loop(lv: CMSLevel, calls, partial: str):
    """Eq. 71 token by token: read ``gelu(x W_in) W_out`` with the weights of the period start, add
    ``η_t ∇ ½‖y_t − W_v x_t‖²`` (autograd at those weights) to the period's sum, and step with the
    level's optimizer after the period's ``C``-th token; ``"flush"`` steps a partial period at the end
    of a call and the next call starts a fresh period. Returns ``(reads, weights, steps, stepped_at)``
    (``stepped_at``: the 1-based stream index of the token after which each step was taken)."""
    B = calls[0].shape[0]
    C, opt, beta = lv.level.period, lv.level.optimizer, lv.level.beta
    W = [lv.W_in.detach().expand(B, -1, -1).clone(), lv.W_out.detach().expand(B, -1, -1).clone()]
    M = [torch.zeros_like(w) for w in W]
    G = [torch.zeros_like(w) for w in W]
    n, seen, reads, stepped_at = 0, 0, [], []

    def step():
        nonlocal W, M, G
        if opt == "gd":
            W = [w - g for w, g in zip(W, G)]
        else:
            base = M
            if opt == "delta_momentum":  # m ← β (m − ⟨m, ĝ⟩ ĝ) − g, ĝ the period's gradient normalised
                norm = torch.sqrt(sum((g * g).sum((1, 2)) for g in G))
                gh = [g / norm[:, None, None] for g in G]
                proj = sum((m * h).sum((1, 2)) for m, h in zip(M, gh))
                base = [m - proj[:, None, None] * h for m, h in zip(M, gh)]
            M = [beta * m - g for m, g in zip(base, G)]
            W = [w + m for w, m in zip(W, M)]
        G = [torch.zeros_like(w) for w in W]
        stepped_at.append(seen)

    for xc in calls:
        for t in range(xc.shape[1]):
            xt = xc[:, t : t + 1]
            Wr = [w.clone().requires_grad_() for w in W]
            with torch.enable_grad():
                y = F.gelu(xt @ Wr[0]) @ Wr[1]
                eta = lv.level.lr * torch.sigmoid(lv.rate(xt)) / xt.shape[-1]
                loss = (eta * 0.5 * (y - lv.value(xt)).square().sum(-1, keepdim=True)).sum()
                g = torch.autograd.grad(loss, Wr)
            reads.append(y.detach())
            G = [a + b for a, b in zip(G, g)]  # Eq. 71 sums the period's terms
            n, seen = n + 1, seen + 1
            if n % C == 0:
                step()
        if partial == "flush" and n % C:
            step()
            n = 0
    return torch.cat(reads, 1), W, stepped_at


@pytest.mark.parametrize("optimizer", ["gd", "momentum", "delta_momentum"])
@pytest.mark.parametrize("partial", ["carry", "flush"])
@pytest.mark.parametrize("period", [1, 3, 4])
def test_a_level_equals_a_token_loop_of_eq_71_in_any_split(optimizer, partial, period):
    """Reads, final weights and the number of steps equal the loop's for a stream of 11 tokens cut
    at 2 and 7 (both cuts inside periods of 3 and 4), float64. A carried level steps exactly after
    the tokens whose stream index is a multiple of ``C``; a flushed one also at each call's end."""
    torch.manual_seed(0)
    lv = _perturbed(
        CMSLevel(
            D, Level(period, expansion=1.5, lr=0.5, optimizer=optimizer, beta=0.7, partial=partial)
        ).double()
    )
    x = _x(11)
    calls = [x[:, :2], x[:, 2:7], x[:, 7:]]
    with torch.no_grad():
        ref, W, stepped_at = _eq71_loop(lv, calls, partial)
        st, ys = None, []
        for c in calls:
            y, st = lv(c, st)
            ys.append(y)
    assert_close(torch.cat(ys, 1), ref, 1e-12, what="reads")
    for a, b, name in zip(st.weights, W, ("W_in", "W_out")):
        assert_close(a, b, 1e-12, what=name)
    assert st.updates == len(stepped_at)
    if partial == "carry":
        assert stepped_at == [i for i in range(1, 12) if i % period == 0]
        assert st.position == 11


def test_flush_restarts_the_position_as_the_level_state_documents():
    """A flushed level's ``position`` is the tokens since the last flush, not the tokens read (the
    ``LevelState`` docstring says so, naming ``partial="flush"``)."""
    lv = CMSLevel(D, Level(4, partial="flush")).double()
    _, st = lv(_x(6))
    assert st.position == 0 and st.updates == 2  # a period at token 4, the flush of tokens 5-6
    _, st = lv(_x(4, seed=2), st)
    assert st.position == 4 and st.updates == 3  # 10 tokens read; one fresh period since the flush
    doc = LevelState.__doc__
    assert "flush" in doc[doc.index("position:") : doc.index("updates:")]


# ------------------------------------------------------------------------------------------------
# CMS: outer gradients of a stream cut inside periods equal one pass (the state carries the graph)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["gd", "momentum", "delta_momentum"])
@pytest.mark.parametrize(
    "transfer,meta", [("sequential", None), ("independent", None), ("nested", "none"), ("nested", "unrolled")]
)
def test_outer_gradients_through_a_carried_state_equal_one_pass(optimizer, transfer, meta):
    periods = (2, 4) if transfer == "nested" else (2, 3)
    torch.manual_seed(0)
    levels = [Level(p, expansion=1.5, optimizer=optimizer, beta=0.7) for p in periods]
    cms = _perturbed(ContinuumMemory(D, levels, transfer=transfer, meta=meta).double())
    x = _x(11).requires_grad_(True)
    params = [x, *cms.parameters()]
    w = torch.randn(2, 11, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y_one, _ = cms(x)
    g_one = torch.autograd.grad((y_one * w).sum(), params, allow_unused=True)
    st, ys = None, []
    for a, b in ((0, 5), (5, 7), (7, 11)):  # 5 and 7 cut periods of 2, 3 and 4
        y, st = cms(x[:, a:b], st)
        ys.append(y)
    y_cut = torch.cat(ys, 1)
    assert_close(y_cut, y_one, 1e-12, what="output")
    g_cut = torch.autograd.grad((y_cut * w).sum(), params, allow_unused=True)
    names = ["x"] + [n for n, _ in cms.named_parameters()]
    for n, a, b in zip(names, g_cut, g_one):
        assert (a is None) == (b is None), n
        if a is not None:
            assert_close(a, b, 1e-10, what=f"grad {n}")


def test_cms_docstring_names_the_reading_of_eq_71s_index_range():
    """Eq. 71 writes the period's sum as ``Σ_{t=i−C^(ℓ)}^{i}`` (``C + 1`` indices); mnemo sums the
    ``C`` tokens of the period (the test above checks the step count and timing). The reading must
    be named where the equation is transcribed, as M3's docstring names the same one."""
    doc = cms_module.__doc__
    assert "Σ_{t=i−C^(ℓ)}^{i}" in doc and "C + 1" in doc
    assert "t = i−C+1 … i" in doc


def test_nested_refusals_are_listed_in_the_docstring():
    for bad in (dict(objective="task"), dict(nlms=True)):
        with pytest.raises(ValueError, match="nested"):
            ContinuumMemory(D, [Level(2, **bad), Level(4)], transfer="nested")
    raises = ContinuumMemory.__doc__.split("Raises:")[1]
    assert 'objective="task"' in raises and "Level.nlms" in raises


# ------------------------------------------------------------------------------------------------
# self-modifying Titans: the chunk form equals the token loop from a carried state, gradients too
# ------------------------------------------------------------------------------------------------


def _smt(C, Cp, **kw):
    # gates and hidden layers large enough that every memory moves (W_a × 3: hidden inputs straddle 1)
    return _model(d=8, heads=2, C=C, Cp=Cp, wa_scale=3.0, **kw)


def _leaf_state(st):
    """``st`` with every tensor a fresh leaf that requires a gradient."""

    def leaf(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone().requires_grad_()
        if isinstance(v, tuple):
            return tuple(leaf(t) for t in v)
        return v

    return dataclasses.replace(st, **{f.name: leaf(getattr(st, f.name)) for f in dataclasses.fields(st)})


def _tensors(st):
    out = []
    for f in dataclasses.fields(st):
        v = getattr(st, f.name)
        out += [v] if isinstance(v, torch.Tensor) else [t for t in v] if isinstance(v, tuple) else []
    return out


@pytest.mark.parametrize("C,Cp", [(4, 3), (3, 5)])
@pytest.mark.parametrize(
    "opts", [{}, dict(momentum=0.6), dict(adaptive_q=True, momentum=0.3, hidden_step="plain")]
)
def test_self_modifying_forms_agree_from_a_carried_state_with_its_gradients(C, Cp, opts):
    """From the state after 5 tokens (mid-chunk for both chunk sizes), 4 more tokens: outputs, the
    final running weights and the gradients with respect to every tensor of the carried state
    (weights, chunk-start anchors, momentum, conv tail) and every parameter agree between
    ``mode="recurrent"`` (the token loop, autograd inner gradients) and ``mode="chunk"``."""
    m = _smt(C, Cp, **opts)
    x = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, s0 = m(x[:, :5])
    got = {}
    for mode in ("recurrent", "chunk"):
        s = _leaf_state(s0)
        y, s1 = m(x[:, 5:], s, mode=mode)
        g = torch.Generator().manual_seed(3)
        out = (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum()
        for t in (*s1.memory, *s1.proj):
            out = out + (t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
        leaves = _tensors(s)
        grads = torch.autograd.grad(out, leaves + list(m.parameters()), allow_unused=True)
        got[mode] = (y.detach(), [t.detach() for t in (*s1.memory, *s1.proj)], grads)
    (ya, wa, ga), (yb, wb, gb) = got["recurrent"], got["chunk"]
    assert_close(yb, ya, 1e-12, what="output")
    for a, b in zip(wb, wa):
        assert_close(a, b, 1e-12, what="weights")
    for a, b in zip(gb, ga):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close(a, b, 1e-11, what="gradient")


# ------------------------------------------------------------------------------------------------
# self-modifying projections: the chunk's rewrite, by hand
# ------------------------------------------------------------------------------------------------


def test_projection_rewrite_is_the_documented_left_multiplied_step():
    """After one full chunk from a fresh stream every projection memory ``M_□ [d, out]`` is
    ``α_□ M_□ − (η_□/C) X̂ᵀ(X̂ − O) M_□`` (``O`` the main memory's reads, ``x̂ = x/‖x‖``): the delta
    term multiplies ``M_□`` from the left, as the module docstring's formula now writes it (it
    wrote ``M_□ (α I − η X̂ᵀX̂/C)``, which does not even type-check for ``out = n_heads ≠ d``)."""
    torch.manual_seed(0)
    m = SelfModifyingProjections(8, n_heads=2, chunk_size=5).double()
    with torch.no_grad():
        m.self_eta.normal_(0, 1.0)
        m.self_alpha.normal_(2.0, 1.0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    seen = {}
    m.hook_o.add(lambda v, name: seen.__setitem__("o", v))
    _, st = m(x)
    O = seen["o"].reshape(2, 5, 8)
    xh = F.normalize(x, dim=-1)
    R = xh.transpose(1, 2) @ (xh - O)
    alpha, eta = torch.sigmoid(m.self_alpha), m.self_lr * torch.sigmoid(m.self_eta)
    for i, n in enumerate(("k", "v", "beta", "alpha")):
        M0 = m.init[n].detach()
        want = alpha[i] * M0 - (eta[i] / 5) * (R @ M0)
        assert_close(st.proj[n], want.detach(), 1e-12, what=n)
    assert "(α_□ I − η_□ X̂ᵀX̂ / C) M_□" in smp_module.__doc__


# ------------------------------------------------------------------------------------------------
# M3: Algorithm 1 transcribed as its double loop, against the optimizer step by step
# ------------------------------------------------------------------------------------------------


def _ns5(G, steps):
    """Muon's quintic Newton–Schulz on a matrix (written here: transpose tall matrices, normalise by
    the Frobenius norm, ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = G.shape[0] > G.shape[1]
    X = G.T if tall else G
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def _orth(M, steps):
    return M if M.ndim < 2 else _ns5(M.reshape(M.shape[0], -1), steps).reshape(M.shape)


def test_m3_is_algorithm_1s_double_loop_step_by_step():
    """Block ``k`` (``f`` steps) first adds ``β3`` times the previous block's gradient sum to ``M2``
    and orthogonalises it; each step of the block adds ``β1 g`` to ``M1`` and ``β2 g²`` to ``V`` and
    moves ``Θ`` by ``−η (NS(M1) + α NS(M2)) / (√V + ε)``; vectors are not orthogonalised. Gradients
    depend on ``Θ`` (a quadratic loss), so any mistiming shows in every later step. float64."""
    torch.manual_seed(0)
    shapes = [(3, 5), (4, 2, 3), (6,)]
    init = [torch.randn(s, dtype=torch.float64) for s in shapes]
    targets = [torch.randn(s, dtype=torch.float64) for s in shapes]
    scales = [torch.rand(s, dtype=torch.float64) + 0.5 for s in shapes]

    def grads(thetas):
        return [s * (t - y) for t, y, s in zip(thetas, targets, scales)]  # ∇ of ½ Σ s (Θ − y)²

    lr, (b1, b2, b3), alpha, eps, T, f, K = 0.05, (0.9, 0.99, 0.7), 0.4, 1e-3, 5, 3, 4
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = M3(params, lr=lr, betas=(b1, b2, b3), alpha=alpha, eps=eps, ns_steps=T, slow_every=f)
    theta = [t.clone() for t in init]
    M1 = [torch.zeros_like(t) for t in theta]
    M2 = [torch.zeros_like(t) for t in theta]
    V = [torch.zeros_like(t) for t in theta]
    prev_block = [torch.zeros_like(t) for t in theta]  # Σ of block k − 1's gradients (none for k = 0)
    for k in range(K):
        M2 = [m + b3 * s for m, s in zip(M2, prev_block)]
        O2 = [_orth(m, T) if k > 0 else torch.zeros_like(m) for m in M2]
        block = [torch.zeros_like(t) for t in theta]
        for _ in range(f):
            g = grads(theta)
            block = [s + gi for s, gi in zip(block, g)]
            M1 = [m + b1 * gi for m, gi in zip(M1, g)]
            V = [v + b2 * gi * gi for v, gi in zip(V, g)]
            O1 = [_orth(m, T) for m in M1]
            theta = [t - lr * (o1 + alpha * o2) / (v.sqrt() + eps) for t, o1, o2, v in zip(theta, O1, O2, V)]
            for p, gi in zip(params, grads([p.detach() for p in params])):
                p.grad = gi
            opt.step()
            for p, t in zip(params, theta):
                assert_close(p.detach(), t, 1e-12, what="theta")
        prev_block = block
    assert opt.state[params[0]]["step"] == K * f
