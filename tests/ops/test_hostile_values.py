"""Bad values given to the ops are named (the seventh hostile list of issue 35): non-finite
``scale``/``eps``, malformed masks and caches and a switch that is not a bool raise; values outside
the range a model produces (positive log-gates, a positive SSM ``A``, a negative step) are computed
as given — a patching or steering hook may mean them — and said with a ``RangeWarning``."""

import math
import warnings

import pytest
import torch

from mnemo.ops import (
    KVCache,
    RangeWarning,
    attention_mask,
    decay_matrix,
    finite_checks,
    gated_delta_rule,
    gated_linear_attention,
    linear_attention,
    selective_scan,
    set_finite_checks,
    softmax_attention,
    ssd,
)


def _qkv(B=1, T=5, H=2, K=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, H, K, generator=g) for _ in range(3)]


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_non_finite_scale_is_refused(scale):
    q, k, v = _qkv()
    g = -torch.rand(1, 5, 2)
    for call in (
        lambda: linear_attention(q, k, v, scale=scale),
        lambda: softmax_attention(q, k, v, scale=scale),
        lambda: gated_linear_attention(q, k, v, g, scale=scale),
    ):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            call()


def test_scale_of_the_wrong_type_is_refused():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="scale must be a real number"):
        linear_attention(q, k, v, scale="0.5")


@pytest.mark.parametrize("eps", [math.nan, -1.0, math.inf])
def test_bad_eps_is_refused(eps):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        linear_attention(q, k, v, normalize=True, eps=eps)


def test_a_given_scale_is_used_as_given():
    """A valid scale still means what it says: scaling q by 2 equals scale = 2 * K ** -0.5."""
    q, k, v = _qkv()
    a, _ = linear_attention(q * 2, k, v)
    b, _ = linear_attention(q, k, v, scale=2 * 4**-0.5)
    torch.testing.assert_close(a, b)


def test_positive_log_gates_are_said_and_computed_as_given():
    q, k, v = _qkv()
    g = -torch.rand(1, 5, 2)
    g[0, 3, 1] = 0.25  # one decay above 1
    with pytest.warns(RangeWarning, match=r"g \(a log-gate\) has 1 of 10 values > 0 \(largest 0.25\)"):
        o, _ = gated_linear_attention(q, k, v, g=g)
    ref, _ = gated_linear_attention(q, k, v, g=g, mode="recurrent")
    torch.testing.assert_close(o, ref)  # computed as given (e.g. a steering hook)
    beta = torch.rand(1, 5, 2)
    with pytest.warns(RangeWarning, match=r"g \(a log-gate\) has 1 of 10 values > 0"):
        gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, g=g, beta=beta)
    with pytest.warns(RangeWarning, match="g should be <= 0: 1 of 10 values are not"):
        decay_matrix(g)
    # zero and -inf (a hard reset) stay quiet
    g[0, 3, 1] = 0.0
    g[0, 2, 0] = -math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gated_linear_attention(q, k, v, g=g)
        assert torch.equal(decay_matrix(g)[0, 0].diagonal(), torch.ones(5))


@pytest.mark.parametrize("gated", [False, True])
def test_a_delta_rule_beta_outside_0_2_is_said_and_computed_as_given(gated):
    """(left by the seventh trial) beta > 2 (or < 0): with unit-norm keys I − beta k kᵀ has the
    eigenvalue 1 − beta along k, of modulus above 1, so the state grows without bound: said with
    a RangeWarning (an intervention may set it) and computed as given; beta in [0, 2] is quiet."""
    from mnemo.ops import delta_rule

    q, k, v = _qkv(T=40)
    k = torch.nn.functional.normalize(k, dim=-1)
    g = torch.zeros(1, 40, 2)

    def op(beta, mode="chunk"):
        if gated:
            return gated_delta_rule(q, k, v, g, beta, mode=mode, output_final_state=True)
        return delta_rule(q, k, v, beta, mode=mode, output_final_state=True)

    beta = torch.full((1, 40, 2), 5.0)
    said = r"beta should be in \[0, 2\]: 80 of 80 values are not \(the most extreme is 5\)"
    with pytest.warns(RangeWarning, match=said):
        o, S = op(beta)
    with pytest.warns(RangeWarning, match="contraction only for beta in"):
        ref, S_ref = op(beta, "recurrent")
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-3)  # as given: and it grows
    assert S.abs().max() > 1e6
    with pytest.warns(RangeWarning, match="the most extreme is -0.5"):
        op(torch.full((1, 40, 2), -0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(torch.full((1, 40, 2), 2.0))  # the edge (allow_neg_eigval's range is (0, 2))
        op(torch.zeros(1, 40, 2))
        with finite_checks(False):
            op(beta)


def test_a_negative_scale_is_said_and_computed_as_given():
    """(left by the seventh trial) a negative scale turns softmax attention to the least similar
    keys and flips a linear memory's read: said with a RangeWarning for every op that takes a
    scale, computed as given (softmax with -s equals softmax of the negated queries). Found on the
    way: causal softmax attention gave NaN rows for any scale <= 0 (torch's CPU kernel)."""
    q, k, v = _qkv()
    g = -torch.rand(1, 5, 2)
    beta = torch.rand(1, 5, 2)
    kn = torch.nn.functional.normalize(k, dim=-1)
    for call in (
        lambda s: linear_attention(q, k, v, scale=s),
        lambda s: softmax_attention(q, k, v, scale=s),
        lambda s: gated_linear_attention(q, k, v, g, scale=s),
        lambda s: gated_delta_rule(q, kn, v, g, beta, scale=s),
    ):
        said = r"scale should be >= 0 \(None for K \*\* -0.5 = 0.5\), got -0.5"
        with pytest.warns(RangeWarning, match=said):
            call(-0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            call(0.0)  # zero is legal (uniform attention, an empty read)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref, _ = softmax_attention(-q, k, v, scale=0.5)
    with pytest.warns(RangeWarning):
        o, _ = softmax_attention(q, k, v, scale=-0.5)
    torch.testing.assert_close(o, ref)  # (the CPU kernel's causal path gave NaN for scale <= 0)
    o, _ = softmax_attention(q, k, v, scale=0.0)  # uniform over the keys so far: a known answer
    mean = v.cumsum(1) / torch.arange(1, 6).view(1, 5, 1, 1)
    torch.testing.assert_close(o, mean)
    with pytest.warns(RangeWarning, match="scale should be >= 0"):
        linear_attention(q, k, v, scale=torch.tensor(-0.5))


def test_the_sign_checks_follow_the_finite_switch():
    """MNEMO_CHECK_FINITE=0 / finite_checks(False) turns the range reads off with the NaN reads."""
    q, k, v = _qkv()
    g = torch.full((1, 5, 2), 0.1)
    with finite_checks(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = gated_linear_attention(q, k, v, g=g)
    assert torch.isfinite(o).all()


def test_decay_matrix_shape_is_checked():
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\] or \[B, T, H, K\], got \[5\]"):
        decay_matrix(-torch.rand(5))


def _ssd_inputs(T=6, H=2, P=3, N=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, H, P, generator=g)
    dt = torch.rand(1, T, H, generator=g)
    A = -torch.rand(H, generator=g)
    B = torch.randn(1, T, N, generator=g)
    C = torch.randn(1, T, N, generator=g)
    return x, dt, A, B, C


def test_ssd_says_a_positive_A_and_a_negative_step():
    x, dt, A, B, C = _ssd_inputs()
    with pytest.warns(RangeWarning, match="A should be <= 0: 1 of 2 values are not"):
        ssd(x, dt, torch.tensor([-1.0, 0.5]), B, C)
    bad = dt.clone()
    bad[0, 2, 0] = -0.3
    with pytest.warns(RangeWarning, match="dt should be >= 0: 1 of 12 values are not"):
        ssd(x, bad, A, B, C)
    with pytest.warns(RangeWarning, match=r"dt \+ dt_bias should be >= 0"):
        ssd(x, dt, A, B, C, dt_bias=torch.tensor([-5.0, 0.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ssd(x, bad, A, B, C, dt_softplus=True)  # softplus maps any dt to a valid step


def test_selective_scan_says_a_positive_A_and_a_negative_step():
    g = torch.Generator().manual_seed(2)
    u, delta = torch.randn(1, 5, 3, generator=g), torch.rand(1, 5, 3, generator=g)
    A = -torch.rand(3, 4, generator=g)
    B, C = torch.randn(1, 5, 4, generator=g), torch.randn(1, 5, 4, generator=g)
    bad_A = A.clone()
    bad_A[1, 2] = 1.0
    with pytest.warns(RangeWarning, match="A should be <= 0: 1 of 12 values are not"):
        selective_scan(u, delta, bad_A, B, C)
    with pytest.warns(RangeWarning, match="delta should be >= 0"):
        selective_scan(u, -delta, A, B, C)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selective_scan(u, -delta, A, B, C, delta_softplus=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"T": -1, "S": 3}, "T must be an int >= 0, got -1"),
        ({"T": 4, "S": 3}, r"S \(keys\) must be >= T"),
        ({"T": 3, "S": 3, "window": 0}, "window must be None or an int >= 1, got 0"),
        ({"T": 3, "S": 3, "n_sink": -2}, "n_sink must be an int >= 0"),
        ({"T": 2.0, "S": 3}, "T must be an int >= 0, got 2.0"),
    ],
)
def test_attention_mask_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention_mask(**kwargs)


def test_attention_mask_window_means_what_it_says():
    """A known answer: window 2 over 4 tokens keeps the diagonal and the one before it."""
    m = attention_mask(4, 4, window=2)
    assert m.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, True, True, False],
        [False, False, True, True],
    ]


def test_softmax_attention_takes_a_plain_kv_pair_as_its_cache():
    q, k, v = _qkv(T=6)
    full, _ = softmax_attention(q, k, v)
    _, cache = softmax_attention(q[:, :4], k[:, :4], v[:, :4], output_final_state=True)
    tail, _ = softmax_attention(q[:, 4:], k[:, 4:], v[:, 4:], initial_state=(cache.k, cache.v))
    torch.testing.assert_close(tail, full[:, 4:])
    with pytest.raises(TypeError, match="initial_state.k must be a torch.Tensor"):
        softmax_attention(q, k, v, initial_state=([1.0], cache.v))
    assert isinstance(cache, KVCache)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_the_finite_switch_takes_only_a_bool(value):
    with pytest.raises(TypeError, match="enabled must be True or False"):
        set_finite_checks(value)
    with pytest.raises(TypeError, match="enabled must be True or False"):
        with finite_checks(value):
            pass


# ------------------------------------------------------------------------------------------------
# "computed as given": every form, also the autograd chunk forms that run under torch.compile and
# on CUDA (forced here by avoid_host_reads), against a hand loop of the recurrence's equation
# ------------------------------------------------------------------------------------------------


def _hand_gated(q, k, v, g, beta=None):
    """Token loop of S_t = exp(g_t) ⊙ (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t K^-½
    (β = None: gated linear attention, S_t = exp(g_t) ⊙ S_{t−1} + k_t v_tᵀ); g scalar [B, T, H] or
    per channel [B, T, H, K] (decaying the rows of S)."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        a = g[:, t].exp()
        a = a[..., None, None] if g.ndim == 3 else a[..., None]
        kt, vt = k[:, t], v[:, t]
        if beta is None:
            S = a * S + kt[..., None] * vt[..., None, :]
        else:
            b = beta[:, t][..., None, None]
            S = a * (S - b * kt[..., None] * torch.einsum("bhk,bhkv->bhv", kt, S)[..., None, :])
            S = S + b * kt[..., None] * vt[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S))
    return torch.stack(out, 1)


@pytest.mark.parametrize("path", ["eager", "traced or CUDA"])
@pytest.mark.parametrize("op", ["gla scalar", "gla per-channel", "gated delta rule"])
def test_positive_log_gates_are_computed_as_given_by_every_form(op, path, monkeypatch):
    """Gates in (0, 0.15] over a stretch of 12 tokens (decays above 1, the state grows): recurrent,
    chunk (two chunks of 16 and a tail) and parallel equal the hand loop. Before the fix the autograd
    chunk forms (torch.compile, CUDA, and the delta rule's parallel form) capped each decay factor
    at 1 (28 % relative error here) while the CPU's hand-written forms did not."""
    import importlib

    from mnemo.ops import use_backend

    if path != "eager":
        for mod in ("mnemo.ops.delta_rule", "mnemo.ops.gated_linear_attention"):
            monkeypatch.setattr(importlib.import_module(mod), "avoid_host_reads", lambda *t: True)
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 40, 2, 4, 3
    q, k, v = (torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for d in (K, K, V))
    k = torch.nn.functional.normalize(k, dim=-1)
    shape = (B, T, H, K) if op == "gla per-channel" else (B, T, H)
    g = -0.1 * torch.rand(*shape, generator=gen, dtype=torch.float64)
    g[:, 10:22] = 0.15 * torch.rand(*g[:, 10:22].shape, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) if op == "gated delta rule" else None
    want = _hand_gated(q, k, v, g, beta)
    with use_backend("torch"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RangeWarning)
        for mode in ("recurrent", "chunk", "parallel"):
            if beta is None:
                o, _ = gated_linear_attention(q, k, v, g=g, mode=mode, chunk_size=16)
            else:
                o, _ = gated_delta_rule(q, k, v, g=g, beta=beta, mode=mode, chunk_size=16)
            rel = float((o - want).norm() / want.norm())
            assert rel < 1e-12, (mode, rel)


@pytest.mark.parametrize("path", ["eager", "traced or CUDA"])
def test_selective_scan_with_a_positive_A_and_a_negative_step_is_computed_as_given(path, monkeypatch):
    """h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t, y_t = h_t C_t by hand, with one A > 0 and one
    Δ < 0: every form equals it (the RangeWarning's "computed as given")."""
    import importlib

    from mnemo.ops import use_backend

    if path != "eager":
        monkeypatch.setattr(
            importlib.import_module("mnemo.ops.selective_scan"), "avoid_host_reads", lambda *t: True
        )
    g = torch.Generator().manual_seed(2)
    T, D, N = 9, 3, 4
    u, delta = (
        torch.randn(1, T, D, generator=g, dtype=torch.float64),
        torch.rand(1, T, D, generator=g, dtype=torch.float64),
    )
    A = -torch.rand(D, N, generator=g, dtype=torch.float64)
    A[1, 2] = 0.7
    delta[0, 4, 1] = -0.3
    B, C = (torch.randn(1, T, N, generator=g, dtype=torch.float64) for _ in range(2))
    h, ys = torch.zeros(D, N, dtype=torch.float64), []
    for t in range(T):
        h = torch.exp(delta[0, t, :, None] * A) * h + delta[0, t, :, None] * B[0, t] * u[0, t, :, None]
        ys.append(h @ C[0, t])
    want = torch.stack(ys)
    with use_backend("torch"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RangeWarning)
        for mode in ("recurrent", "chunk", "parallel"):
            y, _ = selective_scan(u, delta, A, B, C, mode=mode)
            assert float((y[0] - want).norm() / want.norm()) < 1e-12, mode
