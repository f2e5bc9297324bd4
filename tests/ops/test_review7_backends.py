"""Seventh break-it review of the backend table (fifth of the peers' glue): what was found.

mamba-ssm is not installed here, so its glue is checked against an independent kernel that follows
``mamba_chunk_scan_combined``'s documented contract, including its keyword defaults.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import mnemo.ops as ops
from mnemo.ops import _peer_ops, dispatch
from tests.ops.interpret_worker import rel

# ----------------------------------------------------------------------------------------------
# 1. mamba-ssm clamps dt to dt_limit = (0, inf) by default: a negative step was zeroed
# ----------------------------------------------------------------------------------------------


def _scan_like_mamba(
    x, dt, A, B, C, chunk_size, initial_states=None, dt_limit=(0.0, float("inf")), return_final_states=False
):
    """``mamba_chunk_scan_combined``'s contract as a token loop, with its ``dt_limit`` keyword and
    default: every kernel of its ``_chunk_cumsum_fwd`` clamps ``dt`` to ``[dt_limit[0], dt_limit[1]]``
    (``tl.minimum(tl.maximum(dt, dt_min), dt_max)``) before the decay ``exp(dt · A)`` and the write
    ``dt · x``; states ``[B, H, P, N]``; head ``h`` reads group ``h // (H / G)``."""
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    Bsz, T, H, P = x.shape
    r = H // B.shape[2]
    Bh, Ch = (X.repeat_interleave(r, dim=2).float() for X in (B, C))
    h = x.new_zeros(Bsz, H, P, B.shape[-1]) if initial_states is None else initial_states.float()
    ys = []
    for t in range(T):
        a = torch.exp(dt[:, t] * A)
        h = a[..., None, None] * h + (dt[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1).to(x.dtype)
    return (y, h) if return_final_states else y


@pytest.fixture
def fake_mamba(monkeypatch):
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    monkeypatch.setattr(dispatch, "_device_problem", lambda device: None)
    monkeypatch.setattr(dispatch, "_import_problem", lambda backend: None)
    monkeypatch.setitem(_peer_ops._fns, "mamba_ssm", {"ssd": _scan_like_mamba})
    monkeypatch.setitem(_peer_ops._problems, "mamba_ssm", None)


def test_a_negative_step_reaches_mamba_as_given(fake_mamba):
    """``ssd`` computes a negative ``dt + dt_bias`` as given (a :class:`RangeWarning` on a CPU, nothing
    on CUDA: "an intervention may mean it"), on every form of the torch backend. mamba-ssm's kernel
    clamps ``dt`` at its ``dt_limit`` (default ``(0, inf)``), so on the ``mamba_ssm`` backend those
    tokens wrote nothing and did not decay: another function, silently, on the default CUDA route.
    Now the glue passes ``dt_limit=(-inf, inf)`` (no clamp: mnemo's own clamp of ``dt · A`` at -60 is
    applied before): output, state and every gradient equal the float64 token loop."""
    gen = torch.Generator().manual_seed(3)
    Bz, T, H, P, G, N = 1, 9, 2, 3, 1, 4
    d = {
        "x": torch.randn(Bz, T, H, P, generator=gen),
        "dt": torch.rand(Bz, T, H, generator=gen) * 0.5,
        "A": -torch.rand(H, generator=gen) - 0.5,
        "B": torch.randn(Bz, T, G, N, generator=gen),
        "C": torch.randn(Bz, T, G, N, generator=gen),
        "initial_state": torch.randn(Bz, H, N, P, generator=gen),
    }
    d["dt"][:, 2] = -0.3  # negative steps, as given
    d["dt"][:, 6, 1] = -0.1
    w = torch.randn(Bz, T, H, P, generator=gen, dtype=torch.float64)
    wS = torch.randn(Bz, H, N, P, generator=gen, dtype=torch.float64)

    def run(backend, dtype, mode):
        xs = {n: t.to(dtype).clone().requires_grad_(True) for n, t in d.items()}
        with ops.use_backend(backend), pytest.warns(ops.RangeWarning, match="dt should be >= 0"):
            y, S = ops.ssd(**xs, output_final_state=True, mode=mode)
        loss = (y.double() * w).sum() + (S.double() * wS).sum()
        return y, S, dict(zip(xs, torch.autograd.grad(loss, list(xs.values()))))

    y, S, g = run("mamba_ssm", torch.float32, "chunk")
    y_r, S_r, g_r = run("torch", torch.float64, "recurrent")
    errs = {"y": rel(y, y_r), "S": rel(S, S_r), **{f"d{n}": rel(g[n], g_r[n]) for n in g}}
    bad = {n: e for n, e in errs.items() if not e <= 2e-6}
    assert not bad, bad
    assert "dt_limit" in _peer_ops.mamba_ssd.__doc__ and math.isinf(_peer_ops.MAMBA_DT_LIMIT[0])


# ----------------------------------------------------------------------------------------------
# 2. the reason logged for native inside a `suppressed` block said MNEMO_NATIVE=0, which was unset
# ----------------------------------------------------------------------------------------------


def _gla_inputs(seed=0, B=1, T=8, H=2, K=4, V=4):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
    return q, k, v, g


def test_the_native_reason_names_a_suppressed_block_not_the_variable(monkeypatch):
    """Inside :class:`mnemo.ops._native.suppressed` (the torch backend's block; also open while the
    backward of a torch-backend chunk form runs, so an activation-checkpointing recompute there is
    chosen inside it) the table skipped ``native`` with the reason "MNEMO_NATIVE=0", with the variable
    unset: the dispatch log (and a forced native's :class:`BackendError`) named a switch nobody set.
    Now the reason says the kernels are off in this thread, and "MNEMO_NATIVE=0" stays the variable's."""
    from torch.utils.checkpoint import checkpoint

    from mnemo.ops import _native

    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    monkeypatch.delenv("MNEMO_NATIVE", raising=False)
    if _native.library() is None:
        pytest.skip("the C kernels did not build here")
    q, k, v, g = _gla_inputs()
    dispatch.reset_dispatch_log()
    with _native.suppressed():
        ops.gated_linear_attention(q, k, v, g)
    with pytest.raises(ops.BackendError) as err, _native.suppressed(), ops.use_backend("native"):
        ops.gated_linear_attention(q, k, v, g)
    # the recompute of activation checkpointing, in the backward of a torch-backend form
    qr = q.clone().requires_grad_(True)
    with ops.use_backend("torch"):
        o = checkpoint(lambda x: ops.gated_linear_attention(x, k, v, g)[0], qr, use_reentrant=False)
    o.sum().backward()
    log = dispatch.dispatch_log()
    reasons = [r for (op, b, r) in log if b == "torch" and r != "forced"]
    assert sum(n for (_, b, r), n in log.items() if r in reasons) == 2, log
    for text in [*reasons, str(err.value)]:
        assert "MNEMO_NATIVE=0" not in text and "suppressed" in text, text
    monkeypatch.setenv("MNEMO_NATIVE", "0")
    dispatch.reset_dispatch_log()
    ops.gated_linear_attention(q, k, v, g)
    assert [r for (_, _, r) in dispatch.dispatch_log()] == ["native: MNEMO_NATIVE=0"]


# ----------------------------------------------------------------------------------------------
# 3. use_backend and activation checkpointing: the recompute chooses again (said now)
# ----------------------------------------------------------------------------------------------


def test_a_recomputed_forward_chooses_its_backend_again_as_documented(monkeypatch):
    """``use_backend`` promised "a backward pass runs the backward of whatever its forward ran"; a
    forward recomputed in the backward pass (activation checkpointing, which ``mnemo.models.lm`` uses)
    chooses again, under the block open *then* in the thread that runs the backward (outside the
    block: ``auto``; on CUDA the engine's own thread, so a forced ``torch`` run recomputes on fla).
    Shown here on a CPU: forced ``torch`` in the forward, the recompute after the block is an
    ``auto`` choice. The docstring now says so, and how to make a choice hold there: a
    ``context_fn`` entering :func:`~mnemo.ops.dispatch.recompute_as_chosen` (what the language
    model's activation checkpointing does; tests/test_leftovers_42c.py) or ``MNEMO_BACKEND``."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    q, k, v, g = _gla_inputs(seed=1)
    qr = q.clone().requires_grad_(True)
    dispatch.reset_dispatch_log()
    with ops.use_backend("torch"):
        o = checkpoint(lambda x: ops.gated_linear_attention(x, k, v, g)[0], qr, use_reentrant=False)
    o.sum().backward()
    log = dispatch.dispatch_log()
    assert log[("gated_linear_attention", "torch", "forced")] == 1
    assert sum(n for (_, _, r), n in log.items() if r != "forced") == 1, log  # the recompute: auto
    doc = " ".join(ops.use_backend.__doc__.split())
    assert "activation checkpointing" in doc and "chooses again" in doc and "MNEMO_BACKEND" in doc
    assert "recompute_as_chosen" in doc
    dispatch.reset_dispatch_log()
    with ops.use_backend("torch"):
        again = dispatch.recompute_as_chosen()
        o = checkpoint(
            lambda x: ops.gated_linear_attention(x, k, v, g)[0],
            qr,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), again()),
        )
    o.sum().backward()  # the recompute re-enters the forward's block
    assert dispatch.dispatch_log() == {("gated_linear_attention", "torch", "forced"): 2}
    monkeypatch.setenv("MNEMO_BACKEND", "torch")  # the documented way: the recompute is forced too
    dispatch.reset_dispatch_log()
    o = checkpoint(lambda x: ops.gated_linear_attention(x, k, v, g)[0], qr, use_reentrant=False)
    o.sum().backward()
    assert dispatch.dispatch_log() == {("gated_linear_attention", "torch", "forced"): 2}
