"""Seventh review pass of the recurrences' kernels (break-it): every public recurrence against a
hand loop written from its paper's equation (not from mnemo's code) at the chunk boundaries, with an
initial state, in both chunk paths (factorised and the strong-gate fallback); gradchecks of the chunk
forms w.r.t. every input; ring attention and ``small_mm`` under torch.func transforms; and more."""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import mnemo.ops as M
from mnemo.ops.ring_attention import ThreadRing, blockwise_attention, ring_attention
from mnemo.ops.small_mm import small_mm

F64 = torch.float64
CS = 4  # chunk size of the fuzz
LENGTHS = [1, CS - 1, CS, CS + 1, 2 * CS + 1]
TOL = dict(rtol=1e-10, atol=1e-10)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _r(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def _u(gen, *shape):
    return torch.rand(*shape, generator=gen, dtype=F64)


# ------------------------------------------------------------------------------------------------
# hand loops, from the papers' equations, one token, one batch row and one head at a time
# ------------------------------------------------------------------------------------------------


def hand_gla(q, k, v, g, S0, scale):
    """S_t = diag(exp g_t) S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ (scale q_t) (g None: no decay)."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    S_out = torch.zeros_like(S0)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone()
            for t in range(T):
                if g is not None:
                    a = torch.exp(g[b, t, h])
                    S = (a[:, None] if a.ndim == 1 else a) * S
                S = S + torch.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_out[b, h] = S
    return o, S_out


def hand_delta(q, k, v, beta, g, S0, scale):
    """S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ (scale q_t)."""
    B, T, H, K = q.shape
    eye = torch.eye(K, dtype=F64)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    S_out = torch.zeros_like(S0)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone()
            for t in range(T):
                kt, bt = k[b, t, h], beta[b, t, h]
                a = 1.0 if g is None else math.exp(float(g[b, t, h]))
                S = a * (eye - bt * torch.outer(kt, kt)) @ S + bt * torch.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_out[b, h] = S
    return o, S_out


def hand_selective_scan(u, delta, A, Bm, Cm, D, z, delta_bias, softplus, h0):
    """Mamba S6 (Gu & Dao 2023, Alg. 2): Δ = softplus(δ + bias); h = exp(ΔA) h + Δ B u; y = C h + D u;
    y · silu(z). B, C: [B, T, N] (one group)."""
    Bsz, T, Dm = u.shape
    y = torch.zeros(Bsz, T, Dm, dtype=F64)
    h_out = torch.zeros_like(h0)
    for b in range(Bsz):
        for d in range(Dm):
            h = h0[b, d].clone()
            for t in range(T):
                dl = delta[b, t, d] + (0.0 if delta_bias is None else delta_bias[d])
                if softplus:
                    dl = math.log1p(math.exp(float(dl)))
                h = torch.exp(dl * A[d]) * h + dl * Bm[b, t] * u[b, t, d]
                yt = (Cm[b, t] * h).sum() + (0.0 if D is None else D[d] * u[b, t, d])
                if z is not None:
                    zt = float(z[b, t, d])
                    yt = yt * zt / (1.0 + math.exp(-zt))
                y[b, t, d] = yt
            h_out[b, d] = h
    return y, h_out


def hand_ssd(x, dt, A, Bm, Cm, D, dt_bias, softplus, h0):
    """Mamba-2 SSD (Dao & Gu 2024): h_t = exp(dt A) h + B_t (dt x_t)ᵀ; y_t = h_tᵀ C_t + D x_t.
    B, C: [B, T, N] (one group)."""
    Bsz, T, H, P = x.shape
    y = torch.zeros_like(x)
    h_out = torch.zeros_like(h0)
    for b in range(Bsz):
        for hd in range(H):
            h = h0[b, hd].clone()  # [N, P]
            for t in range(T):
                d = float(dt[b, t, hd]) + (0.0 if dt_bias is None else float(dt_bias[hd]))
                if softplus:
                    d = math.log1p(math.exp(d))
                h = math.exp(d * float(A[hd])) * h + torch.outer(Bm[b, t], d * x[b, t, hd])
                y[b, t, hd] = h.T @ Cm[b, t] + (0.0 if D is None else D[hd] * x[b, t, hd])
            h_out[b, hd] = h
    return y, h_out


# ------------------------------------------------------------------------------------------------
# the ops, each as f(mode, *inputs) -> (o, S), with the inputs and the hand loop's result
# ------------------------------------------------------------------------------------------------

GATES = {"mild": 0.5, "strong": 25.0}  # strong: a chunk of 4 decays past 30 nats (fallback path)


def _matrix(T, seed, gate, B=2, K=3, V=2, H=2):
    gen = _gen(seed)
    q, k, v = _r(gen, B, T, H, K), _r(gen, B, T, H, K), _r(gen, B, T, H, V)
    k = torch.nn.functional.normalize(k, dim=-1)
    g = -_u(gen, B, T, H) * GATES[gate]
    gc = -_u(gen, B, T, H, K) * GATES[gate]
    beta = 0.05 + 0.95 * _u(gen, B, T, H)
    S0 = _r(gen, B, H, K, V)
    return q, k, v, g, gc, beta, S0


def _cases(T, seed, gate, B=2):
    q, k, v, g, gc, beta, S0 = _matrix(T, seed, gate, B)
    sc = 0.7
    kw = dict(scale=sc, output_final_state=True, chunk_size=CS)
    cases = {
        "linear_attention": (
            lambda m, q, k, v, S0: M.linear_attention(q, k, v, initial_state=S0, mode=m, **kw),
            (q, k, v, S0),
            hand_gla(q, k, v, None, S0, sc),
        ),
        "gla_scalar": (
            lambda m, q, k, v, g, S0: M.gated_linear_attention(q, k, v, g, initial_state=S0, mode=m, **kw),
            (q, k, v, g, S0),
            hand_gla(q, k, v, g, S0, sc),
        ),
        "gla_channel": (
            lambda m, q, k, v, g, S0: M.gated_linear_attention(q, k, v, g, initial_state=S0, mode=m, **kw),
            (q, k, v, gc, S0),
            hand_gla(q, k, v, gc, S0, sc),
        ),
        "delta_rule": (
            lambda m, q, k, v, b, S0: M.delta_rule(q, k, v, b, initial_state=S0, mode=m, **kw),
            (q, k, v, beta, S0),
            hand_delta(q, k, v, beta, None, S0, sc),
        ),
        "gated_delta_rule": (
            lambda m, q, k, v, g, b, S0: M.gated_delta_rule(q, k, v, g, b, initial_state=S0, mode=m, **kw),
            (q, k, v, g, beta, S0),
            hand_delta(q, k, v, beta, g, S0, sc),
        ),
    }
    # normalised linear attention with the elu+1 map: the normaliser z is the state's last column
    phi = lambda x: torch.nn.functional.elu(x) + 1.0  # noqa: E731
    Sn = torch.cat([S0.abs(), _u(_gen(seed + 1), *S0.shape[:-1], 1) + 0.5], -1)
    vn = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    on, Snf = hand_gla(phi(sc * q) / sc, phi(k), vn, None, Sn, sc)
    on = on[..., :-1] / (on[..., -1:] + 1e-6)
    cases["linear_attention_normalised"] = (
        lambda m, q, k, v, S0: M.linear_attention(
            q, k, v, feature_map="elu", normalize=True, initial_state=S0, mode=m, **kw
        ),
        (q, k, v, Sn),
        (on, Snf),
    )
    return cases


def _ss_case(T, seed, gate, softplus=True, Bsz=2):
    gen = _gen(seed)
    Dm, N = 3, 2
    u, delta, z = _r(gen, Bsz, T, Dm), _u(gen, Bsz, T, Dm) * (GATES[gate] / 5), _r(gen, Bsz, T, Dm)
    A = -(_u(gen, Dm, N) + 0.5)
    Bm, Cm = _r(gen, Bsz, T, N), _r(gen, Bsz, T, N)
    D, bias, h0 = _r(gen, Dm), 0.1 * _r(gen, Dm), _r(gen, Bsz, Dm, N)
    if not softplus:
        bias = bias.abs()

    def f(m, u, delta, A, Bm, Cm, D, z, bias, h0):
        return M.selective_scan(
            u, delta, A, Bm, Cm, D, z, bias, softplus, initial_state=h0, output_final_state=True,
            mode=m, chunk_size=CS,
        )  # fmt: skip

    args = (u, delta, A, Bm, Cm, D, z, bias, h0)
    return f, args, hand_selective_scan(u, delta, A, Bm, Cm, D, z, bias, softplus, h0)


def _ssd_case(T, seed, gate, softplus=True, Bsz=2):
    gen = _gen(seed)
    H, P, N = 2, 3, 2
    x, dt = _r(gen, Bsz, T, H, P), _u(gen, Bsz, T, H) * (GATES[gate] / 5)
    A = -(_u(gen, H) + 0.5)
    Bm, Cm = _r(gen, Bsz, T, N), _r(gen, Bsz, T, N)
    D, bias, h0 = _r(gen, H), 0.1 * _r(gen, H), _r(gen, Bsz, H, N, P)
    if not softplus:
        bias = bias.abs()

    def f(m, x, dt, A, Bm, Cm, D, bias, h0):
        return M.ssd(
            x, dt, A, Bm, Cm, D, dt_bias=bias, dt_softplus=softplus, initial_state=h0,
            output_final_state=True, mode=m, chunk_size=CS,
        )  # fmt: skip

    args = (x, dt, A, Bm, Cm, D, bias, h0)
    return f, args, hand_ssd(x, dt, A, Bm, Cm, D, bias, softplus, h0)


def _all_cases(T, seed, gate, B=2):
    cases = _cases(T, seed, gate, B)
    cases["selective_scan"] = _ss_case(T, seed, gate, Bsz=B)
    cases["selective_scan_no_softplus"] = _ss_case(T, seed, gate, softplus=False, Bsz=B)
    cases["ssd"] = _ssd_case(T, seed, gate, Bsz=B)
    cases["ssd_no_softplus"] = _ssd_case(T, seed, gate, softplus=False, Bsz=B)
    return cases


NAMES = list(_all_cases(1, 0, "mild"))


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("name", NAMES)
def test_every_form_equals_a_hand_loop_from_the_papers_equation_at_the_chunk_boundaries(name, gate):
    for T in LENGTHS:
        f, args, (o_ref, S_ref) = _all_cases(T, 100 + T, gate)[name]
        for mode in ("recurrent", "chunk", "parallel"):
            o, S = f(mode, *args)
            assert o.dtype == F64 and S.dtype == F64
            tag = f"{name} {mode} T={T}"
            torch.testing.assert_close(o, o_ref, **TOL, msg=lambda m, tag=tag: f"{tag} o: {m}")
            torch.testing.assert_close(S, S_ref, **TOL, msg=lambda m, tag=tag: f"{tag} S: {m}")


GRAD_NAMES = [
    "linear_attention",
    "linear_attention_normalised",
    "gla_scalar",
    "gla_channel",
    "delta_rule",
    "gated_delta_rule",
    "selective_scan",
    "ssd",
]


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("name", GRAD_NAMES)
def test_gradcheck_of_the_chunk_form_wrt_every_input_and_the_initial_state(name, gate):
    # T = CS + 1: two chunks, the second one partial; o and the final state both carry the gradient
    f, args, _ = _all_cases(CS + 1, 7, gate, B=1)[name]
    args = tuple(a.detach().clone().requires_grad_(True) for a in args)

    def fn(*a):
        o, S = f("chunk", *a)
        return o, S

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# softmax attention, ring attention and small_mm under torch.func transforms
# ------------------------------------------------------------------------------------------------

SOFTMAX_CASES = {
    "causal": dict(),
    "not_causal": dict(causal=False),
    "window": dict(window=2),
    "sinks": dict(window=2, n_sink=1),
    "packed": dict(cu_seqlens=torch.tensor([0, 2, 5])),
    "negative_scale": dict(scale=-0.5),
}


@pytest.mark.filterwarnings("ignore::mnemo.ops.RangeWarning")
@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_forward_mode_ad_through_softmax_attention_equals_the_token_loops(case):
    # the parallel form's CPU SDPA kernel has no forward-mode derivative: NotImplementedError

    gen = _gen(3)
    # (V = K: SDPA's CPU flash kernel serves only equal head dims, the others take its math kernel)
    q, k, v = _r(gen, 1, 5, 2, 3), _r(gen, 1, 5, 2, 3), _r(gen, 1, 5, 2, 3)
    tq, tk, tv = _r(gen, 1, 5, 2, 3), _r(gen, 1, 5, 2, 3), _r(gen, 1, 5, 2, 3)
    kw = SOFTMAX_CASES[case]

    def f(mode):
        return lambda q, k, v: M.softmax_attention(q, k, v, mode=mode, **kw)[0]

    o_ref, t_ref = torch.func.jvp(f("recurrent"), (q, k, v), (tq, tk, tv))
    o, t = torch.func.jvp(f("parallel"), (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(t, t_ref, **TOL)
    with fwAD.dual_level():
        out = f("parallel")(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), fwAD.make_dual(v, tv))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, t_ref, **TOL)


def _ring_inputs():
    gen = _gen(5)
    return _r(gen, 1, 4, 2, 3), _r(gen, 1, 4, 1, 3), _r(gen, 1, 4, 1, 2)


@pytest.mark.parametrize("how", ["vmap", "grad", "jvp", "jacrev", "forward_ad"])
def test_ring_attention_under_a_transform_is_refused_naming_the_op_and_the_alternative(how):
    # was PyTorch's "autograd.Function ... must override the setup_context staticmethod" (or "You must
    # implement the jvp function"), which names neither ring_attention nor what to use instead

    q, k, v = _ring_inputs()
    ring = ThreadRing.make(1)[0]

    def f(q):
        return ring_attention(q, k, v, ring=ring)

    calls = {
        "vmap": lambda: torch.func.vmap(f)(q[None]),
        "grad": lambda: torch.func.grad(lambda q: f(q).sum())(q),
        "jvp": lambda: torch.func.jvp(f, (q,), (q,)),
        "jacrev": lambda: torch.func.jacrev(f)(q),
    }
    with pytest.raises(RuntimeError, match=r"ring_attention.*blockwise_attention"):
        if how == "forward_ad":
            with fwAD.dual_level():
                f(fwAD.make_dual(q, q))
        else:
            calls[how]()


def test_ring_attention_without_a_transform_still_equals_softmax_attention():

    q, k, v = (a.requires_grad_(True) for a in _ring_inputs())
    o = ring_attention(q, k, v, ring=ThreadRing.make(1)[0])
    ref = M.softmax_attention(q, k, v, mode="recurrent")[0]
    torch.testing.assert_close(o, ref, **TOL)
    g = torch.autograd.grad(o.pow(2).sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("how", ["vmap", "grad", "jvp", "jacrev"])
def test_blockwise_attention_under_a_transform_equals_the_token_loop(how):

    q, k, v = _ring_inputs()

    def bw(q):
        return blockwise_attention(q, k, v, 2)

    def ref(q):
        return M.softmax_attention(q, k, v, mode="recurrent")[0]

    t = q.flip(1)
    run = {
        "vmap": lambda f: torch.func.vmap(f)(torch.stack([q, t])),
        "grad": lambda f: torch.func.grad(lambda q: f(q).pow(2).sum())(q),
        "jvp": lambda f: torch.func.jvp(f, (q,), (t,))[1],
        "jacrev": lambda f: torch.func.jacrev(f)(q),
    }[how]
    torch.testing.assert_close(run(bw), run(ref), **TOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("how", ["vmap_x", "vmap_weight", "grad", "jvp", "jacrev", "forward_ad"])
def test_small_mm_under_a_transform_equals_f_linear(how, bias):

    gen = _gen(11)
    x, w = _r(gen, 3, 5), _r(gen, 4, 5)
    b = _r(gen, 4) if bias else None
    xs, ws, tx = _r(gen, 2, 3, 5), _r(gen, 2, 4, 5), _r(gen, 3, 5)
    lin = torch.nn.functional.linear

    def run(f):
        if how == "vmap_x":
            return torch.func.vmap(lambda x: f(x, w, b))(xs)
        if how == "vmap_weight":
            return torch.func.vmap(lambda w: f(x, w, b))(ws)
        if how == "grad":
            return torch.func.grad(lambda w: f(x, w, b).pow(2).sum())(w)
        if how == "jvp":
            return torch.func.jvp(lambda x: f(x, w, b), (x,), (tx,))[1]
        if how == "jacrev":
            return torch.func.jacrev(lambda x, w: f(x, w, b), argnums=(0, 1))(x, w)
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(fwAD.make_dual(x, tx), w, b)).tangent

    got, ref = run(small_mm), run(lin)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# linear attention: a feature map that returns the wrong rank or no tensor is named
# ------------------------------------------------------------------------------------------------

BAD_FEATURE_MAPS = {
    "drops_the_channel_dim": (lambda x: x[..., 0], ValueError),  # [B, T, H]: was read as F = H
    "adds_a_dim": (lambda x: x[..., None], ValueError),
    "changes_T": (lambda x: x[:, :-1], ValueError),
    "not_a_tensor": (lambda x: x.tolist(), TypeError),
}


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("mode", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("bad", list(BAD_FEATURE_MAPS))
def test_a_feature_map_of_the_wrong_rank_is_named(bad, mode, normalize):
    # [B, T, H] passed the check (its first three sizes are B, T, H) and failed deep inside
    # ("native kernel scan_dec_fwd: S0 must have ..." / IndexError); a list: AttributeError
    fm, err = BAD_FEATURE_MAPS[bad]
    gen = _gen(2)
    q, v = _r(gen, 1, 6, 2, 3), _r(gen, 1, 6, 2, 4)
    with pytest.raises(err, match=r"feature_map must (map|return)"):
        M.linear_attention(q, q, v, feature_map=fm, normalize=normalize, mode=mode, chunk_size=4)


@pytest.mark.parametrize("bad", list(BAD_FEATURE_MAPS))
def test_linear_attention_map_names_a_bad_feature_map_too(bad):
    # a map that shortened T was accepted and gave a [B, H, T-1, T-1] matrix; the others: EinopsError
    fm, err = BAD_FEATURE_MAPS[bad]
    q = _r(_gen(2), 1, 6, 2, 3)
    with pytest.raises(err, match=r"feature_map must (map|return)"):
        M.linear_attention_map(q, q, feature_map=fm)
