"""Regression review 40e of 884c575 (Lyapunov q0 / mid-stream state / burn_in, steer's scale) and
5f6b20b (TTT-Linear's W_0 ~ N(0, 0.02²)): what the fixes refused or dropped that used to work."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp.lyapunov import lyapunov_spectrum, memory_jvp_spectrum
from mnemo.memory.recurrent import memory_recurrent
from mnemo.memory.state import MemoryState, init_state
from tests.interp.test_review5_interp import _inputs, _ttt_linear  # noqa: E402 (the same tiny TTT-Linear)


def test_a_state_at_a_chunk_boundary_is_taken_as_its_continuation_not_refused():
    """Chunk boundaries are absolute (``position % C``) and at a boundary the anchor is the weights,
    so a state after whole chunks (a memory after a prefix) was continued exactly; 884c575 refused
    every state not at position 0. Its spectrum equals that of the same weights at position 0."""
    spec = _ttt_linear(4)
    q, k, v, theta = _inputs(12, seed=2)
    w0 = 0.02 * torch.randn(1, 1, 4, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    state = init_state(spec, [w0])
    _, mid = memory_recurrent(spec, q[:, :4], k[:, :4], v[:, :4], theta[:, :4], None, None, None, state)
    assert mid.position == 4
    rest = (q[:, 4:], k[:, 4:], v[:, 4:], theta[:, 4:])
    got, n = memory_jvp_spectrum(spec, mid, *rest, directions=3)
    fresh = MemoryState(mid.weights, mid.momentum, mid.weights, None, 0)
    want, _ = memory_jvp_spectrum(spec, fresh, *rest, directions=3)
    assert n == 16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # inside a chunk (anchored at other weights) it is still refused
    _, inside = memory_recurrent(spec, q[:, :5], k[:, :5], v[:, :5], theta[:, :5], None, None, None, state)
    with pytest.raises(ValueError, match=r"state: expected the memory's state at position 0.*position 5"):
        memory_jvp_spectrum(spec, inside, q[:, 5:], k[:, 5:], v[:, 5:], theta[:, 5:], directions=2)


def test_a_batched_starting_basis_without_batch_shape_still_runs_per_row():
    """``q0 [B, n, k]`` with the default ``batch_shape=()`` ran per row (the sums took Q's batch
    shape) before 884c575 expanded q0 to ``[n, k]`` and refused it."""
    d = torch.tensor([[0.5, 0.25, 0.125], [0.125, 0.5, 0.25]], dtype=torch.float64)
    A = torch.diag_embed(d)  # [2, 3, 3]
    q0 = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
    got = lyapunov_spectrum(lambda t, Q: A @ Q, 5, 3, q0=q0)
    torch.testing.assert_close(got, d.log().sort(-1, descending=True).values, rtol=0, atol=1e-13)


def test_a_0d_tensor_scale_that_requires_grad_keeps_its_gradient():
    """884c575 turned a 0-d tensor ``scale`` into a Python float (``.item()``): a steering scale
    being optimised lost its gradient without a word (``scale.grad`` stayed ``None``). The output
    is ``value + s·d``, so ``∂L/∂s = <∂L/∂d, d> / s``."""
    from mnemo.interp.interventions import steer
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("gla", vocab_size=23, d_model=16, n_layers=1)).double()
    ids = torch.randint(0, 23, (2, 7), generator=torch.Generator().manual_seed(3))
    d = torch.randn(16, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    out, _ = m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_pre", d, scale=s))
    out.square().sum().backward()
    assert s.grad is not None
    torch.testing.assert_close(s.grad, (d.grad * d.detach()).sum() / 0.5, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="scale: expected a finite real number"):
        steer(m, "blocks.0.hook_resid_pre", d, scale=torch.tensor(float("nan"), requires_grad=True))


def test_a_per_row_tensor_scale_steers_each_row_by_its_own_amount():
    """A scale ``[B, 1, 1]`` (a sweep of steering strengths in one batch) worked before review 5-S's
    check, which refused every tensor but a 0-d one: each row is ``value + s_b · direction``, by
    hand against one run per row with the float scale; a non-finite entry is refused by name."""
    import pytest
    import torch

    from mnemo.interp import steer
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("gla", vocab_size=23, d_model=16, n_layers=1)).eval().double()
    ids = torch.randint(0, 23, (3, 6))
    d = torch.randn(16, dtype=torch.float64)
    scales = torch.tensor([0.0, 1.5, -2.0], dtype=torch.float64)[:, None, None]
    both = m.run_with_hooks(ids, steer(m, "blocks.0.hook_resid_pre", d, scale=scales))[0]
    for b in range(3):
        hooks = steer(m, "blocks.0.hook_resid_pre", d, scale=float(scales[b]))
        one = m.run_with_hooks(ids[b : b + 1], hooks)[0]
        torch.testing.assert_close(both[b : b + 1], one, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="scale: expected a finite real number"):
        steer(m, "blocks.0.hook_resid_pre", d, scale=torch.tensor([1.0, float("nan")]))
