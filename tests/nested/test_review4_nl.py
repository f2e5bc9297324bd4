"""Review 4 of the Nested Learning / HOPE area: each test failed before its fix."""

import copy

import pytest
import torch
from torch import nn

from mnemo.layers.cms import ContinuumMemory, Level


class _Shifted(nn.Module):
    """A CMS's input norm followed by a fixed shift: the input a ``hook_in`` replacement gives."""

    def __init__(self, norm: nn.Module, shift: torch.Tensor):
        super().__init__()
        self.norm, self.shift = norm, shift

    def forward(self, x):
        return self.norm(x) + self.shift


@pytest.mark.parametrize("meta", ["unrolled", "first_order"])
def test_a_replacement_at_the_fastest_levels_hook_in_reaches_the_slow_meta_gradient(meta):
    # before: the slower level replayed the fastest level on the un-hooked input, so its
    # meta-gradient (and, after the restart, the fastest level's weights) ignored the intervention
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(2), Level(4)], transfer="nested", meta=meta).double()
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    shift = 0.3 * torch.randn(4, dtype=torch.float64)
    handle = m.levels[0].hook_in.register_forward_hook(lambda mod, args, out: out + shift)
    try:
        y, st = m(x)
    finally:
        handle.remove()
    # the hand re-run: the same module whose input is the hooked one from the start
    ref = copy.deepcopy(m)
    ref.norms[0] = _Shifted(ref.norms[0], shift)
    y_ref, st_ref = ref(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    for i in range(2):
        for w, w_ref in zip(st.levels[i].weights, st_ref.levels[i].weights):
            torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(st.levels[1].inputs, st_ref.levels[1].inputs, rtol=0, atol=0)
    # and the slow level did step away from what the un-hooked stream gives
    _, st_plain = m(x)
    assert (st_plain.levels[1].weights[0] - st.levels[1].weights[0]).abs().max() > 1e-4


@pytest.mark.parametrize("meta", ["unrolled", "first_order"])
@pytest.mark.parametrize("point", ["hook_v", "hook_eta"])
def test_a_replacement_at_the_fastest_levels_target_or_rate_reaches_the_slow_meta_gradients(meta, point):
    # (hook_eta with first_order held before too: that rule does not replay the fastest level)
    # before: the replay recomputed the fastest level's targets W_v x_t and rates η_t, so an
    # intervention there changed the fastest level's steps but not the slower levels' meta-gradients
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(1), Level(2), Level(4)], transfer="nested", meta=meta).double()
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    shift = 0.3 * torch.randn(4, dtype=torch.float64)
    edit = (lambda v: v + shift) if point == "hook_v" else (lambda eta: 0.5 * eta)
    handle = getattr(m.levels[0], point).register_forward_hook(lambda mod, args, out: edit(out))
    try:
        y, st = m(x)
    finally:
        handle.remove()
    # the hand re-run: the fastest level's target (rate) function itself edited, which the replay reads
    ref = copy.deepcopy(m)
    fast = ref.levels[0]
    if point == "hook_v":
        fast.value = nn.Sequential(fast.value, _Shift(shift))
    else:
        rates = fast.rates
        fast.rates = lambda x: edit(rates(x))
    y_ref, st_ref = ref(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    for i in range(3):
        for w, w_ref in zip(st.levels[i].weights, st_ref.levels[i].weights):
            torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-12)
    _, st_plain = m(x)
    assert (st_plain.levels[2].weights[0] - st.levels[2].weights[0]).abs().max() > 1e-6


class _Shift(nn.Module):
    def __init__(self, shift: torch.Tensor):
        super().__init__()
        self.shift = shift

    def forward(self, x):
        return x + self.shift


@pytest.mark.parametrize("meta", ["unrolled", "first_order"])
def test_a_meta_learned_nested_cms_trains_under_torch_compile_as_eagerly(meta):
    # before: the outer backward raised "torch.compile with aot_autograd does not currently support
    # double backward" (the meta-gradient is taken with create_graph inside the compiled graph)
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(2), Level(4)], transfer="nested", meta=meta)
    x = torch.randn(1, 5, 4)

    def grads(module):
        m.zero_grad()
        y, st = module(x)
        (y.square().sum() + st.levels[1].weights[1].sum()).backward()
        return y.detach(), [p.grad.clone() for p in m.parameters()]

    y0, g0 = grads(m)
    torch._dynamo.reset()
    y1, g1 = grads(torch.compile(m, backend="aot_eager"))
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-6)
    assert len(g1) == len(g0) and all(g.abs().sum() > 0 for g in g0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_state_without_the_period_inputs_is_refused_by_a_meta_learned_nested_cms():
    # (the kept reads: x_t, W_v x_t and η_t of the fastest level, 2·4 + 1 numbers a token)
    # before: a meta='none' state (no kept inputs) was accepted, and the slow level's first meta
    # step replayed the fast level on 1 token of its 4-token period, silently
    torch.manual_seed(0)
    levels = [Level(2), Level(4)]
    meta = ContinuumMemory(4, levels, transfer="nested", meta="unrolled")
    plain = ContinuumMemory(4, levels, transfer="nested", meta="none")
    x = torch.randn(1, 6, 4)
    _, st_plain = plain(x[:, :3])
    with pytest.raises(ValueError, match=r"^state\.levels\[1\]\.inputs: expected .*\[1, 3, 9\].*got None"):
        meta(x[:, 3:], st_plain)
    _, st_meta = meta(x[:, :3])
    with pytest.raises(
        ValueError, match=r"^state\.levels\[1\]\.inputs: expected None.*got a tensor \[1, 3, 9\]"
    ):
        plain(x[:, 3:], st_meta)
    # the module's own state still continues, as one pass
    y, _ = meta(x[:, 3:], st_meta)
    torch.testing.assert_close(y, meta(x)[0][:, 3:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("adapted", [lambda p: (2 * p[0],), lambda p: (2 * p[0], torch.zeros(4))])
def test_first_order_meta_gradient_refuses_an_adaptation_of_another_structure(adapted):
    # before: a missing adapted tensor gave its phi tensor a zero gradient, silently; a shape phi
    # does not broadcast to raised torch's expand error, naming neither adapt nor the shapes
    from mnemo.layers.cms import meta_gradient

    phi = (torch.randn(2, 3), torch.randn(3))
    loss = lambda theta: sum(t.square().sum() for t in theta)  # noqa: E731
    with pytest.raises(ValueError, match=r"^adapt: expected a tuple of 2 tensors.*\[\[2, 3\], \[3\]\]"):
        meta_gradient(phi, adapted, loss, "first_order")
    # an adapted tensor broadcast from its phi tensor (one copy per task) still sums its copies
    (g,) = meta_gradient(phi[:1], lambda p: (p[0].expand(5, 2, 3) * 1,), loss, "first_order")
    torch.testing.assert_close(g, 10 * phi[0], rtol=0, atol=1e-6)
