"""Found by a hostile numerical review of the ops: a tensor ``scale`` (a learned temperature, which
:func:`~mnemo.ops._common.default_scale` takes as it is) gets its gradient in every form and runs in
softmax attention's SDPA path; softmax attention's parallel form takes mixed input dtypes as its
reference form does; SSD names its own arguments when they hold NaN/inf (and checks ``D`` at all);
empty batches and state sizes run in every form; bad ``cu_seqlens`` / ``window`` are named."""

import pytest
import torch

from mnemo.ops import (
    NonFiniteError,
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    linear_attention,
    selective_scan,
    softmax_attention,
    ssd,
)

MODES = ("recurrent", "chunk", "parallel")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _matrix_inputs(T=7, H=2, K=3, V=4, dtype=torch.float64):
    g = _gen()
    q = torch.randn(1, T, H, K, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=g, dtype=dtype)
    lg = -torch.rand(1, T, H, generator=g, dtype=dtype)
    beta = torch.rand(1, T, H, generator=g, dtype=dtype)
    return q, k, v, lg, beta


_MATRIX_OPS = {
    "gated_delta_rule": lambda q, k, v, lg, beta, **kw: gated_delta_rule(q, k, v, lg, beta, **kw),
    "delta_rule": lambda q, k, v, lg, beta, **kw: delta_rule(q, k, v, beta, **kw),
    "gated_linear_attention": lambda q, k, v, lg, beta, **kw: gated_linear_attention(q, k, v, lg, **kw),
    "linear_attention": lambda q, k, v, lg, beta, **kw: linear_attention(q, k, v, **kw),
}


@pytest.mark.parametrize("op", sorted(_MATRIX_OPS))
@pytest.mark.parametrize("varlen", [False, True])
def test_tensor_scale_gets_its_gradient_in_every_form(op, varlen):
    """The chunk forms turned a tensor scale into a float (``float(scale)``): no gradient reached it
    (and ``autograd.grad`` raised when it was the only input asking for one)."""
    q, k, v, lg, beta = _matrix_inputs()
    cu = torch.tensor([0, 3, 7]) if varlen else None
    out, grads = {}, {}
    for mode in MODES:
        scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        o, _ = _MATRIX_OPS[op](q, k, v, lg, beta, scale=scale, mode=mode, chunk_size=2, cu_seqlens=cu)
        out[mode] = o
        (grads[mode],) = torch.autograd.grad((o * o).sum(), scale)
    expected, _ = _MATRIX_OPS[op](q, k, v, lg, beta, scale=0.7, mode="recurrent", cu_seqlens=cu)
    for mode in MODES:
        torch.testing.assert_close(out[mode], expected)
        torch.testing.assert_close(grads[mode], grads["recurrent"])
    # the gradient of o with respect to the scale is ∂o/∂scale = o / scale (o is linear in q)
    torch.testing.assert_close(grads["chunk"], (2 * expected * expected / 0.7).sum().reshape(()))


@pytest.mark.parametrize("kw", [{}, {"window": 2}, {"cu_seqlens": torch.tensor([0, 2, 5])}])
def test_softmax_attention_tensor_scale(kw):
    """The parallel form passed a tensor scale to SDPA, which takes only a float (TypeError)."""
    g = _gen(1)
    q, k, v = (torch.randn(1, 5, 2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    res = {}
    for mode in ("parallel", "recurrent"):
        scale = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
        o, _ = softmax_attention(q, k, v, scale=scale, mode=mode, **kw)
        res[mode] = (o, *torch.autograd.grad((o * o).sum(), scale))
    torch.testing.assert_close(res["parallel"], res["recurrent"])
    o, _ = softmax_attention(q, k, v, scale=0.6, **kw)
    torch.testing.assert_close(res["parallel"][0], o)


def test_softmax_attention_tensor_scale_with_sinks():
    g = _gen(2)
    q, k, v, sq = (torch.randn(1, 6, 2, 3, generator=g, dtype=torch.float64) for _ in range(4))
    kw = dict(window=2, n_sink=1, sink_q=sq)
    ref, _ = softmax_attention(q, k, v, scale=0.6, mode="recurrent", **kw)
    o, _ = softmax_attention(q, k, v, scale=torch.tensor(0.6, dtype=torch.float64), **kw)
    torch.testing.assert_close(o, ref)


def test_softmax_attention_parallel_takes_mixed_dtypes():
    """Every other op computes mixed float dtypes in the compute dtype; softmax attention's reference
    form did too, its parallel (default) form raised SDPA's dtype error."""
    g = _gen(3)
    q = torch.randn(1, 5, 2, 3, generator=g)
    k = torch.randn(1, 5, 2, 3, generator=g, dtype=torch.float64)
    v = torch.randn(1, 5, 2, 3, generator=g)
    cache = (torch.randn(1, 2, 2, 3, generator=g), torch.randn(1, 2, 2, 3, generator=g))
    for kw in ({}, {"window": 3}, {"initial_state": cache}):
        ref, _ = softmax_attention(q, k, v, mode="recurrent", **kw)
        o, c = softmax_attention(q, k, v, output_final_state=True, **kw)
        assert o.dtype == q.dtype
        assert c.k.dtype == k.dtype and c.v.dtype == v.dtype  # the cache keeps the inputs' dtypes
        torch.testing.assert_close(o, ref)


def _ssd_inputs():
    g = _gen(4)
    x = torch.randn(1, 6, 2, 4, generator=g)
    dt = torch.rand(1, 6, 2, generator=g)
    B = torch.randn(1, 6, 3, generator=g)
    return x, dt, -torch.rand(2, generator=g), B, B.clone()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["x", "dt", "A", "D", "dt_bias"])
def test_ssd_names_its_own_non_finite_inputs(mode, name):
    """SSD's forms see only ``v = dt·x`` and ``g = dt·A``: NaN in ``x``/``dt`` was reported as
    ``v``'s, in ``A`` as ``g``'s, and NaN in ``D`` passed silently into the output."""
    x, dt, A, B, C = _ssd_inputs()
    args = {"x": x, "dt": dt, "A": A, "D": torch.ones(2), "dt_bias": torch.zeros(2)}
    args[name] = args[name].clone()
    args[name].view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match=f"^{name} contains 1 NaN"):
        ssd(args["x"], args["dt"], args["A"], B, C, args["D"], dt_bias=args["dt_bias"], mode=mode)


def test_delta_rule_parallel_empty_batch():
    """``mode="parallel"`` with ``B = 0`` divided by zero in einops (``b=B``); the other forms ran."""
    q, k, v, lg, beta = (t[:0] for t in _matrix_inputs())
    S0 = torch.zeros(0, 2, 3, 4, dtype=torch.float64)
    for mode in MODES:
        for op in ("gated_delta_rule", "delta_rule"):
            o, S = _MATRIX_OPS[op](q, k, v, lg, beta, initial_state=S0, output_final_state=True, mode=mode)
            assert o.shape == v.shape and S.shape == S0.shape


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(0, 5, 4, 3), (1, 5, 4, 0), (1, 5, 0, 3)])
def test_selective_scan_empty_batch_or_state(monkeypatch, native, mode, shape):
    """``B = 0`` crashed the PyTorch chunk form (``amax`` of an empty tensor), ``N = 0`` the parallel
    form (``stack`` of no tensors)."""
    monkeypatch.setenv("MNEMO_NATIVE", native)
    Bsz, T, D, N = shape
    g = _gen(5)
    u = torch.randn(Bsz, T, D, generator=g, requires_grad=True)
    delta = torch.rand(Bsz, T, D, generator=g)
    A = -torch.rand(D, N, generator=g)
    Bm = torch.randn(Bsz, T, N, generator=g)
    h0 = torch.randn(Bsz, D, N, generator=g, requires_grad=True)
    Dskip = torch.randn(D, generator=g)
    y, h = selective_scan(u, delta, A, Bm, Bm, Dskip, initial_state=h0, output_final_state=True, mode=mode)
    torch.testing.assert_close(y, u * Dskip)  # no state to read: the skip alone
    torch.testing.assert_close(h, h0)
    du, dh0 = torch.autograd.grad(y.sum() + h.sum(), (u, h0))
    torch.testing.assert_close(du, Dskip.expand_as(u))
    torch.testing.assert_close(dh0, torch.ones_like(h0))


def test_bad_cu_seqlens_and_window_are_named():
    q, k, v, lg, beta = _matrix_inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D .* got \[1, 2\]"):
        gated_delta_rule(q, k, v, lg, beta, cu_seqlens=torch.tensor([[0, 7]]))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D .* got list"):
        gated_linear_attention(q, k, v, lg, cu_seqlens=[0, 7])
    with pytest.raises(ValueError, match="^window must be None or a positive int, got True"):
        softmax_attention(q, k, v, window=True)
