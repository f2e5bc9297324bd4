"""Second numerics review of the fast forms (chunk / parallel vs the token loop): bf16 inputs under the
documented float32 accumulation, decays just above the flush threshold, mismatched B/C groups, the maps of
the grouped state-space ops."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mnemo.ops import (
    _native,
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    linear_attention,
    selective_scan,
    selective_scan_map,
    ssd,
    ssd_map,
)

# ----------------------------------------------------------------------------------------------
# bf16 inputs: the chunk forms must round once, at the end (as the other forms do)
# ----------------------------------------------------------------------------------------------

_BF = torch.bfloat16


def _bf16_inputs(seed=0, B=1, T=40, H=2, K=8, V=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g).to(_BF)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(_BF)
    v = torch.randn(B, T, H, V, generator=g).to(_BF)
    beta = torch.rand(B, T, H, generator=g).to(_BF)
    lg = (-torch.rand(B, T, H, generator=g)).to(_BF)
    return q, k, v, beta, lg


_OPS = {
    "linear_attention": lambda q, k, v, beta, g, m: linear_attention(q, k, v, mode=m, chunk_size=16),
    "gla_no_gate": lambda q, k, v, beta, g, m: gated_linear_attention(q, k, v, None, mode=m, chunk_size=16),
    "gla": lambda q, k, v, beta, g, m: gated_linear_attention(q, k, v, g, mode=m, chunk_size=16),
    "delta_rule": lambda q, k, v, beta, g, m: delta_rule(q, k, v, beta, mode=m, chunk_size=16),
    "gated_delta_rule": lambda q, k, v, beta, g, m: gated_delta_rule(q, k, v, g, beta, mode=m, chunk_size=16),
}


@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("mode", ["chunk", "parallel", "recurrent"])
def test_bf16_outputs_are_the_float32_result_rounded_once(op, mode):
    # K = 8: scale = 8 ** -0.5 is not a power of two, so scale · q is not exact in bf16. The docs:
    # "computation accumulates in fp32 even for bf16 inputs", so the bf16 output is the float32
    # result (of the same bf16 values) rounded once: equal but for rare ties near a rounding step.
    # (The chunk forms formed scale · q in bf16 first: 40 % of the outputs were off by an ulp or more.)
    args = _bf16_inputs()
    f = _OPS[op]
    want = f(*(x.float() for x in args), "recurrent")[0].to(_BF)
    got = f(*args, mode)[0]
    assert got.dtype == _BF
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("op", ["gla", "gla_no_gate", "gated_delta_rule", "delta_rule"])
def test_bf16_gradients_are_the_float32_gradients_rounded_once(op):
    # the gradients of bf16 inputs likewise: the float32 gradient rounded once (the chunk form of GLA
    # rounded ∂L/∂q ⊙ e^b to bf16 and then multiplied by the scale in bf16: 27 % of dq was off)
    f = _OPS[op]

    def grads(dtype, mode):
        xs = [x.to(dtype).requires_grad_() for x in _bf16_inputs(seed=1)]
        o = f(*xs, mode)[0]
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(_BF)
        o.backward(w.to(o.dtype))
        return {n: x.grad for n, x in zip("qkv", xs[:3])}

    want = grads(torch.float32, "recurrent")
    got = grads(_BF, "chunk")
    for n in "qkv":
        assert got[n].dtype == _BF
        assert (got[n] != want[n].to(_BF)).float().mean() < 0.01, n


# ----------------------------------------------------------------------------------------------
# decays just above exp(-40): kept as they are (only factors below exp(-40) are flushed to 0)
# ----------------------------------------------------------------------------------------------


def _retention_cases(d: float):
    """Every op on a sequence that writes nothing (zero keys / B) and decays by ``d`` nats at its
    first token: the final state is exactly ``exp(d) · S0``."""
    dt = torch.float64
    B, T, H, K, V = 1, 20, 2, 3, 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, dtype=dt, generator=gen)
    k = torch.zeros(B, T, H, K, dtype=dt)
    v = torch.randn(B, T, H, V, dtype=dt, generator=gen)
    g = torch.zeros(B, T, H, dtype=dt)
    g[:, 0] = d
    gk = torch.zeros(B, T, H, K, dtype=dt)
    gk[:, 0] = d
    beta = torch.full((B, T, H), 0.5, dtype=dt)
    step = torch.zeros(B, T, H, dtype=dt)
    step[:, 0] = -d  # A = -1: dt · A = d at the first token, 0 after it
    A = -torch.ones(H, dtype=dt)
    return {
        "gla": lambda S0, m: gated_linear_attention(
            q, k, v, g, initial_state=S0, output_final_state=True, mode=m, chunk_size=16
        ),
        "gla_per_channel": lambda S0, m: gated_linear_attention(
            q, k, v, gk, initial_state=S0, output_final_state=True, mode=m, chunk_size=16
        ),
        "gated_delta_rule": lambda S0, m: gated_delta_rule(
            q, k, v, g, beta, initial_state=S0, output_final_state=True, mode=m, chunk_size=16
        ),
        "ssd": lambda S0, m: ssd(
            v,
            step,
            A,
            k[:, :, 0],
            q[:, :, 0],
            initial_state=S0,
            output_final_state=True,
            mode=m,
            chunk_size=16,
        ),
    }


@pytest.mark.parametrize("d", [-39.0, -35.0, -30.5])
@pytest.mark.parametrize("op", ["gla", "gla_per_channel", "gated_delta_rule", "ssd"])
@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_a_decay_above_the_flush_threshold_is_kept_exactly(d, op, mode):
    # the docstrings: "the chunked forms treat decay factors below exp(-40) as exactly 0"; a factor
    # above it was returned as exp(d) - exp(-40) (37 % too small at d = -39, 0.7 % at d = -35), so
    # the retained state and the gradient into initial_state across the decay were wrong
    S0 = torch.randn(1, 2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    S0.requires_grad_(True)
    f = _retention_cases(d)[op]
    _, S = f(S0, mode)
    want = math.exp(d) * S0.detach()
    torch.testing.assert_close(S.detach(), want, rtol=1e-12, atol=0)
    w = torch.randn(S.shape, dtype=S.dtype, generator=torch.Generator().manual_seed(2))
    (dS0,) = torch.autograd.grad((S * w).sum(), S0)
    torch.testing.assert_close(dS0, math.exp(d) * w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("op", ["gla", "gla_per_channel", "gated_delta_rule", "ssd"])
def test_a_decay_below_the_flush_threshold_still_resets(op):
    # the other side of the threshold, as documented: a factor below exp(-40) is exactly 0
    S0 = torch.randn(1, 2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for d in (-41.0, -1e4) if op == "ssd" else (-41.0, -1e4, float("-inf")):  # (a step is finite)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, S = _retention_cases(d)[op](S0, "chunk")
        assert torch.isfinite(S).all() and float(S.abs().max()) == 0.0


# ----------------------------------------------------------------------------------------------
# selective scan: B and C with different numbers of groups
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mode", ["chunk", "recurrent", "parallel"])
def test_selective_scan_refuses_b_and_c_of_different_groups(native, mode, monkeypatch):
    # B with one group and C with two: the PyTorch chunk form silently read C's groups wrongly
    # (max error 6.8 against the token loop) and the C kernel failed with an internal message about
    # "Cm"; as ssd does, the op now names C, B's group count and C's shape
    if not native:
        monkeypatch.setenv("MNEMO_NATIVE", "0")
    Bsz, T, D, N = 2, 9, 6, 4
    u, delta = torch.randn(Bsz, T, D), torch.rand(Bsz, T, D)
    A = -torch.rand(D, N)
    with pytest.raises(
        ValueError, match=r"C must have the same number of groups as B = 1, got \[2, 9, 2, 4\]"
    ):
        selective_scan(u, delta, A, torch.randn(Bsz, T, N), torch.randn(Bsz, T, 2, N), mode=mode)
    # equal groups (one given 3-D, the other [B, T, 1, N]) are still taken, in every form
    B3, C4 = torch.randn(Bsz, T, N), torch.randn(Bsz, T, 1, N)
    ref = selective_scan(u, delta, A, B3, C4, mode="recurrent")[0]
    torch.testing.assert_close(selective_scan(u, delta, A, B3, C4, mode=mode)[0], ref, rtol=1e-5, atol=1e-5)


def test_native_switch_gives_the_same_bf16_chunk_results(monkeypatch):
    # MNEMO_NATIVE=0 runs the PyTorch twins of the chunk scans: the same bf16 outputs
    args = _bf16_inputs(seed=3)
    with_native = {n: f(*args, "chunk")[0] for n, f in _OPS.items()}
    with _native.suppressed():
        for n, f in _OPS.items():
            torch.testing.assert_close(f(*args, "chunk")[0], with_native[n], rtol=0, atol=0)


@pytest.mark.parametrize("groups", [None, 1, 2])
def test_selective_scan_map_takes_the_ops_grouped_b_and_c(groups):
    # the map of the op's implicit attention took only [Bt, T, N] (an einsum error for the op's
    # [Bt, T, G, N]): y_d = M^(d) u_d with the same grouped B, C the op was given
    gen = torch.Generator().manual_seed(0)
    dt = torch.float64
    Bt, T, D, N = 2, 9, 6, 4
    shape = (Bt, T, N) if groups is None else (Bt, T, groups, N)
    u = torch.randn(Bt, T, D, dtype=dt, generator=gen)
    delta = torch.rand(Bt, T, D, dtype=dt, generator=gen)
    A = -torch.rand(D, N, dtype=dt, generator=gen)
    B, C = torch.randn(shape, dtype=dt, generator=gen), torch.randn(shape, dtype=dt, generator=gen)
    M = selective_scan_map(delta, A, B, C)
    assert M.shape == (Bt, D, T, T)
    y = selective_scan(u, delta, A, B, C, mode="recurrent")[0]
    torch.testing.assert_close(
        (M @ u.transpose(1, 2)[..., None])[..., 0].transpose(1, 2), y, rtol=1e-12, atol=1e-12
    )
    with pytest.raises(ValueError, match=r"B must have shape \[B, T, N\] = \[2, 9, 4\]"):
        selective_scan_map(delta, A, torch.randn(Bt, T, N + 1, dtype=dt), C)


@pytest.mark.parametrize("groups", [None, 1, 2, 4])
def test_ssd_map_takes_the_ops_grouped_b_and_c(groups):
    # ssd_map took only per-head [B, T, H, N]: the op's [B, T, N] was an einops error and
    # [B, T, G, N] with 1 < G < H a broadcast error; y = M x with the B, C the op was given
    gen = torch.Generator().manual_seed(0)
    dt = torch.float64
    Bsz, T, H, N, P = 2, 7, 4, 3, 2
    shape = (Bsz, T, N) if groups is None else (Bsz, T, groups, N)
    step = torch.rand(Bsz, T, H, dtype=dt, generator=gen)
    A = -torch.rand(H, dtype=dt, generator=gen)
    B, C = torch.randn(shape, dtype=dt, generator=gen), torch.randn(shape, dtype=dt, generator=gen)
    x = torch.randn(Bsz, T, H, P, dtype=dt, generator=gen)
    M = ssd_map(step, A, B, C)
    assert M.shape == (Bsz, H, T, T)
    y = ssd(x, step, A, B, C, mode="recurrent")[0]
    torch.testing.assert_close((M @ x.transpose(1, 2)).transpose(1, 2), y, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"C must have shape \[B, T, N\] = \[2, 7, 3\]"):
        ssd_map(step, A, B, torch.randn(Bsz, T, N + 1, dtype=dt))
