"""SSD (Mamba-2) beyond the generic contract: the recurrence itself, its identity with gated linear
attention, parameter gradients, extremes and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from einops import repeat

from mnemo.ops import gated_linear_attention, ssd
from tests.helpers import assert_close

MODES = ["recurrent", "chunk", "parallel"]


def _inputs(Bsz=2, T=21, H=4, P=3, N=5, G=2, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=gen, dtype=dtype)

    bc = (Bsz, T, N) if G is None else (Bsz, T, G, N)
    return {
        "x": r(Bsz, T, H, P),
        "dt": r(Bsz, T, H) - 1.0,
        "A": -(0.5 * r(H)).exp(),
        "B": r(*bc),
        "C": r(*bc),
        "D": r(H),
        "dt_bias": 0.5 * r(H),
        "h0": r(Bsz, H, N, P),
    }


def _run(x, mode, chunk_size=8):
    return ssd(
        x["x"],
        x["dt"],
        x["A"],
        x["B"],
        x["C"],
        D=x["D"],
        dt_bias=x["dt_bias"],
        dt_softplus=True,
        initial_state=x["h0"],
        output_final_state=True,
        mode=mode,
        chunk_size=chunk_size,
    )


def _token_loop(x):
    """The Mamba-2 recurrence written out per head, independently of the op:
        h_t = exp(dt_t A_h) h_{t−1} + B_t (dt_t x_t)ᵀ,   y_t = h_tᵀ C_t + D_h x_t,
    head h reading group h // (H / G)."""
    X, A = x["x"], x["A"]
    Bsz, T, H, P = X.shape
    Bm, Cm = x["B"], x["C"]
    if Bm.ndim == 3:
        Bm, Cm = Bm[:, :, None], Cm[:, :, None]
    per = H // Bm.shape[2]
    dt = torch.log1p(torch.exp(x["dt"] + x["dt_bias"]))
    h = x["h0"].clone()
    y = torch.empty_like(X)
    for t in range(T):
        for j in range(H):
            g = j // per
            h[:, j] = (
                torch.exp(dt[:, t, j] * A[j])[:, None, None] * h[:, j]
                + Bm[:, t, g, :, None] * (dt[:, t, j, None] * X[:, t, j])[:, None, :]
            )
            y[:, t, j] = torch.einsum("bnp,bn->bp", h[:, j], Cm[:, t, g]) + x["D"][j] * X[:, t, j]
    return y, h


@pytest.mark.parametrize("G", [None, 1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_matches_token_loop(mode, G):
    x = _inputs(G=G)
    y_ref, h_ref = _token_loop(x)
    y, h = _run(x, mode)
    assert_close(y, y_ref, 1e-12, what=f"{mode} y")
    assert_close(h, h_ref, 1e-12, what=f"{mode} final state")


@pytest.mark.parametrize("mode", MODES)
def test_is_gated_linear_attention(mode):
    """ssd(x, dt, A, B, C, D) == GLA(q=C, k=B, v=dt·x, g=dt·A, scale=1) + D·x, groups expanded."""
    x = _inputs(G=2)
    y, h = _run(x, mode)
    dt = F.softplus(x["dt"] + x["dt_bias"])
    q = repeat(x["C"], "b t g n -> b t (g r) n", r=2)
    k = repeat(x["B"], "b t g n -> b t (g r) n", r=2)
    o, S = gated_linear_attention(
        q,
        k,
        dt[..., None] * x["x"],
        dt * x["A"],
        scale=1.0,
        initial_state=x["h0"],
        output_final_state=True,
        mode=mode,
        chunk_size=8,
    )
    assert_close(y, o + x["D"][:, None] * x["x"], 1e-14, what="y")
    assert_close(h, S, 1e-14, what="state")


ALL = ("x", "dt", "A", "B", "C", "D", "dt_bias", "h0")


def _grads(x, mode):
    x = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    y, h = _run(x, mode)
    gen = torch.Generator().manual_seed(5)
    (
        (y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum()
        + (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
    ).backward()
    return {n: x[n].grad for n in ALL}


@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_gradients_of_every_input_match_reference(mode):
    x = _inputs(T=19)
    ref, got = _grads(x, "recurrent"), _grads(x, mode)
    for n in ALL:
        assert ref[n] is not None and got[n] is not None, f"no gradient reached {n}"
        assert_close(got[n], ref[n], 1e-10, what=f"{mode} d/d{n}")


@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_extreme_decays_in_bf16_stay_finite(mode):
    """A = -16 and steps up to 25 (log decays down to -400, clamped at -60) mixed with tiny steps,
    128-token chunks, bf16 inputs: finite outputs and gradients, and the reference's values."""
    x = _inputs(Bsz=1, T=300, H=2, P=16, N=16, G=1, dtype=torch.float32, seed=2)
    x["A"] = torch.full((2,), -16.0)
    x["dt"] = 25 * torch.rand(1, 300, 2, generator=torch.Generator().manual_seed(1))
    x["dt"][:, ::7] = -8.0  # softplus(-8 + bias) ≈ 3e-4
    args = {n: t.bfloat16().requires_grad_(True) for n, t in x.items()}
    y, h = _run(args, mode, chunk_size=128)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    (y.float().square().sum() + h.square().sum()).backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(h).all()
    for n, t in args.items():
        assert torch.isfinite(t.grad.float()).all(), n
    y_ref, h_ref = _run({n: t.detach().double() for n, t in args.items()}, "recurrent")
    assert_close(y.float(), y_ref, 1e-2)
    assert_close(h, h_ref, 2e-5)  # the float32 state: the documented float32 tolerance (measured 2.8e-8)


def test_bad_inputs_name_argument_and_shapes():
    x = _inputs(Bsz=1, T=5, H=4, P=3, N=2, G=2)
    X, dt, A, B, C = x["x"], x["dt"], x["A"], x["B"], x["C"]
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, H, P\] \(4 dims\), got \[1, 5, 4\]"):
        ssd(X[..., 0], dt, A, B, C)
    with pytest.raises(ValueError, match=r"dt must have shape \[B, T, H\] = \[1, 5, 4\], got \[1, 5, 3\]"):
        ssd(X, dt[..., :3], A, B, C)
    with pytest.raises(ValueError, match=r"A must have shape \[H\] = \[4\], got \[4, 1\]"):
        ssd(X, dt, A[:, None], B, C)
    with pytest.raises(
        ValueError,
        match=r"B must have shape \[B, T, N\] = \[1, 5, N\] or \[B, T, G, N\] = "
        r"\[1, 5, G, N\] with H = 4 divisible by G, got \[1, 5, 3, 2\]",
    ):
        ssd(X, dt, A, torch.zeros(1, 5, 3, 2, dtype=X.dtype), C)
    with pytest.raises(
        ValueError,
        match=r"C must have shape \[B, T, N\] = \[1, 5, 2\] .* "
        r"got \[1, 5, 2, 3\]",
    ):
        ssd(X, dt, A, B, torch.zeros(1, 5, 2, 3, dtype=X.dtype))
    with pytest.raises(
        ValueError,
        match=r"C must have the same number of groups as B = 2, "
        r"got \[1, 5, 4, 2\]",
    ):
        ssd(X, dt, A, B, torch.zeros(1, 5, 4, 2, dtype=X.dtype))
    with pytest.raises(ValueError, match=r"D must have shape \[H\] = \[4\], got \[3\]"):
        ssd(X, dt, A, B, C, D=torch.zeros(3, dtype=X.dtype))
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[H\] = \[4\], got \[1, 4\]"):
        ssd(X, dt, A, B, C, dt_bias=torch.zeros(1, 4, dtype=X.dtype))
    with pytest.raises(
        ValueError,
        match=r"initial_state must have shape \[B, H, N, P\] = \[1, 4, 2, 3\], "
        r"got \[1, 4, 3, 2\]",
    ):
        ssd(X, dt, A, B, C, initial_state=torch.zeros(1, 4, 3, 2))
    with pytest.raises(TypeError, match="dt must be a floating-point tensor"):
        ssd(X, dt.long(), A, B, C)
    with pytest.raises(ValueError, match="mode must be one of"):
        ssd(X, dt, A, B, C, mode="fast")
    with pytest.raises(ValueError, match="packed into B = 1"):
        ssd(
            X.expand(2, -1, -1, -1),
            dt.expand(2, -1, -1),
            A,
            B.expand(2, -1, -1, -1),
            C.expand(2, -1, -1, -1),
            cu_seqlens=torch.tensor([0, 5]),
        )
