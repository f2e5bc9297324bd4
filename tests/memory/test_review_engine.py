"""Break-it review of the memory engine: an independent hand loop (autograd of the inner loss, one
token at a time) against both forms; the closed-form path's state; the ℓq map at zero; inputs that
were silently misread."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mnemo.memory import MemorySpec, init_state, neural_memory, preset
from tests.helpers import assert_close
from tests.memory.test_engine import _inputs as engine_inputs

B, T, H, K = 2, 7, 2, 3
TOL = 1e-10
F64 = torch.float64


def _inputs(spec: MemorySpec, T: int = T, seed: int = 0):
    """The engine tests' inputs (:func:`tests.memory.test_engine._inputs`) at this file's sizes."""
    return engine_inputs(spec, T, seed, B=B, K=K, V=K)


def _run(spec, x, state=None, **kw):
    extra = {n: x[n] for n in ("g", "eta", "delta") if n in x}
    return neural_memory(
        spec, x["q"], x["k"], x["v"], x["theta"], **extra, initial_state=state, output_final_state=True, **kw
    )


# ------------------------------------------------------------------------------------------------
# an independent hand loop: one (batch, head) and one token at a time, written from the equations
# ------------------------------------------------------------------------------------------------

_ACT = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}


def _mlp(spec, Ws, x):
    h = x
    for i, W in enumerate(Ws):
        h = h @ W
        if i < len(Ws) - 1:
            h = _ACT[spec.activation](h)
    if spec.norm:
        h = F.layer_norm(h, (h.shape[-1],), eps=1e-5)
    return x + h if spec.residual else h


def _loss(spec, y, v, d):
    e = y - v
    if spec.objective == "dot":
        return -(y * v).sum()
    if spec.objective == "l2":
        return 0.5 * (e * e).sum()
    if spec.objective == "lp":
        return ((e * e + spec.lp_eps**2) ** (spec.p / 2) / spec.p).sum()
    if spec.huber_mode == "token":  # Miras Eq. 16: the whole token switches on ‖e‖₂
        return 0.5 * (e * e).sum() if e.norm() <= d else d * e.abs().sum()
    return torch.where(e.abs() <= d, 0.5 * e * e, d * (e.abs() - 0.5 * d)).sum()


def _N(spec, A):
    if spec.retention == "lq":
        return A / (A.abs().pow(spec.q).sum() ** (1 / spec.q) + 1e-6) ** (spec.q - 2)
    if spec.retention == "kl":
        return spec.kl_scale * torch.softmax(A, 0)
    return A


def _hand(spec, x, W_init):
    """Titans / Miras written out: ``S_t = η_t S_{t−1} − θ_t ∇ℓ(W⁰; k_t, v_t)``,
    ``A_t = (1 − α_t) A_{t−1} + S_t`` (soft-thresholded for elastic net), ``o_t = M_{N(A_t)}(q_t)``,
    with ``W⁰`` the weights at the chunk start (decayed since then with ``decay_first``)."""
    out = torch.zeros_like(x["v"])
    for b, h in itertools.product(range(B), range(H)):
        A = [w[b, h].clone() for w in W_init]
        S = [torch.zeros_like(a) for a in A]
        anchor, acc = A, 0.0
        for t in range(x["q"].shape[1]):
            g = x["g"][b, t, h] if "g" in x else None
            if t % spec.chunk_size == 0:
                anchor, acc = A, 0.0
            W0 = [_N(spec, a) for a in anchor]
            if spec.decay_first:
                acc = acc + g
                W0 = [w * (acc.exp() if acc.ndim == 0 else acc.exp()[:, None]) for w in W0]
            W0 = [w.detach().requires_grad_() for w in W0]
            d = x["delta"][b, t, h] if "delta" in x else None
            G = torch.autograd.grad(_loss(spec, _mlp(spec, W0, x["k"][b, t, h]), x["v"][b, t, h], d), W0)
            th = x["theta"][b, t, h]
            th = th if spec.max_lr is None else th.clamp(max=spec.max_lr)
            gamma = spec.l1 * th
            if spec.grad_clip is not None:
                th = th * min(1.0, spec.grad_clip / torch.sqrt(sum((gi**2).sum() for gi in G)))
            step = [-th * gi for gi in G]
            if spec.optimizer == "momentum":
                S = [x["eta"][b, t, h] * s + st for s, st in zip(S, step)]
                step = S
            if g is not None:
                a = g.exp() if g.ndim == 0 else g.exp()[:, None]
                A = [a * ai + st for ai, st in zip(A, step)]
            else:
                A = [ai + st for ai, st in zip(A, step)]
            if spec.retention == "elastic_net":
                A = [torch.sign(ai) * torch.relu(ai.abs() - gamma) for ai in A]
            out[b, t, h] = _mlp(spec, [_N(spec, a) for a in A], x["q"][b, t, h]).detach()
    return out


def _hand_cases():
    out = []
    for arch, obj, ret, opt in itertools.product(
        ("matrix", "mlp"),
        ("dot", "l2", "lp", "huber"),
        ("none", "decay", "lq", "kl", "elastic_net"),
        ("gd", "momentum"),
    ):
        kw = dict(architecture=arch, objective=obj, retention=ret, optimizer=opt, l1=0.3, max_lr=0.5)
        if arch == "mlp":
            kw.update(depth=2, expansion=1.5, residual=True, norm=True)
        variants = [kw, dict(kw, grad_clip=0.3)]
        if obj == "huber":
            variants.append(dict(kw, huber_mode="coordinate"))
        if ret == "decay":
            variants.append(dict(kw, decay_first=True))
        if ret in ("decay", "elastic_net") and arch == "matrix":
            variants.append(dict(kw, decay_per_channel=True))
        for v in variants:
            flags = [f for f in ("grad_clip", "decay_first", "decay_per_channel") if v.get(f)]
            flags += ["coordinate"] if v.get("huber_mode") == "coordinate" else []
            out.append(pytest.param(v, id="-".join([arch, obj, ret, opt, *flags])))
    return out


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("kw", _hand_cases())
def test_both_forms_match_an_independent_hand_loop(kw, chunk):
    spec = MemorySpec(chunk_size=chunk, **kw).validate()
    x = _inputs(spec)
    g_ = torch.Generator().manual_seed(3)
    W = [0.3 * torch.randn(B, H, i, o, generator=g_, dtype=F64) for i, o in spec.layer_dims(K, K)]
    ref = _hand(spec, x, W)
    for mode in ("recurrent", "chunk"):
        o, _ = _run(spec, x, init_state(spec, W), mode=mode)
        assert_close(o, ref, TOL, what=f"{mode} vs hand loop")


def test_matrix_l2_one_step_is_the_delta_rule_closed_form():
    """One token on a matrix memory with ℓ2: ``W₁ = W₀ − θ k (W₀ᵀk − v)ᵀ``, read ``W₁ᵀ q``."""
    spec = MemorySpec(chunk_size=4)
    x = _inputs(spec, T=1)
    W0 = 0.3 * torch.randn(B, H, K, K, dtype=F64)
    k, v, q, th = x["k"][:, 0], x["v"][:, 0], x["q"][:, 0], x["theta"][:, 0]
    err = torch.einsum("bhk,bhkv->bhv", k, W0) - v
    W1 = W0 - th[..., None, None] * k[..., :, None] * err[..., None, :]
    for mode in ("recurrent", "chunk"):
        o, st = _run(spec, x, init_state(spec, [W0]), mode=mode, use_closed_form=False)
        assert_close(st.weights[0], W1, TOL, what=mode)
        assert_close(o[:, 0], torch.einsum("bhk,bhkv->bhv", q, W1), TOL, what=mode)


# ------------------------------------------------------------------------------------------------
# defects found by the review
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["linear_attention", "retnet"])
@pytest.mark.parametrize("T_, position", [(5, 0), (3, 1), (2, 1), (9, 2), (4, 0)])
def test_closed_form_state_keeps_the_chunk_anchor(name, T_, position):
    """The dedicated op (dot objective, any chunk size) must leave the anchor at the last chunk
    boundary, as the token loop does (it returned the end state as the anchor: MAC reads it)."""
    spec = preset(name, chunk_size=4)
    x = _inputs(spec, T=T_)
    st = init_state(spec, [0.3 * torch.randn(B, H, K, K, dtype=F64)])
    if position:  # a stream already inside a chunk: its anchor is not its weights
        st = st._replace(weights=(st.weights[0] + 0.1,), position=position)
    outs = {}
    for mode, closed in (("recurrent", False), ("chunk", True), ("chunk", False)):
        outs[mode, closed] = _run(spec, x, st, mode=mode, use_closed_form=closed)
    o_ref, s_ref = outs["recurrent", False]
    for key, (o, s) in outs.items():
        assert_close(o, o_ref, TOL, what=f"{key} output")
        assert_close(s.weights[0], s_ref.weights[0], TOL, what=f"{key} weights")
        assert_close(s.anchor[0], s_ref.anchor[0], TOL, what=f"{key} anchor")
        assert s.position == s_ref.position


def test_lq_retention_has_finite_gradients_at_zero_weights():
    """A matrix ℓq (Moneta) memory starts at zero (the layer's init): ``‖A‖_q`` summed as
    ``(Σ|A|^q)^{1/q}`` had a ``0 · ∞ = NaN`` backward there."""
    spec = MemorySpec(objective="lp", retention="lq", chunk_size=2)
    x = _inputs(spec, T=5)
    for mode in ("recurrent", "chunk"):
        W = torch.zeros(B, H, K, K, dtype=F64, requires_grad=True)
        o, _ = _run(spec, x, init_state(spec, [W]), mode=mode)
        (grad,) = torch.autograd.grad(o.sum(), W)
        assert torch.isfinite(grad).all(), mode


def test_bad_states_and_stray_inputs_name_the_argument():
    mom, gd = MemorySpec(optimizer="momentum"), MemorySpec()
    x = _inputs(mom, T=3)
    W = [torch.zeros(B, H, K, K, dtype=F64)]
    args = (x["q"], x["k"], x["v"], x["theta"])
    for mode in ("chunk", "recurrent"):  # momentum dropped silently without buffers
        with pytest.raises(ValueError, match=r"initial_state.momentum must be buffers"):
            neural_memory(mom, *args, eta=x["eta"], initial_state=init_state(gd, W), mode=mode)
    with pytest.raises(ValueError, match=r"initial_state.momentum must be None"):
        neural_memory(gd, *args, initial_state=init_state(mom, W))
    with pytest.raises(ValueError, match="eta was given but the optimizer is 'gd'"):
        neural_memory(gd, *args, eta=x["eta"])
    with pytest.raises(ValueError, match="delta was given but the objective is 'l2'"):
        neural_memory(gd, *args, delta=x["theta"])
    st = init_state(gd, W)
    with pytest.raises(ValueError, match=r"initial_state.anchor\[0\] must have shape"):
        neural_memory(gd, *args, initial_state=st._replace(anchor=(torch.zeros(B, H, K, 2, dtype=F64),)))
    with pytest.raises(ValueError, match=r"initial_state.position must be >= 0"):
        neural_memory(gd, *args, initial_state=st._replace(position=-1))
    first = MemorySpec(retention="decay", decay_first=True, chunk_size=4)
    with pytest.raises(ValueError, match=r"initial_state.anchor_decay must be shape \[2, 2\]"):
        bad = st._replace(position=1, anchor_decay=torch.zeros(3, dtype=F64))
        neural_memory(first, *args, g=-x["theta"], initial_state=bad)
    for field, value in (("max_lr", float("nan")), ("p", float("inf")), ("expansion", "2")):
        with pytest.raises(ValueError, match=f"MemorySpec.{field}: expected"):
            MemorySpec(**{field: value}).validate()
    with pytest.raises(ValueError, match="MemorySpec.kl_scale: expected a positive number"):
        MemorySpec(retention="kl", kl_scale=-1.0).validate()


def test_a_state_at_a_chunk_start_is_its_own_anchor_in_every_form():
    """At a chunk boundary the token loop takes ``anchor ← A`` (and drops ``anchor_decay``); the
    chunk form used the state's stale anchor when one was handed in."""
    spec = MemorySpec(retention="decay", decay_first=True, chunk_size=3)
    x = _inputs(spec, T=5)
    W = 0.3 * torch.randn(B, H, K, K, dtype=F64)
    st = init_state(spec, [W])._replace(
        anchor=(0.5 * W,), anchor_decay=torch.full((B, H), -0.3, dtype=F64), position=3
    )
    o_ref, s_ref = _run(spec, x, st, mode="recurrent")
    o, s = _run(spec, x, st, mode="chunk")
    assert_close(o, o_ref, TOL, what="output")
    assert_close(s.anchor[0], s_ref.anchor[0], TOL, what="anchor")
