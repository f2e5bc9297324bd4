"""Review 47f: defects found while reviewing 0b787d2 (einops calls as graph nodes), c4c34d5 and dd4ab15.

Each test failed on the code as reviewed; all three are fixed (the GLA model under ``dynamic=True``
by helper 48c: its strict xfail is a plain test now). None of the three is a regression of the reviewed
commits: each failed the same way at c4c34d5 (before the einops marks); no test had compiled one
model over two lengths or run ``torch.func`` through the short convolution.
"""

from __future__ import annotations

import pytest
import torch

from mnemo.models import LanguageModel, build_config

pytestmark = pytest.mark.filterwarnings("ignore")


def _gla():
    torch.manual_seed(0)
    return LanguageModel(build_config("gla", vocab_size=32, d_model=16, n_layers=1))


def test_compiled_gla_trains_at_a_second_length():
    """``torch.compile(model)`` with default settings: a batch of another length (a shorter last
    batch, a second seq_len) recompiles with a symbolic length; forward and backward must run and
    equal eager. Measured: the backward fails when the symbolic length is not a multiple of the
    chunk size (64 then 128 passed; 12 then 20, or 64 then 100, failed: the compiled backward's
    ``aten.view`` of the ``constant_pad_nd`` that undoes ``F.pad``'s padding of the chunks, in
    ``gla_chunk_autograd``; the padding is a concatenation of zeros now, whose backward is a slice);
    gated_deltanet and the transformer passed the same check."""
    model = _gla()
    compiled = torch.compile(model, backend="aot_eager")
    for T in (12, 20):
        ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
        model.zero_grad(set_to_none=True)
        compiled(ids)[0].square().mean().backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model(ids)[0].square().mean().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_decay_exp_twice_in_one_dynamic_graph():
    """The defect behind the GLA model's failure under ``dynamic=True``, at the size of one op: two
    ``decay_exp`` calls in one graph compiled with ``dynamic=True`` failed in dynamo
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer") before their
    float bounds became graph constants; forward and gradient equal eager's at two lengths, in
    float64 (3 s; the whole GLA model's test below takes ~30 s and runs with ``-m slow``)."""
    from mnemo.ops._common import decay_exp

    def f(x):
        return decay_exp(x.cumsum(1)) @ decay_exp(-x.transpose(1, 2).abs())

    compiled = torch.compile(f, backend="aot_eager", dynamic=True)
    try:
        for T in (12, 20):
            x = torch.randn(2, T, T, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
            x.requires_grad_(True)
            got = compiled(x)
            got.sum().backward()
            grad, x.grad = x.grad, None
            want = f(x)
            want.sum().backward()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-14)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_gla_with_dynamic_shapes():
    """``torch.compile(model, dynamic=True)`` (one graph for every length) traces the GLA forward and
    backward, and both equal eager at two lengths (12, then 20: neither a multiple of the chunk),
    in float64. Review 47f: dynamo failed ("lift_tracked_freevar_to_input should not be called on
    root SubgraphTracer", tracing ``_DecayExp.apply``): the module's float bounds read inside the
    Function's forward became symbolic inputs of the subgraph of its first call, which the second
    call's subgraph reused; they are graph constants now (``mnemo.ops._common._decay_exp_bounds``).
    And one graph: ``check_eps``'s ``math.isfinite`` on the norm's (symbolic) eps broke the graph
    in every block (13 frames, 9 graphs, 36 s to compile; now 1 frame, 24 s)."""
    from torch._dynamo.utils import counters

    model = _gla().double()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    counters.clear()
    try:
        for T in (12, 20):
            ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(T))
            model.zero_grad(set_to_none=True)
            got = compiled(ids)[0]
            got.square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            want = model(ids)[0]
            want.square().mean().backward()
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
            assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
            for n, p in model.named_parameters():
                if p.grad is not None:
                    torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert dict(counters["frames"]) == {"total": 1, "ok": 1}, dict(counters["frames"])
    finally:
        torch._dynamo.reset()


def test_short_convolution_under_torch_func():
    """:class:`~mnemo.layers.conv.ShortConvolution` under the ``torch.func`` transforms and forward-mode
    AD (review 47f: its autograd Function has no jvp or vmap rule, so gated_deltanet and mamba2 raised
    at ``_CausalConv.apply``; now the same sum runs as recorded operations there): ``jvp`` equals a
    central difference, ``vmap`` equals a loop, ``torch.func.grad`` equals the Function's hand-written
    backward, and a ``forward_ad`` dual's tangent equals ``jvp``'s (float64)."""
    import torch.autograd.forward_ad as fwAD

    from mnemo.layers.conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(8, 4).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    t = torch.randn_like(x)

    def f(x):
        return conv(x)[0]

    _, tangent = torch.func.jvp(f, (x,), (t,))
    eps = 1e-6
    torch.testing.assert_close(tangent, (f(x + eps * t) - f(x - eps * t)) / (2 * eps), rtol=1e-6, atol=1e-8)
    xs = torch.randn(3, 2, 6, 8, dtype=torch.float64)
    # (the loop runs the Function, whose C kernel sums the taps in another order: rounding apart)
    torch.testing.assert_close(
        torch.func.vmap(f)(xs), torch.stack([f(xi) for xi in xs]), rtol=1e-12, atol=1e-12
    )
    got = torch.func.grad(lambda x: f(x).square().sum())(x)
    xr = x.clone().requires_grad_()
    f(xr).square().sum().backward()  # (the hand-written backward: no transform sees xr)
    torch.testing.assert_close(got, xr.grad, rtol=1e-12, atol=1e-12)
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(f(fwAD.make_dual(x, t))).tangent
    torch.testing.assert_close(dual, tangent, rtol=1e-12, atol=1e-12)
