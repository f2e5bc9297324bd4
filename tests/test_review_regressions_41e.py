"""Regression review 41e of 0381eaa (the ops under torch.func transforms, float64 cumulative
log-gates, the dispatch log's compiled counts, ``mnemo verify``'s exit 3)."""

import pytest
import torch

import mnemo.ops as ops


def _inputs(seed=0, B=1, T=40, H=2, K=8):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(B, T, H, generator=gen) * 0.3
    beta = torch.rand(B, T, H, generator=gen)
    return q, torch.nn.functional.normalize(k, dim=-1), v, g, beta


def _gla(q, k, v, g, beta, mode):
    return ops.gated_linear_attention(q, k, v, g, mode=mode, chunk_size=16)[0]


def _gdr(q, k, v, g, beta, mode):
    return ops.gated_delta_rule(q, k, v, g, beta, mode=mode, chunk_size=16)[0]


@pytest.mark.parametrize("op", [_gla, _gdr], ids=["gla", "gated_delta_rule"])
@pytest.mark.parametrize("batched", ["q", "g"])
def test_vmap_over_some_inputs_of_a_chunk_form_runs_and_matches_the_loop(op, batched):
    """vmap over one input (the others shared, as a closure holds them) ran the decay factors'
    autograd.Function, which has no batching rule, while a functorch transform was active: the
    check looked at the op's tensors only, and an unbatched log-gate (or a batched one, for the
    delta rule's decay matrix) reached ``_DecayExp`` plain -> RuntimeError."""
    q, k, v, g, beta = _inputs()
    xs = {"q": torch.stack([q, 0.5 * q]), "g": torch.stack([g, 2 * g])}[batched]

    def f(x, mode):
        args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, batched: x}
        return op(**args, mode=mode)

    got = torch.func.vmap(lambda x: f(x, "chunk"))(xs)
    want = torch.stack([f(x, "recurrent") for x in xs])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_of_ssd_over_its_B_runs():
    gen = torch.Generator().manual_seed(1)
    B, T, H, P, N = 1, 40, 2, 4, 4
    x = torch.randn(B, T, H, P, generator=gen)
    dt, A = torch.rand(B, T, H, generator=gen), -torch.rand(H, generator=gen)
    Bm, Cm = (torch.randn(B, T, 1, N, generator=gen) for _ in range(2))
    Bs = torch.stack([Bm, 2 * Bm])

    def f(b, mode):
        return ops.ssd(x, dt, A, b, Cm, mode=mode, chunk_size=16)[0]

    got = torch.func.vmap(lambda b: f(b, "chunk"))(Bs)
    torch.testing.assert_close(got, torch.stack([f(b, "recurrent") for b in Bs]), rtol=1e-5, atol=1e-5)
