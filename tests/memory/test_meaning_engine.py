"""The test-time-trained memory against a hand loop of its documented semantics, for a matrix
memory with the l2 objective and per-channel decay (the Gated-DeltaNet order with ``decay_first``,
Titans' order without), inner mini-batches of 1 and 3 tokens, and a hard reset (``g = −inf``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.memory import MemorySpec, init_state, neural_memory
from tests.helpers import assert_close

B, T, H, K, V = 2, 7, 2, 3, 4


def _hand_loop(q, k, v, theta, g, S0, chunk, decay_first):
    """at a chunk start: anchor ← A; per token: G = k (Wᵀk − v)ᵀ at W = ρ ⊙ anchor (ρ: decay since
    the anchor, token t's included, if decay_first, else 1); A ← exp(g) ⊙ A − θ G; o = Aᵀ q."""
    A = S0.clone()
    outs = []
    for t in range(q.shape[1]):
        if t % chunk == 0:
            anchor, cum = A.clone(), torch.zeros_like(g[:, 0])
        cum = cum + g[:, t]
        W = torch.exp(cum)[..., None] * anchor if decay_first else anchor
        kt, vt = k[:, t], v[:, t]
        err = torch.einsum("bhkv,bhk->bhv", W, kt) - vt
        G = kt[..., :, None] * err[..., None, :]
        A = torch.exp(g[:, t])[..., None] * A - theta[:, t, :, None, None] * G
        outs.append(torch.einsum("bhkv,bhk->bhv", A, q[:, t]))
    return torch.stack(outs, 1), A


@pytest.mark.parametrize("decay_first", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_per_channel_decay_memory_matches_the_hand_loop(decay_first, chunk, mode):
    g_ = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=g_, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=g_, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_, dtype=torch.float64)
    theta = torch.rand(B, T, H, generator=g_, dtype=torch.float64) * 0.5 + 0.2
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=g_, dtype=torch.float64) + 1)
    g[:, 4, 0] = -float("inf")  # a hard reset of head 0's memory at token 4
    S0 = torch.randn(B, H, K, V, generator=g_, dtype=torch.float64)
    spec = MemorySpec(retention="decay", decay_per_channel=True, decay_first=decay_first, chunk_size=chunk)
    o, st = neural_memory(
        spec, q, k, v, theta, g=g, initial_state=init_state(spec, [S0]), output_final_state=True, mode=mode,
        use_closed_form=False,
    )  # fmt: skip
    o_ref, A_ref = _hand_loop(q, k, v, theta, g, S0, chunk, decay_first)
    assert torch.isfinite(o).all()
    assert_close(o, o_ref, 1e-10)
    assert_close(st.weights[0], A_ref, 1e-10)


def test_moneta_defaults_p_3_and_q_4():
    """The ℓp / ℓq defaults are Moneta's (its preset: p = 3, q = 4)."""
    from mnemo.memory import preset

    spec, moneta = MemorySpec(), preset("moneta")
    assert (spec.p, spec.q) == (moneta.p, moneta.q) == (3.0, 4.0)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_token_huber_at_exactly_the_threshold_takes_the_l2_step(mode):
    """Miras Eq. 16: ℓ = ½‖e‖² when ‖e‖₂ ≤ δ. From zero weights e = −v; with v = (3/8, 1/2, 0) and
    δ = 5/8 (all exact in binary) ‖e‖ = δ exactly, so the step is θ k vᵀ, not θ k (δ sign(v))ᵀ."""
    spec = MemorySpec(objective="huber", huber_mode="token", chunk_size=1)
    q = k = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64).reshape(1, 1, 1, 3)
    v = torch.tensor([0.375, 0.5, 0.0], dtype=torch.float64).reshape(1, 1, 1, 3)
    theta = torch.full((1, 1, 1), 0.5, dtype=torch.float64)
    delta = torch.full((1, 1, 1), 0.625, dtype=torch.float64)
    zeros = torch.zeros(1, 1, 3, 3, dtype=torch.float64)
    o, st = neural_memory(
        spec, q, k, v, theta, delta=delta, initial_state=init_state(spec, [zeros]), output_final_state=True,
        mode=mode, use_closed_form=False,
    )  # fmt: skip
    assert torch.equal(o[0, 0, 0], 0.5 * v[0, 0, 0])  # o = (θ k vᵀ)ᵀ q = θ v


def test_objective_values_against_hand_computation():
    """ℓ(y, v) per token, summed over the value dim only (``[B, H, L, V] → [B, H, L]``): ℓ₂ is
    ½‖e‖²; the coordinate-wise Huber (Miras Eq. 14) is ½e² for |e| ≤ δ and δ(|e| − δ/2) beyond."""
    from mnemo.memory.objective import objective_value

    v = torch.zeros(1, 2, 3, 2, dtype=torch.float64)
    y = torch.tensor([1.0, 2.0, 3.0, 0.5, -4.0, 0.0, 2.0, 2.0, 0.0, 1.0, -1.0, 3.0], dtype=torch.float64)
    y = y.reshape(1, 2, 3, 2)  # e = y − v = y
    l2 = objective_value(MemorySpec(objective="l2"), y, v, None)
    # ½(1 + 4), ½(9 + ¼), ½(16 + 0) | ½(4 + 4), ½(0 + 1), ½(1 + 9)
    assert torch.equal(l2, torch.tensor([[[2.5, 4.625, 8.0], [4.0, 0.5, 5.0]]], dtype=torch.float64))
    spec = MemorySpec(objective="huber", huber_mode="coordinate")
    delta = torch.ones(1, 2, 3, dtype=torch.float64)
    hub = objective_value(spec, y, v, delta)
    # per coordinate (δ = 1): |e| ≤ 1 → ½e², else |e| − ½: 1 → ½, 2 → 1.5, 3 → 2.5, ½ → ⅛, 4 → 3.5
    want = torch.tensor([[[0.5 + 1.5, 2.5 + 0.125, 3.5 + 0.0], [1.5 + 1.5, 0.0 + 0.5, 0.5 + 2.5]]])
    assert torch.equal(hub, want.double())


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gla_preset_decays_each_key_channel_by_its_own_gate(mode):
    """The ``gla`` preset is GLA (Yang et al. 2023): S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ with one
    data-dependent decay per key channel, o_t = S_tᵀ q_t (θ = 1: the dot objective's step is k vᵀ)."""
    from mnemo.memory import preset

    spec = preset("gla", chunk_size=2)
    g_ = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, K, generator=g_, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=g_, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=g_, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=g_, dtype=torch.float64))
    theta = torch.ones(B, T, H, dtype=torch.float64)
    S = torch.zeros(B, H, K, V, dtype=torch.float64)
    ref = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S + k[:, t, ..., None] * v[:, t, :, None, :]
        ref.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o, _ = neural_memory(spec, q, k, v, theta, g=g, mode=mode, use_closed_form=False)
    assert_close(o, torch.stack(ref, 1), 1e-10)


def test_chunk_size_one_is_the_smallest_inner_batch():
    """``chunk_size`` counts tokens per inner mini-batch: 1 (plain online learning) is valid, 0 and
    negatives are refused with the field named."""
    assert MemorySpec(chunk_size=1).validate().chunk_size == 1
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chunk_size"):
            MemorySpec(chunk_size=bad).validate()
