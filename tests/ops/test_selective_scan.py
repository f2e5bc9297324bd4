"""Selective scan (Mamba / S6) beyond the generic contract: the formula itself, its identity with
per-channel gated linear attention, parameter gradients, the hand-written backward, extremes,
dtypes and errors.

Every test runs twice: with the C kernel behind ``mode="chunk"`` on the CPU (``native``) and with
it switched off (``MNEMO_NATIVE=0``), so the PyTorch blocked form keeps the same coverage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.ops import _native, gated_linear_attention, selective_scan
from tests.helpers import assert_close

MODES = ["recurrent", "chunk", "parallel"]


@pytest.fixture(autouse=True, params=["native", "torch"])
def backend(request, monkeypatch):
    """Run the module's tests with the C kernel (skipped where it cannot be built) and without."""
    if request.param == "torch":
        monkeypatch.setenv("MNEMO_NATIVE", "0")
    else:
        monkeypatch.delenv("MNEMO_NATIVE", raising=False)
        if _native.library() is None:
            pytest.skip("native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)")
    return request.param


def _inputs(Bsz=2, T=13, D=6, N=4, G=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=gen, dtype=dtype)

    bc = (Bsz, T, N) if G is None else (Bsz, T, G, N)
    return {
        "u": r(Bsz, T, D),
        "delta": r(Bsz, T, D) - 1.0,
        "A": -(0.5 * r(D, N)).exp(),
        "B": r(*bc),
        "C": r(*bc),
        "D": r(D),
        "z": r(Bsz, T, D),
        "delta_bias": 0.5 * r(D),
        "h0": r(Bsz, D, N),
    }


def _run(x, mode, chunk_size=None, softplus=True, **kw):
    return selective_scan(
        x["u"],
        x["delta"],
        x["A"],
        x["B"],
        x["C"],
        D=x["D"],
        z=x["z"],
        delta_bias=x["delta_bias"],
        delta_softplus=softplus,
        initial_state=x["h0"],
        output_final_state=True,
        mode=mode,
        chunk_size=chunk_size,
        **kw,
    )


def _direct(x, softplus=True):
    """Closed form, written independently of the op: for every (b, d, n)
        h_t = exp(Σ_{r≤t} Δ_r A) h_0 + Σ_{s≤t} exp(Σ_{s<r≤t} Δ_r A) Δ_s B_s u_s,
        y_t = (Σ_n C_t h_t + D u_t) · z_t · sigmoid(z_t),
    with channel d reading group d // (D / G) of B and C."""
    u, A, h0 = x["u"], x["A"], x["h0"]
    Bsz, T, D = u.shape
    Bm, Cm = x["B"], x["C"]
    if Bm.ndim == 3:
        Bm, Cm = Bm[:, :, None], Cm[:, :, None]
    per = D // Bm.shape[2]
    grp = [d // per for d in range(D)]
    Bd, Cd = Bm[:, :, grp], Cm[:, :, grp]  # [B, T, D, N]
    dt = x["delta"] + x["delta_bias"]
    if softplus:
        dt = torch.log1p(torch.exp(dt))
    a = dt[..., None] * A  # [B, T, D, N]
    y = torch.empty_like(u)
    h = None
    for t in range(T):
        h = torch.exp(a[:, : t + 1].sum(1)) * h0
        for s in range(t + 1):
            h = h + torch.exp(a[:, s + 1 : t + 1].sum(1)) * (dt[:, s] * u[:, s])[..., None] * Bd[:, s]
        y[:, t] = (Cd[:, t] * h).sum(-1) + x["D"] * u[:, t]
    z = x["z"]
    return y * z * torch.sigmoid(z), h


@pytest.mark.parametrize("G", [None, 1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_matches_direct_formula(mode, G):
    x = _inputs(G=G)
    y_ref, h_ref = _direct(x)
    y, h = _run(x, mode, chunk_size=4 if mode == "chunk" else None)
    assert_close(y, y_ref, 1e-12, what=f"{mode} y")
    assert_close(h, h_ref, 1e-12, what=f"{mode} final state")


@pytest.mark.parametrize("mode", MODES)
def test_is_per_channel_gated_linear_attention(mode):
    """Each channel d is GLA with one head per channel, K = N, V = 1: q = C, k = Δ B, v = u,
    per-channel log gate g = Δ A, scale = 1."""
    x = _inputs(G=2, D=6)
    dt = F.softplus(x["delta"] + x["delta_bias"])
    y, h = selective_scan(
        x["u"],
        x["delta"],
        x["A"],
        x["B"],
        x["C"],
        delta_bias=x["delta_bias"],
        delta_softplus=True,
        initial_state=x["h0"],
        output_final_state=True,
        mode=mode,
    )
    Bd = x["B"].repeat_interleave(3, dim=2)  # [B, T, D, N]: channel d uses group d // 3
    Cd = x["C"].repeat_interleave(3, dim=2)
    o, S = gated_linear_attention(
        Cd,
        dt[..., None] * Bd,
        x["u"][..., None],
        dt[..., None] * x["A"],
        scale=1.0,
        initial_state=x["h0"][..., None],
        output_final_state=True,
        mode=mode,
        chunk_size=4,
    )
    assert_close(y, o[..., 0], 1e-12, what="y vs GLA")
    assert_close(h, S[..., 0], 1e-12, what="state vs GLA")


def _grads(x, mode, names, **kw):
    x = {n: t.detach().clone().requires_grad_(n in names) for n, t in x.items()}
    y, h = _run(x, mode, **kw)
    gen = torch.Generator().manual_seed(5)
    (
        (y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum()
        + (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
    ).backward()
    return {n: x[n].grad for n in names}


ALL = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "h0")


@pytest.mark.parametrize("G", [None, 2])
@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_gradients_of_every_input_match_reference(mode, G):
    x = _inputs(T=21, G=G)
    ref = _grads(x, "recurrent", ALL)
    got = _grads(x, mode, ALL, chunk_size=5 if mode == "chunk" else None)
    for n in ALL:
        assert ref[n] is not None and got[n] is not None, f"no gradient reached {n}"
        assert_close(got[n], ref[n], 1e-10, what=f"{mode} d/d{n}")


@pytest.mark.parametrize("G", [None, 2])
def test_gradcheck_chunk_backward(G):
    """The chunk form's hand-written reverse scan, checked against finite differences."""
    x = _inputs(Bsz=1, T=7, D=4, N=3, G=G)
    names = list(ALL)

    def f(*args):
        return _run(dict(zip(names, args)), "chunk", chunk_size=3)

    args = tuple(x[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 2, 7, 16, 64, None])
def test_chunk_size_does_not_change_the_result(chunk_size):
    x = _inputs(T=23)
    y_ref, h_ref = _run(x, "recurrent")
    y, h = _run(x, "chunk", chunk_size=chunk_size)
    assert_close(y, y_ref, 1e-12)
    assert_close(h, h_ref, 1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_huge_step_is_a_reset(mode):
    """Δ·A far below -60 at position a (clamped there, so no overflow or NaN): everything after a
    equals a fresh run from a with a zero state, and gradients agree across forms."""
    x = _inputs(T=30)
    a = 11
    x["delta"][:, a] = 400.0  # softplus(400) = 400, Δ·A ≈ -400·|A| → clamped at -60
    y, h = _run(x, mode, chunk_size=8)
    x2 = {n: (t[:, a:] if t.ndim == 3 and t.shape[1] == 30 else t) for n, t in x.items()}
    x2["h0"] = torch.zeros_like(x["h0"])
    y2, h2 = _run(x2, mode, chunk_size=8)
    assert torch.isfinite(y).all()
    assert_close(y[:, a:], y2, 1e-10, what="after the reset")
    assert_close(h, h2, 1e-10, what="state after the reset")
    if mode != "recurrent":
        ref = _grads(x, "recurrent", ALL)
        got = _grads(x, mode, ALL, chunk_size=8)
        for n in ALL:
            assert_close(got[n], ref[n], 1e-10, what=f"{mode} d/d{n} with the clamp active")


@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_extreme_decays_in_bf16_stay_finite(mode):
    """A = -16, steps up to 25 (log decays down to -400, clamped) mixed with tiny steps, long
    blocks, bf16 inputs: finite outputs and gradients, and still the reference's values."""
    gen = torch.Generator().manual_seed(3)
    T, D, N = 200 if mode == "chunk" else 96, 16, 8
    u, B, C, z = (torch.randn(1, T, n, generator=gen) for n in (D, N, N, D))
    delta = 25 * torch.rand(1, T, D, generator=gen)
    delta[:, ::5] = 1e-3
    A = torch.full((D, N), -16.0)
    Dp, h0 = torch.randn(D, generator=gen), torch.randn(1, D, N, generator=gen)
    args = [t.bfloat16().requires_grad_(True) for t in (u, delta, A, B, C, Dp, z, h0)]
    y, h = selective_scan(
        *args[:5],
        D=args[5],
        z=args[6],
        initial_state=args[7],
        output_final_state=True,
        mode=mode,
        chunk_size=128,
    )
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    (y.float().square().sum() + h.square().sum()).backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(h).all()
    for t in args:
        assert torch.isfinite(t.grad.float()).all()
    ref, href = selective_scan(
        *[t.detach().double() for t in args[:5]],
        D=args[5].detach().double(),
        z=args[6].detach().double(),
        initial_state=args[7].detach().double(),
        output_final_state=True,
        mode="recurrent",
    )
    assert_close(y.float(), ref, 1e-2)
    assert_close(h, href, 1e-5)


def test_dtypes():
    x = _inputs(T=8)
    f32 = {n: t.float() for n, t in x.items()}
    y, h = _run({n: t.bfloat16() for n, t in f32.items()}, "chunk")
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    y_ref, _ = _run({n: t.bfloat16().float() for n, t in f32.items()}, "recurrent")
    assert_close(y.float(), y_ref, 1e-2)
    mixed = dict(f32, A=x["A"])  # one float64 input -> float64 compute
    y, h = _run(mixed, "chunk")
    assert y.dtype == torch.float32 and h.dtype == torch.float64


def test_expanded_and_strided_inputs():
    """B, C broadcast over time (stride 0, as an LTI layer passes them) and non-contiguous u."""
    x = _inputs(T=9)
    Bc = x["B"][:, :1].expand(-1, 9, -1)
    u = torch.randn(9, 2, 6, dtype=torch.float64).transpose(0, 1)
    outs = [selective_scan(u, x["delta"], x["A"], Bc, Bc, mode=m, chunk_size=4)[0] for m in MODES]
    ref, _ = selective_scan(
        u.contiguous(), x["delta"], x["A"], Bc.contiguous(), Bc.contiguous(), mode="recurrent"
    )
    for o in outs:
        assert_close(o, ref, 1e-12)


def test_varlen_pads_after_the_softplus():
    """With a bias and softplus, padding must be Δ = 0 (not δ = 0, whose Δ = softplus(bias) > 0
    would decay the state and feed it zeros)."""
    x = _inputs(Bsz=1, T=19)
    cu = torch.tensor([0, 5, 5, 19])
    h0 = torch.randn(3, 6, 4, dtype=torch.float64)
    for mode in MODES:
        y, h = selective_scan(
            x["u"],
            x["delta"],
            x["A"],
            x["B"],
            x["C"],
            delta_bias=x["delta_bias"] + 2.0,
            delta_softplus=True,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu,
            mode=mode,
            chunk_size=4,
        )
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            sl = {n: x[n][:, s:e] for n in ("u", "delta", "B", "C")}
            yi, hi = selective_scan(
                sl["u"],
                sl["delta"],
                x["A"],
                sl["B"],
                sl["C"],
                delta_bias=x["delta_bias"] + 2.0,
                delta_softplus=True,
                initial_state=h0[i : i + 1],
                output_final_state=True,
                mode=mode,
            )
            assert_close(y[:, s:e], yi, 1e-12, what=f"{mode} seq {i}")
            assert_close(h[i : i + 1], hi, 1e-12, what=f"{mode} state {i}")


def test_bad_inputs_name_argument_and_shapes():
    x = _inputs(Bsz=1, T=5, D=6, N=4)
    u, dl, A, B, C = x["u"], x["delta"], x["A"], x["B"], x["C"]
    with pytest.raises(ValueError, match=r"u must have shape \[B, T, D\] \(3 dims\), got \[1, 5, 6, 1\]"):
        selective_scan(u[..., None], dl, A, B, C)
    with pytest.raises(ValueError, match=r"delta must have shape \[B, T, D\] = \[1, 5, 6\], got \[1, 5, 5\]"):
        selective_scan(u, dl[..., :5], A, B, C)
    with pytest.raises(ValueError, match=r"A must have shape \[D, N\] = \[6, N\], got \[5, 4\]"):
        selective_scan(u, dl, A[:5], B, C)
    with pytest.raises(
        ValueError,
        match=r"B must have shape \[B, T, N\] = \[1, 5, 4\] or \[B, T, G, N\] "
        r"= \[1, 5, G, 4\] with D = 6 divisible by G, got \[1, 5, 3\]",
    ):
        selective_scan(u, dl, A, B[..., :3], C)
    with pytest.raises(ValueError, match=r"C must have shape .* divisible by G, got \[1, 5, 4, 4\]"):
        selective_scan(u, dl, A, B, C[:, :, None].expand(-1, -1, 4, -1))
    with pytest.raises(ValueError, match=r"D must have shape \[D\] = \[6\], got \[4\]"):
        selective_scan(u, dl, A, B, C, D=torch.zeros(4, dtype=u.dtype))
    with pytest.raises(ValueError, match=r"z must have shape \[B, T, D\] = \[1, 5, 6\], got \[1, 4, 6\]"):
        selective_scan(u, dl, A, B, C, z=u[:, :4])
    with pytest.raises(ValueError, match=r"delta_bias must have shape \[D\] = \[6\], got \[6, 1\]"):
        selective_scan(u, dl, A, B, C, delta_bias=torch.zeros(6, 1, dtype=u.dtype))
    with pytest.raises(
        ValueError,
        match=r"initial_state must have shape \[B, D, N\] = \[1, 6, 4\], "
        r"got \[1, 4, 6\]",
    ):
        selective_scan(u, dl, A, B, C, initial_state=torch.zeros(1, 4, 6))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[num_seqs, D, N\].* = \[2, 6, 4\]"):
        selective_scan(u, dl, A, B, C, initial_state=torch.zeros(1, 6, 4), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(TypeError, match="u must be a floating-point tensor"):
        selective_scan(u.long(), dl, A, B, C)
    with pytest.raises(ValueError, match="mode must be one of"):
        selective_scan(u, dl, A, B, C, mode="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        selective_scan(u, dl, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 5"):
        selective_scan(u, dl, A, B, C, cu_seqlens=torch.tensor([0, 4]))
