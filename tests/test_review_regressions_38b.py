"""Regression review of 70c4d12 (ops) and 0d4b474 (layers): what the fixes broke.

1. 0d4b474 decided whether a hook replaced ``hook_k`` (attention with sinks, whose cache keeps the
   keys before rotary) by identity: any hook attached (``hooked``, backward hooks included) and
   the value given back not the very tensor. A backward hook makes ``nn.Module`` hand back an
   alias of the value (``BackwardHookFunction``'s view, same memory, same numbers), so with only a
   backward hook attached — or a read-only forward hook and a backward hook, as gradient caching
   does — the key was rotated and rotated back again: in bf16 the cache's keys moved by 4e-3 and
   the decoded outputs by 8e-3. Before the commit (``hook_k.active``: forward hooks only) a
   backward hook changed nothing.
2. 70c4d12 sent ``blockwise_attention``'s scale through the ring's check, which refuses a tensor
   scale that needs a gradient ("the ring takes a number (its backward gives no gradient …)").
   ``blockwise_attention`` has no custom backward (autograd runs through it, as its docstring says),
   so a learned scale now raised where it can get its gradient, as in ``softmax_attention``.
3. 0d4b474's ``GatedLinearAttention._apply`` recomputed RetNet's ``log_gamma`` from the formula on
   every cast to half precision too, where it had kept the buffer's values in float32 (as
   ``RotaryEmbedding`` keeps its frequencies): decays set on the buffer were silently reset by
   ``model.to(torch.bfloat16)``.
"""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.attention import Attention


def _decode(m, x):
    outs, state = [], None
    for t in range(x.shape[1]):
        y, state = m(x[:, t : t + 1], state)
        outs.append(y)
    return torch.cat(outs, 1), state


def test_a_backward_hook_on_hook_k_leaves_sink_decoding_unchanged():
    torch.manual_seed(0)
    m = Attention(32, n_heads=2, window=3, n_sink=1).to(torch.bfloat16)
    x = 3 * torch.randn(1, 12, 32, dtype=torch.bfloat16)
    y0, s0 = _decode(m, x)
    grads = []
    handles = [m.hook_k.register_full_backward_hook(lambda mod, gi, go: grads.append(go[0]))]
    y1, s1 = _decode(m, x)
    assert torch.equal(y1, y0) and torch.equal(s1.kv.k, s0.kv.k)
    # a forward hook that only reads, with the backward hook (what caching gradients attaches)
    seen = []
    handles.append(m.hook_k.register_forward_hook(lambda mod, args, out: seen.append(out)))
    y2, s2 = _decode(m, x)
    assert len(seen) == 12
    assert torch.equal(y2, y0) and torch.equal(s2.kv.k, s0.kv.k)
    y2.float().square().sum().backward()
    assert len(grads) == 12  # the backward hook still fires, once per call
    for h in handles:
        h.remove()


def test_a_key_replaced_or_detached_under_a_backward_hook_is_still_a_replacement():
    """What the alias rule must not swallow: a hook returning a new key (with a backward hook on the
    point) is kept, rotated back; a detached alias (same numbers, no graph) counts as replaced."""
    torch.manual_seed(0)
    m = Attention(16, n_heads=2, window=3, n_sink=1).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    _, plain = m(x)
    bw = m.hook_k.register_full_backward_hook(lambda mod, gi, go: None)
    fw = m.hook_k.register_forward_hook(lambda mod, args, out: 2 * out)
    _, doubled = m(x)
    fw.remove()
    torch.testing.assert_close(doubled.kv.k, 2 * plain.kv.k, rtol=1e-12, atol=1e-12)
    fw = m.hook_k.register_forward_hook(lambda mod, args, out: out.detach())
    _, detached = m(x)
    fw.remove()
    bw.remove()
    torch.testing.assert_close(detached.kv.k, plain.kv.k, rtol=1e-12, atol=1e-12)
    assert not detached.kv.k.requires_grad  # the cache holds the detached key, rotated back


def test_blockwise_attention_takes_a_learned_scale_and_gives_it_its_gradient():
    from mnemo.ops import softmax_attention
    from mnemo.ops.ring_attention import ThreadRing, blockwise_attention, ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    grads = {}
    for name, fn in (
        ("softmax", lambda s: softmax_attention(q, k, v, scale=s)[0]),
        ("blockwise", lambda s: blockwise_attention(q, k, v, 3, scale=s)),
    ):
        s = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
        o = fn(s)
        (grads[name],) = torch.autograd.grad((o * o).sum(), s)
        torch.testing.assert_close(o, softmax_attention(q, k, v, scale=0.4)[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads["blockwise"], grads["softmax"], rtol=1e-10, atol=1e-12)
    assert grads["softmax"].abs() > 1e-3
    # the ring (custom backward, no gradient for the scale) still refuses it
    with pytest.raises(TypeError, match="scale"):
        ring_attention(q, k, v, ring=ThreadRing.make(1)[0], scale=torch.tensor(0.4, requires_grad=True))


def test_retnet_log_decays_set_on_the_buffer_survive_a_cast_to_half_precision():
    from mnemo.layers.linear_attention import GatedLinearAttention, retnet_log_gamma

    m = GatedLinearAttention(16, n_heads=4, gate="retnet")
    with torch.no_grad():
        m.log_gamma[0] = -1.0  # a custom decay for head 0
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half()):
        lg = cast(m).log_gamma
        assert lg.dtype == torch.float32 and lg[0] == -1.0
        assert torch.equal(lg[1:], retnet_log_gamma(4)[1:].float())
    # float32 <-> float64 still computes log γ in the new dtype (0d4b474's fix)
    d = GatedLinearAttention(16, n_heads=4, gate="retnet").double()
    assert torch.equal(d.log_gamma, retnet_log_gamma(4))
    assert torch.equal(d.half().log_gamma, retnet_log_gamma(4).float())
    assert torch.equal(d.double().log_gamma, retnet_log_gamma(4))
