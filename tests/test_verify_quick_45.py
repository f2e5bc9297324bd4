"""``mnemo verify --quick`` runs the reference's gradcheck in torch's fast mode (one random
projection ``uᵀ J v`` of each Jacobian instead of every column: the check took half of the quick
run); a planted gradient bug of the reference is still caught, in both modes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mnemo.commands import verify as V
from mnemo.testing import get_spec
from mnemo.testing.contract import check_gradcheck_reference, plan


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by ``s`` (``s = 1``: correct)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class _DropOneStep(torch.autograd.Function):
    """Identity forward; the backward drops the gradient of one time step (``t``) of ``x [B, T, ...]``."""

    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[:, ctx.t] = 0
        return g, None


def _spec_with(bug):
    """``gla_scalar``'s spec whose op sees ``bug(q)`` for ``q`` (its reference is its own recurrent
    form, so the reference's backward carries the bug)."""
    spec = get_spec("gla_scalar")
    if spec.call is not None:
        call = spec.call
        return dataclasses.replace(
            spec, call=lambda inputs, **kw: call({**inputs, "q": bug(inputs["q"])}, **kw)
        )
    args_of = spec.arguments

    def arguments(inputs):
        return args_of({**inputs, "q": bug(inputs["q"])})

    return dataclasses.replace(spec, arguments=arguments)


@pytest.mark.parametrize("fast", [False, True])
def test_gradcheck_passes_the_reference_and_catches_planted_gradient_bugs(fast):
    """Known answers: the correct reference passes; a backward 1% too large for ``q`` (gradcheck's
    rtol is 1e-3), or one that loses one token's gradient of ``q``, fails (the check's row is
    failed, naming gradcheck's error), in the full and the fast mode alike."""
    spec = get_spec("gla_scalar")
    assert spec.reference is None and spec.has("grad")  # (gradcheck runs on its own recurrent form)
    ok = check_gradcheck_reference(spec, fast=fast)
    assert ok.passed and ("fast mode" in ok.message) == fast, ok
    for bug in (lambda q: _ScaleGrad.apply(q, 1.01), lambda q: _DropOneStep.apply(q, 2)):
        bad = check_gradcheck_reference(_spec_with(bug), fast=fast)
        assert not bad.passed and "Jacobian mismatch" in bad.message, bad


def test_the_quick_plan_asks_for_the_fast_gradcheck_and_the_full_plan_for_the_full_one(monkeypatch):
    seen = []

    def spy(spec, fast=False):
        seen.append(fast)

    monkeypatch.setattr("mnemo.testing.contract.check_gradcheck_reference", spy)
    spec = get_spec("gla_scalar")
    for quick in (True, False):
        for name, thunks in plan(spec, quick):
            if name == "gradcheck":
                [t() for t in thunks]
    assert seen == [True, False]


def test_verify_quick_still_runs_the_gradcheck_row(capsys):
    assert V.main(["--ops", "gla_scalar", "--checks", "gradcheck", "--quick", "--third-party", "none"]) == 0
    out = capsys.readouterr().out
    assert "gradcheck" in out and "0 failed" in out, out
