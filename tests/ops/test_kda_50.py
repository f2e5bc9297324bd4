"""``gated_delta_rule`` with per-channel log gates ``g: [B, T, H, K]``: Kimi Delta Attention (KDA;
Kimi Team 2025, "Kimi Linear", arXiv 2510.26692, §3)

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

Every form against the token loop (outputs, final states, gradients of every input, float64),
odd lengths, splits, packed sequences; meaning checks: a hand loop of the equation written here,
equal channels = the scalar gate, ``beta = 0`` = pure per-channel decay of ``S0``, a ``-inf``
channel forgets exactly its row, strong gates in float32; fla's ``naive_recurrent_kda``; the fla
backend's routing to ``chunk_kda`` (a stand-in kernel) and, ``slow``, fla's real ``chunk_kda``
under Triton's interpreter in a child process.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

import mnemo.ops as ops
from mnemo.ops import _peer_ops, dispatch, gated_delta_rule
from tests.ops import interpret_worker as worker

F64 = torch.float64


def _inputs(B=2, T=37, H=2, K=8, V=5, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
        "g": F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype) + 1.0),
        "beta": torch.rand(B, T, H, generator=gen, dtype=dtype),
    }
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return x, S0


def _run(x, S0, mode, chunk_size=16, scale=0.7, grads=True, **kw):
    """``(o, S, grads of q, k, v, g, beta, S0)`` of a fixed random projection of ``o`` and ``S``."""
    xs = {n: t.clone().requires_grad_(grads) for n, t in x.items()}
    s0 = None if S0 is None else S0.clone().requires_grad_(grads)
    o, S = gated_delta_rule(
        xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], scale=scale, initial_state=s0,
        output_final_state=True, mode=mode, chunk_size=chunk_size, **kw,
    )  # fmt: skip
    if not grads:
        return o.detach(), S.detach()
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)).sum()
    loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=F64).to(S.dtype)).sum()
    wrt = [*xs.values()] + ([] if s0 is None else [s0])
    return [o.detach(), S.detach(), *torch.autograd.grad(loss, wrt)]


def _err(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_every_form_matches_the_token_loop_float64():
    """chunk (several chunk sizes, an odd one, one longer than T) and parallel against recurrent at
    an odd length: outputs, final state and the gradients of q, k, v, g, beta and the initial state."""
    x, S0 = _inputs()
    ref = _run(x, S0, "recurrent")
    for mode, C in (("chunk", 16), ("chunk", 5), ("chunk", 64), ("parallel", 16)):
        assert _err(_run(x, S0, mode, C), ref) < 1e-10, (mode, C)


def test_hand_written_and_autograd_chunk_forms_agree(monkeypatch):
    """The chunk form's two implementations: ``_KDAChunk`` (hand-written backward; chunks decaying
    by at most 30 nats, halved down to 4 tokens until they do) and ``kda_chunk_autograd`` (any
    decay), each against the token loop with every gradient: mild gates, gates that halve the
    chunk (-1.5 a token on half the channels: 96 nats per 64 tokens, 24 per 16), one channel at
    -2.5 a token (it went to the autograd form while chunks stopped at 16 tokens), and the autograd
    form forced at mild gates."""
    dr = importlib.import_module("mnemo.ops.delta_rule")
    used = []
    for name in ("_KDAChunk", "kda_chunk_autograd"):
        real = getattr(dr, name)
        if name == "_KDAChunk":
            monkeypatch.setattr(real, "apply", lambda *a, _f=real.apply: (used.append("hand"), _f(*a))[1])
        else:
            monkeypatch.setattr(dr, name, lambda *a, _f=real: (used.append("autograd"), _f(*a))[1])
    x, S0 = _inputs(T=70, seed=10)
    halving = dict(x, g=x["g"].clone())
    halving["g"][..., ::2] = -1.5
    fast = dict(x, g=x["g"].clone())  # one fast channel (review 50f): 40 nats per 16 tokens, 20 per 8
    fast["g"][..., 0] = -2.5
    cases = ((x, 30.0, "hand"), (halving, 30.0, "hand"), (fast, 30.0, "hand"), (x, -1.0, "autograd"))
    for inputs, span, form in cases:
        monkeypatch.setattr(dr, "_SAFE_SPAN", span)
        used.clear()
        ref = _run(inputs, S0, "recurrent")
        assert _err(_run(inputs, S0, "chunk", 64), ref) < 1e-10, form
        assert used == [form], used


def _hand_loop(x, S0, scale):
    """The equation as written (matrices, no broadcasting tricks)."""
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    S = S0.clone()
    o = torch.zeros(*v.shape, dtype=v.dtype)
    eye = torch.eye(K, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            s = S[b, h]
            for t in range(T):
                kt = k[b, t, h][:, None]
                s = (eye - beta[b, t, h] * kt @ kt.T) @ torch.diag(g[b, t, h].exp()) @ s
                s = s + beta[b, t, h] * kt @ v[b, t, h][None, :]
                o[b, t, h] = s.T @ (scale * q[b, t, h])
            S[b, h] = s
    return o, S


def test_matches_a_hand_loop_of_the_equation():
    x, S0 = _inputs(B=1, T=11, H=2, K=4, V=3, seed=1)
    o_ref, S_ref = _hand_loop(x, S0, 0.7)
    for mode, C in (("recurrent", 16), ("chunk", 4), ("parallel", 16)):
        o, S = _run(x, S0, mode, C, grads=False)
        assert (o - o_ref).abs().max() < 1e-12 and (S - S_ref).abs().max() < 1e-12, mode


def test_split_and_packed_sequences():
    """Two halves with the carried state equal one run; packed sequences (cu_seqlens) equal
    separate runs, each from its own initial state."""
    x, S0 = _inputs(B=1, T=29, seed=2)
    o, S = _run(x, S0, "chunk", 8, grads=False)
    a = {n: t[:, :13] for n, t in x.items()}
    b = {n: t[:, 13:] for n, t in x.items()}
    o1, S1 = _run(a, S0, "chunk", 8, grads=False)
    o2, S2 = _run(b, S1, "chunk", 8, grads=False)
    assert (torch.cat([o1, o2], 1) - o).abs().max() < 1e-12 and (S2 - S).abs().max() < 1e-12
    lens = [7, 0, 15, 7]
    cu = torch.tensor([0, 7, 7, 22, 29])
    S0s = torch.randn(4, *S0.shape[1:], dtype=F64, generator=torch.Generator().manual_seed(3))
    for mode in ("chunk", "parallel", "recurrent"):
        o, S = _run(x, S0s, mode, 4, grads=False, cu_seqlens=cu)
        start = 0
        for i, n in enumerate(lens):
            part = {name: t[:, start : start + n] for name, t in x.items()}
            if n:
                oi, Si = _run(part, S0s[i : i + 1], "recurrent", grads=False)
                assert (o[:, start : start + n] - oi).abs().max() < 1e-12, (mode, i)
            else:
                Si = S0s[i : i + 1]
            assert (S[i : i + 1] - Si).abs().max() < 1e-12, (mode, i)
            start += n


def test_equal_channels_is_the_scalar_gated_delta_rule():
    """A per-channel g equal across K runs the KDA chunk form; it equals the scalar-g rule
    (its own hand-written chunk form), gradients of g summed over the channels."""
    x, S0 = _inputs(seed=4)
    gs = x["g"][..., 0]
    xc = dict(x, g=gs[..., None].expand(x["k"].shape).contiguous())
    xs = dict(x, g=gs)
    for mode in ("chunk", "parallel"):
        rc, rs = _run(xc, S0, mode, 8), _run(xs, S0, mode, 8)
        rc[5] = rc[5].sum(-1)  # dg per channel -> per head
        assert _err(rc, rs) < 1e-10, mode


def test_beta_zero_is_the_per_channel_decay_of_the_initial_state():
    """``beta = 0``: nothing is written, so ``S_T = exp(Σ_t g_t) ⊙ S0`` row by row and
    ``o_t = (exp(Σ_{s≤t} g_s) ⊙ S0)ᵀ (scale · q_t)`` (a known answer)."""
    x, S0 = _inputs(seed=5)
    x["beta"] = torch.zeros_like(x["beta"])
    b = x["g"].cumsum(1)  # [B, T, H, K]
    S_known = b[:, -1].exp()[..., None] * S0
    o_known = torch.einsum("bthk,bhkv->bthv", 0.7 * x["q"] * b.exp(), S0)
    for mode in ("recurrent", "chunk", "parallel"):
        o, S = _run(x, S0, mode, 8, grads=False)
        assert (S - S_known).abs().max() < 1e-12 and (o - o_known).abs().max() < 1e-12, mode


def test_a_minus_inf_channel_forgets_exactly_its_row():
    """``g[t0, c] = -inf`` erases row ``c`` of the state at ``t0`` and nothing else: the run equals
    running to ``t0 - 1``, zeroing row ``c``, and going on with ``g[t0, c] = 0``."""
    x, S0 = _inputs(B=1, T=30, seed=6)
    t0, c = 12, 3
    x["g"][:, t0, :, c] = float("-inf")
    a = {n: t[:, :t0] for n, t in x.items()}
    b = {n: t[:, t0:].clone() for n, t in x.items()}
    b["g"][:, 0, :, c] = 0.0
    for mode in ("recurrent", "chunk", "parallel"):
        o, S = _run(x, S0, mode, 8, grads=False)
        o1, S1 = _run(a, S0, mode, 8, grads=False)
        S1 = S1.clone()
        S1[:, :, c] = 0.0
        o2, S2 = _run(b, S1, mode, 8, grads=False)
        assert (torch.cat([o1, o2], 1) - o).abs().max() < 1e-12 and (S2 - S).abs().max() < 1e-12, mode


def test_strong_gates_stay_finite_in_float32():
    """Log gates of -50 a token on some channels and on whole tokens (chunks decaying by thousands
    of nats: the exact sub-block split of the scores) stay finite in float32, outputs, states and
    gradients, and match float64 (measured, relative to the largest entry: chunk ≤ 4.4e-6, parallel
    ≤ 2.3e-5: its one chunk's cumulative gates, rounded to float32, reach ~-1000 nats)."""
    x, S0 = _inputs(T=40, seed=7)
    x["g"][:, 5:9, :, :3] = -50.0
    x["g"][:, 20] = -50.0
    ref = _run(x, S0, "recurrent")
    x32 = {n: t.float() for n, t in x.items()}
    for mode in ("chunk", "parallel"):
        got = _run(x32, S0.float(), mode, 16)
        assert all(torch.isfinite(t).all() for t in got), mode
        rel = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
        assert rel < (2e-5 if mode == "chunk" else 1e-4), (mode, rel)


def test_memory_kept_for_backward_has_no_per_token_state():
    """What autograd keeps for the backward pass of the chunk form is ``O(T·(C + K + V) +
    (T/C)·K·V)`` per head (measured: 3.6x that sum), doubles with ``T``, and holds no tensor as
    large as one ``K × V`` state per token (its largest: ``T × (K + V)`` or the ``n`` chunk
    transitions ``K × K``)."""

    def saved(T, C=16, K=32, V=24):
        x, S0 = _inputs(B=1, T=T, H=1, K=K, V=V, dtype=torch.float32)
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        xs = {n: t.requires_grad_() for n, t in x.items()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gated_delta_rule(*(xs[n] for n in ("q", "k", "v", "g", "beta")), initial_state=S0, chunk_size=C)
        assert max(sizes) <= max(T * (K + V), (T // C) * K * max(K, V)), (T, max(sizes))
        assert sum(sizes) < 8 * (T * (C + K + V) + (T // C) * K * V), (T, sum(sizes))
        return sum(sizes)

    assert 1.8 < saved(512) / saved(256) < 2.2


def test_shape_refused_by_name():
    x, _ = _inputs(T=6)
    with pytest.raises(
        ValueError, match=r"g must have shape .* \[B, T, H, K\] = \[2, 6, 2, 8\], got \[2, 6, 2, 7\]"
    ):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"][..., :7], x["beta"])


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core not installed")
def test_fla_naive_recurrent_kda_agrees_with_a_per_channel_gate():
    from mnemo.testing.third_party import fla_naive

    x, S0 = _inputs(seed=8)
    f = fla_naive("kda").naive_recurrent_kda
    o_f, S_f = f(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.7, initial_state=S0, output_final_state=True
    )  # (computes in float32)
    for mode in ("recurrent", "chunk"):
        o, S = _run(x, S0, mode, 16, grads=False)
        assert (o - o_f).abs().max() < 2e-5 and (S - S_f).abs().max() < 2e-5, mode


# ----------------------------------------------------------------------------------------------
# the fla backend: per-channel gates go to chunk_kda
# ----------------------------------------------------------------------------------------------


def test_fla_backend_sends_per_channel_gates_to_chunk_kda(monkeypatch):
    """Forced onto fla (kernels replaced by stand-ins that record their call and run mnemo's
    token loop), a per-channel g reaches ``chunk_kda`` as the final clamped float32 gate with
    fla's defaults (no in-kernel gate, l2norm or beta sigmoid), a scalar g
    ``chunk_gated_delta_rule``; outputs and gradients are the torch backend's."""
    calls = []

    def stand_in(name):
        def kernel(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, **kw):
            calls.append((name, tuple(g.shape), g.dtype, float(g.detach().min()), sorted(kw)))
            with ops.use_backend("torch"):
                return gated_delta_rule(
                    q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, mode="recurrent",
                )  # fmt: skip

        return kernel

    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    monkeypatch.setattr(dispatch, "_device_problem", lambda device: None)
    monkeypatch.setattr(dispatch, "_import_problem", lambda backend: None)
    fns = {"gated_delta_rule": stand_in("chunk_gated_delta_rule"), "kda": stand_in("chunk_kda")}
    monkeypatch.setitem(_peer_ops._fns, "fla", fns)
    monkeypatch.setitem(_peer_ops._problems, "fla", None)
    x, S0 = _inputs(T=12, dtype=torch.float32, seed=9)
    x["g"][:, 3, :, 1] = float("-inf")
    with ops.use_backend("fla"):
        got = _run(x, S0, "chunk")
    assert calls[0][:4] == ("chunk_kda", (2, 12, 2, 8), torch.float32, -60.0) and calls[0][4] == []
    with ops.use_backend("torch"):
        ref = _run(x, S0, "chunk")
    assert _err(got, ref) < 1e-5
    calls.clear()
    with ops.use_backend("fla"):
        _run(dict(x, g=x["g"][..., 0]), S0, "chunk", grads=False)
    assert calls[0][0] == "chunk_gated_delta_rule"


# the real kernel, under Triton's interpreter in a child process (tests/ops/interpret_worker.py)
CASES = {}


def _kda_fla_case():
    d = worker.with_beta(worker.matrix_inputs(B=1, T=24, gate="channel", seed=30))
    d["g"][:, 5, :, :3] = float("-inf")
    return worker.parity(ops.gated_delta_rule, d, "fla", output_final_state=True, scale=0.3)


CASES["kda_fla"] = _kda_fla_case


@pytest.mark.slow
@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("triton", "fla")),
    reason="triton / fla-core not installed",
)
def test_fla_chunk_kda_under_the_interpreter():
    """fla's ``chunk_kda`` (forced ``fla`` backend, float32, CPU interpreter) against the torch
    backend and the float64 token loop: output, state and every gradient (measured ≤ 2.2e-6
    relative RMS, a hard reset on three channels included)."""
    r = worker.run_child("tests.ops.test_kda_50", ["kda_fla"])["kda_fla"]
    assert "error" not in r, r["error"]
    assert r["finite"] and r["log"] and r["log"][0][1] == "fla", r
    bad = {k: v for a in ("vs_torch", "vs_reference") for k, v in r[a].items() if not v <= 2e-5}
    assert not bad, bad
    assert {k for k in r["vs_torch"] if k.startswith("d")} == {
        "dq",
        "dk",
        "dv",
        "dg",
        "dbeta",
        "dinitial_state",
    }


if __name__ == "__main__":
    worker.run_cases(CASES, sys.argv[1:])


@pytest.mark.parametrize("mode", ["chunk", "parallel", "recurrent"])
@pytest.mark.parametrize("shape", [(0, 5, 2, 4), (2, 5, 0, 4)], ids=["no_batch", "no_heads"])
def test_empty_batch_or_heads_keep_the_graph(mode, shape):
    """Review 50f: with no batch row or no head, the parallel form's output had no link to the
    inputs (``backward`` raised); every form now gives zero gradients, as the scalar gate does."""
    B, T, H, K = shape
    x = dict(
        q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, 3),
        g=-torch.rand(B, T, H, K), beta=torch.rand(B, T, H),
    )  # fmt: skip
    for t in x.values():
        t.requires_grad_(True)
    o, _ = gated_delta_rule(**x, mode=mode)
    o.sum().backward()
    assert o.shape == (B, T, H, 3)
    assert all(t.grad is not None and t.grad.shape == t.shape for t in x.values())
