"""Review 7 (memory area): Titans / Miras / TTT memories.

The TTT tests compare the engine with a hand loop written from the TTT authors' code
(``ttt-lm-pytorch`` / ``ttt-lm-jax``: ``ln_fused_l2_bwd``, ``get_eta``, the dual form of
``TTTLinear.ttt``), not from this library's engine: per mini-batch, with ``W₀`` its start weights,

    Z_s = k_s W₀,  ∂ℓ/∂Z_s = LN'(Z_s)ᵀ (LN(Z_s) − (v_s − k_s))    (γ = 1, β = 0: the gradient of ½‖e‖²)
    η_s = η_base · σ_s / D,  τ_t = 1/t (+ a learned offset, 0 here)
    W_t = W₀ − τ_t Σ_{s ≤ t} η_s k_s ⊗ ∂ℓ/∂Z_s,   o_t = q_t + LN(q_t W_t),  next W₀ = W_b
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mnemo.layers import NeuralMemory
from mnemo.memory import init_state, neural_memory, preset


def _ttt_linear_authors(q, k, v, eta, W0, b, tau_by_token=True):
    """The TTT authors' TTT-Linear update (no bias, parameter-free inner LN with eps 1e-5 as here),
    one head, float64: ``q, k, v [T, D]``, ``eta [T]`` (their ``η_base σ / D``), ``W0 [D, D]``."""
    T, D = k.shape
    W, outs = W0.clone(), []
    for c0 in range(0, T, b):
        sl = slice(c0, min(T, c0 + b))
        ks, vs, qs, es = k[sl], v[sl], q[sl], eta[sl]
        grads = []
        for x, y in zip(ks, vs):
            z = x @ W
            # their ln_fused_l2_bwd: grad_output = LN(z) − target (the ½‖e‖² gradient)
            e = F.layer_norm(z, (D,), eps=1e-5) - (y - x)
            gz = torch.autograd.functional.vjp(lambda zz: F.layer_norm(zz, (D,), eps=1e-5), z.detach(), e)[1]
            grads.append(torch.outer(x, gz))
        acc = torch.zeros_like(W)
        for i, (qq, G, et) in enumerate(zip(qs, grads, es)):
            acc = acc + et * G
            tau = 1.0 / (i + 1) if tau_by_token else 1.0
            Wt = W - tau * acc
            outs.append(qq + F.layer_norm(qq @ Wt, (D,), eps=1e-5))
        W = Wt
    return torch.stack(outs), W


def _inputs(T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (F.normalize(torch.randn(T, D, generator=g, dtype=torch.float64), dim=-1) for _ in range(3))
    eta = 0.5 * torch.rand(T, generator=g, dtype=torch.float64)
    W0 = 0.02 * torch.randn(D, D, generator=g, dtype=torch.float64) + torch.eye(D, dtype=torch.float64)
    return q, k, v, eta, W0


def _engine(q, k, v, theta, W0, chunk):
    spec = preset("ttt_linear", chunk_size=chunk)
    st = init_state(spec, [W0[None]], 1)
    o, st = neural_memory(
        spec,
        q[None, :, None],
        k[None, :, None],
        v[None, :, None],
        theta[None, :, None],
        initial_state=st,
        output_final_state=True,
        mode="recurrent",
    )
    return o[0, :, 0], st.weights[0][0, 0]


def test_ttt_linear_online_step_equals_the_authors_code_with_the_same_learning_rate():
    """Their code steps with ``LN(Z) − target`` (the gradient of ½‖e‖², not of the paper's ‖e‖²):
    with a mini-batch of one token the same ``θ = η_base σ / D`` gives the same weights. The
    docstring said their ``θ`` is half the one here."""
    q, k, v, eta, W0 = _inputs(7, 4)
    want_o, want_W = _ttt_linear_authors(q, k, v, eta, W0, b=1)
    got_o, got_W = _engine(q, k, v, eta, W0, chunk=1)
    torch.testing.assert_close(got_o, want_o, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_W, want_W, rtol=1e-10, atol=1e-12)


def test_ttt_linear_mini_batch_is_the_authors_sum_without_their_one_over_i():
    """Inside a mini-batch of ``b`` the engine sums the steps (``τ_t = 1``); the authors' code
    scales token ``t``'s accumulated step by ``1/t``, so its end-of-mini-batch weights are the
    engine's with ``θ/b`` (the mean gradient), its reads inside the mini-batch differ."""
    b = 4
    q, k, v, eta, W0 = _inputs(8, 4, seed=1)
    want_o, _ = _ttt_linear_authors(q, k, v, eta, W0, b=b, tau_by_token=False)
    got_o, _ = _engine(q, k, v, eta, W0, chunk=b)
    torch.testing.assert_close(got_o, want_o, rtol=1e-10, atol=1e-12)
    # one mini-batch: the authors' W_b is the engine's with θ / b
    _, want_W = _ttt_linear_authors(q[:b], k[:b], v[:b], eta[:b], W0, b=b)
    _, got_W = _engine(q[:b], k[:b], v[:b], eta[:b] / b, W0, chunk=b)
    torch.testing.assert_close(got_W, want_W, rtol=1e-10, atol=1e-12)
    taus, _ = _ttt_linear_authors(q[:b], k[:b], v[:b], eta[:b], W0, b=b)
    assert (taus[1:] - _engine(q[:b], k[:b], v[:b], eta[:b], W0, chunk=b)[0][1:]).abs().max() > 1e-6


def test_the_ttt_docstring_states_the_learning_rate_relation_of_the_authors_code():
    doc = " ".join(NeuralMemory.__doc__.split())
    assert "half the one here" not in doc  # false for their code (the tests above)
    assert "1/t" in doc and "head size" in doc and "mean" in doc
