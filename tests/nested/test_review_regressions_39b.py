"""Regression review 39b (of fbfd164, the Nested Learning review-4 fixes): each test failed before its fix."""

import pytest
import torch

from mnemo.layers.cms import ContinuumMemory, Level


@pytest.mark.parametrize(
    "levels, T",
    [
        ([Level(2), Level(4)], 9),  # the slow level steps twice in the call
        ([Level(1), Level(2), Level(4)], 7),  # the middle level steps twice before the slowest does
    ],
)
def test_the_unrolled_meta_step_compiles_when_a_level_steps_again_within_the_call(levels, T):
    # before: fbfd164's test compiled one slow step (T = 5, periods 2/4) only. When phi is a
    # compiled graph's output (the level stepped earlier in the call), the unrolled rule took the
    # gradient at phi itself, and autograd also ran a compiled graph between the loss and phi (it
    # had read phi's level), with create_graph: "a leaf Variable that requires grad is being used
    # in an in-place operation" from the forward (meta="unrolled" is the default rule)
    torch.manual_seed(0)
    m = ContinuumMemory(4, levels, transfer="nested", meta="unrolled")
    x = torch.randn(2, T, 4)

    def grads(module):
        m.zero_grad()
        y, st = module(x)
        (y.square().sum() + st.levels[-1].weights[1].sum()).backward()
        return y.detach(), [p.grad.clone() for p in m.parameters()]

    y0, g0 = grads(m)
    torch._dynamo.reset()
    y1, g1 = grads(torch.compile(m, backend="aot_eager"))
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-6)
    assert len(g1) == len(g0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
