"""Delta rule / gated delta rule beyond the generic contract: the defining equation, gates,
extremes, dtypes, errors. (The equivalence contract itself runs from ``specs.SPECS``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.ops import delta_rule, gated_delta_rule
from tests.helpers import assert_close

MODES = ["recurrent", "chunk", "parallel"]


def _inputs(B=1, T=40, H=2, K=8, V=4, dtype=torch.float64, seed=0):
    """L2-normalised keys, ``beta = sigmoid(randn)``, ``g = logsigmoid(randn + 1)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    beta = torch.randn(B, T, H, generator=gen, dtype=dtype).sigmoid()
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) + 1.0)
    return q, k, v, g, beta, gen


def _literal_reference(q, k, v, g, beta, S0, scale):
    """The equation as written, with explicit ``K × K`` transition matrices (float64)."""
    K = q.shape[-1]
    eye = torch.eye(K, dtype=q.dtype)
    S, outs = S0, []
    for t in range(q.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        transition = g[:, t].exp()[..., None, None] * (eye - bt * kt[..., :, None] * kt[..., None, :])
        S = transition @ S + bt * kt[..., :, None] * v[:, t, :, None, :]
        outs.append((S.transpose(-1, -2) @ (scale * q[:, t])[..., None])[..., 0])
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("mode", MODES)
def test_matches_the_defining_equation(mode):
    q, k, v, g, beta, gen = _inputs(T=37)
    S0 = torch.randn(1, 2, 8, 4, generator=gen, dtype=q.dtype)
    o_ref, s_ref = _literal_reference(q, k, v, g, beta, S0, 0.3)
    o, s = gated_delta_rule(
        q, k, v, g, beta, scale=0.3, initial_state=S0, output_final_state=True, mode=mode, chunk_size=16
    )
    assert_close(o, o_ref, 1e-12, what="output")
    assert_close(s, s_ref, 1e-12, what="state")


@pytest.mark.parametrize("mode", MODES)
def test_full_write_then_read_returns_the_value(mode):
    """With ``β = 1`` and unit keys, reading with ``q_t = k_t`` right after the write returns
    ``v_t`` exactly, whatever the decay and the earlier contents (the delta rule overwrites)."""
    q, k, v, g, beta, gen = _inputs(T=30)
    S0 = torch.randn(1, 2, 8, 4, generator=gen, dtype=q.dtype)
    o, _ = gated_delta_rule(
        k, k, v, g, torch.ones_like(beta), scale=1.0, initial_state=S0, mode=mode, chunk_size=8
    )
    assert_close(o, v, 1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_zero_gate_is_delta_rule(mode):
    q, k, v, g, beta, gen = _inputs()
    S0 = torch.randn(1, 2, 8, 4, generator=gen, dtype=q.dtype)
    o1, s1 = gated_delta_rule(
        q,
        k,
        v,
        torch.zeros_like(g),
        beta,
        initial_state=S0,
        output_final_state=True,
        mode=mode,
        chunk_size=16,
    )
    o2, s2 = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, mode=mode, chunk_size=16)
    assert_close(o1, o2, 1e-12)
    assert_close(s1, s2, 1e-12)
    # and the gate matters: a non-zero gate gives a different result
    o3, _ = gated_delta_rule(q, k, v, g, beta, initial_state=S0, mode=mode, chunk_size=16)
    assert (o3 - o2).abs().max() > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_result_does_not_depend_on_chunk_size(mode):
    q, k, v, g, beta, _ = _inputs(T=45)
    ref, s_ref = gated_delta_rule(q, k, v, g, beta, mode="recurrent", output_final_state=True)
    for C in (1, 7, 16, 45, 64):
        o, s = gated_delta_rule(q, k, v, g, beta, mode=mode, chunk_size=C, output_final_state=True)
        assert_close(o, ref, 1e-12, what=f"C={C}")
        assert_close(s, s_ref, 1e-12, what=f"C={C}")


@pytest.mark.parametrize("mode", MODES)
def test_minus_inf_gate_is_a_hard_reset(mode):
    """A gate of -inf at position a (not on a chunk boundary): the output from a on equals running
    x[a:] alone, with no NaN in the outputs or in any gradient."""
    q, k, v, g, beta, gen = _inputs(T=50)
    a = 21
    g[:, a] = float("-inf")
    S0 = torch.randn(1, 2, 8, 4, generator=gen, dtype=q.dtype)
    args = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, S0)]
    o, s = gated_delta_rule(
        *args[:5], initial_state=args[5], mode=mode, output_final_state=True, chunk_size=16
    )
    (o[:, a:].square().sum() + s.square().sum()).backward()  # only what comes after the reset
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    for t in args:
        assert torch.isfinite(t.grad).all()
    g2 = g[:, a:].clone()
    g2[:, 0] = 0.0
    o2, s2 = gated_delta_rule(
        q[:, a:], k[:, a:], v[:, a:], g2, beta[:, a:], mode=mode, output_final_state=True, chunk_size=16
    )
    assert_close(o[:, a:].detach(), o2, 1e-10)
    assert_close(s.detach(), s2, 1e-10)
    assert args[5].grad.abs().max() < 1e-20  # the initial state does not reach past the reset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_decays_stay_finite(dtype):
    """Log gates down to -200 per token over chunks of 128 (cumulative gates far below the float32
    range): finite outputs and gradients, and the chunk form still matches the float64 reference."""
    q, k, v, g, beta, gen = _inputs(T=300, K=16, V=16, dtype=torch.float32)
    g = -200 * torch.rand(1, 300, 2, generator=gen)
    g[:, ::7] = -1e-3  # mix with near-zero decays
    args = [t.to(dtype).requires_grad_(True) for t in (q, k, v, g, beta)]
    o, s = gated_delta_rule(*args, chunk_size=128, output_final_state=True)
    (o.float().square().sum() + s.square().sum()).backward()
    assert o.dtype == dtype and s.dtype == torch.float32
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()
    for t in args:
        assert torch.isfinite(t.grad.float()).all()
    # reference: float64 recurrence on the same (rounded) inputs
    ref, s_ref = gated_delta_rule(
        *(t.detach().double() for t in args), mode="recurrent", output_final_state=True
    )
    # float32: cumulative log gates reach -60 * 128 inside a chunk, where fp32 keeps ~1e-5 of relative
    # precision in their differences (measured 1.2e-5); bf16: rounding the output (measured 1.7e-3)
    assert_close(o.float(), ref, 5e-3 if dtype == torch.bfloat16 else 1e-4, what="output")
    assert_close(s, s_ref, 2e-5, what="state")  # float32 state: documented 2e-5 (measured 3.4e-8)


def test_bf16_inputs_accumulate_in_fp32():
    q, k, v, g, beta, _ = _inputs(T=128, K=16, V=16, dtype=torch.float32)
    x = [t.bfloat16() for t in (q, k, v, g, beta)]
    o, s = gated_delta_rule(*x, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ref, s_ref = gated_delta_rule(*(t.double() for t in x), mode="recurrent", output_final_state=True)
    assert_close(o.float(), ref, 1e-2)
    assert_close(s, s_ref, 2e-5)  # the state is never rounded to bf16: float32's 2e-5 (measured 6.1e-8)


def test_float64_if_any_input_is_float64():
    q, k, v, g, beta, _ = _inputs(T=20, dtype=torch.float32)
    o, s = gated_delta_rule(q, k, v, g.double(), beta, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float64


@pytest.mark.parametrize("mode", MODES)
def test_empty_sequence_passes_state_delta_rule(mode):
    q, k, v, _, beta, gen = _inputs(T=0)
    S0 = torch.randn(1, 2, 8, 4, generator=gen, dtype=q.dtype)
    o, s = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, mode=mode)
    assert o.shape == (1, 0, 2, 4)
    assert torch.equal(s, S0)


def test_bad_inputs_name_argument_and_shapes():
    q, k, v, g, beta, _ = _inputs()
    BTH = r"\[B, T, H\] = \[1, 40, 2\]"
    with pytest.raises(ValueError, match=rf"beta must have shape {BTH}, got \[1, 40, 3\]"):
        delta_rule(q, k, v, beta.new_zeros(1, 40, 3))
    with pytest.raises(ValueError, match=rf"beta must have shape {BTH}, got \[1, 40, 2, 1\]"):
        gated_delta_rule(q, k, v, g, beta[..., None])
    BTHK = BTH + r" or \[B, T, H, K\] = \[1, 40, 2, 8\]"  # (per-channel g: KDA)
    with pytest.raises(ValueError, match=rf"g must have shape {BTHK}, got \[1, 40, 2, 5\]"):
        gated_delta_rule(q, k, v, g[..., None].expand(-1, -1, -1, 5), beta)
    with pytest.raises(ValueError, match=rf"g must have shape {BTHK}, got \[1, 39, 2\]"):
        gated_delta_rule(q, k, v, g[:, 1:], beta)
    with pytest.raises(TypeError, match="g must be a torch.Tensor"):
        gated_delta_rule(q, k, v, None, beta)
    with pytest.raises(TypeError, match="beta must be a floating-point tensor"):
        delta_rule(q, k, v, beta.long())
    with pytest.raises(
        ValueError, match=r"k must have shape \[B, T, H, K\] = \[1, 40, 2, 8\], got \[1, 40, 2, 7\]"
    ):
        delta_rule(q, k[..., :7], v, beta)
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H, V\]"):
        gated_delta_rule(q, k, v[:, :3], g, beta)
    with pytest.raises(ValueError, match="mode must be one of"):
        delta_rule(q, k, v, beta, mode="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, K, V\] = \[1, 2, 8, 4\]"):
        gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 40"):
        delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0, 10, 30]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\]"):
        delta_rule(q, k, v, beta, cu_seqlens=torch.tensor([0, 10, 40]), initial_state=torch.zeros(1, 2, 8, 4))
