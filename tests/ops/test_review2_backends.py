"""Second break-it review of the backend table and the peers' glue (cases that failed before their fix).

The interpreter cases run in a child process (``python -m tests.ops.test_review2_backends``) with
``TRITON_INTERPRET=1`` set before anything imports triton (see :mod:`tests.ops.interpret_worker`);
the table cases run here, with the device and import checks stubbed where a GPU is needed.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the child: Triton's interpreter, set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mnemo.ops as ops  # noqa: E402
from mnemo.ops import dispatch  # noqa: E402
from tests.ops.interpret_worker import rel, run_cases, shared_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PEERS = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not PEERS, reason="triton or fla-core not installed")


# ----------------------------------------------------------------------------------------------
# the child's cases (TRITON_INTERPRET=1, float32 on the CPU)
# ----------------------------------------------------------------------------------------------


def _matrix(seed=0, B=2, T=20, H=2, K=8, V=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.1
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, gk, beta, h0


_SCALE_OPS = {
    "gated_delta_rule": lambda q, k, v, g, gk, beta, **kw: ops.gated_delta_rule(q, k, v, g, beta, **kw),
    "delta_rule": lambda q, k, v, g, gk, beta, **kw: ops.delta_rule(q, k, v, beta, **kw),
    "gla_scalar": lambda q, k, v, g, gk, beta, **kw: ops.gated_linear_attention(q, k, v, g, **kw),
    "gla_channel": lambda q, k, v, g, gk, beta, **kw: ops.gated_linear_attention(q, k, v, gk, **kw),
    "linear_attention": lambda q, k, v, g, gk, beta, **kw: ops.linear_attention(q, k, v, **kw),
    "linear_attention_elu": lambda q, k, v, g, gk, beta, **kw: ops.linear_attention(
        q, k, v, feature_map="elu", **kw
    ),
}


def case_tensor_scale() -> dict:
    """A tensor ``scale`` (a learned one) through the fla backend: its output and its gradient
    against the float64 token loop, and (o linear in the scale for all but the elu map) the hand
    value ``∂ Σ w·o / ∂ scale = Σ w·o / scale``."""
    out = {}
    q, k, v, g, gk, beta, h0 = _matrix(seed=1)
    w = torch.randn(
        *q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    for name, fn in _SCALE_OPS.items():
        res = {}
        try:
            runs = {}
            for tag, backend, dtype, mode in (
                ("fla", "fla", torch.float32, "chunk"),
                ("ref", "torch", torch.float64, "recurrent"),
            ):
                s = torch.tensor(0.3, dtype=dtype, requires_grad=True)
                xs = [t.to(dtype) for t in (q, k, v, g, gk, beta, h0)]
                with ops.use_backend(backend):
                    o, _ = fn(*xs[:6], initial_state=xs[6], scale=s, mode=mode)
                loss = (o.double() * w).sum()
                (ds,) = torch.autograd.grad(loss, s, allow_unused=True)
                runs[tag] = (o.detach(), None if ds is None else float(ds), float(loss))
            (o, ds, loss), (o_r, ds_r, loss_r) = runs["fla"], runs["ref"]
            res = {"o": rel(o, o_r), "dscale": ds, "dscale_ref": ds_r, "hand": loss_r / 0.3}
        except Exception as e:  # noqa: BLE001 (reported to the test)
            res = {"error": f"{type(e).__name__}: {e}"[:400]}
        out[name] = res
    return out


def case_bf16_odd_head_dims() -> dict:
    """fla-core's simple-GLA backward (``chunk_bwd_dv``) refuses 16-bit inputs with an odd K or V
    (an AssertionError in the backward, after a forward that ran): what the table now keeps off it."""
    from mnemo.ops import _peer_ops

    _peer_ops.import_problem("fla")
    out = {}
    for K, V in ((7, 8), (8, 7), (8, 8)):
        gen = torch.Generator().manual_seed(3)
        q, k = (
            torch.randn(1, 8, 1, K, generator=gen, dtype=torch.bfloat16, requires_grad=True) for _ in "qk"
        )
        v = torch.randn(1, 8, 1, V, generator=gen, dtype=torch.bfloat16, requires_grad=True)
        g = -torch.rand(1, 8, 1, generator=gen)
        o, _ = _peer_ops.gated_linear_attention_fla(q, k, v, g, None, None, 0.5, False)
        try:
            o.float().sum().backward()
            out[f"{K}x{V}"] = ""
        except Exception as e:  # noqa: BLE001
            out[f"{K}x{V}"] = f"{type(e).__name__}: {e}"[:300]
    return out


CASES = {"tensor_scale": case_tensor_scale, "bf16_odd_head_dims": case_bf16_odd_head_dims}


#: the child's cases (:func:`tests.ops.interpret_worker.shared_child`)
INTERPRETED = ("tests.ops.test_review2_backends", tuple(CASES))


@pytest.fixture(scope="module")
def interpreted(request):
    return shared_child(request, *INTERPRETED)


# ----------------------------------------------------------------------------------------------
# 1. a tensor scale through the fla glue: float(scale) cut it off the graph
# ----------------------------------------------------------------------------------------------


@needs_fla
@pytest.mark.parametrize("name", sorted(_SCALE_OPS))
def test_tensor_scale_reaches_its_gradient_through_fla(interpreted, name):
    """The fla glue turned the scale into ``float(scale)``: a learned (tensor) scale got no gradient
    on the fla backend (``autograd.grad`` raised "does not require grad"; in a model its ``.grad``
    stayed ``None``, silently), while every mnemo form gives it one. Now the glue multiplies ``q`` by
    a tensor scale itself. Relative error ≤ 2e-6 against the float64 token loop, and against the
    hand value ``Σ w·o / scale`` where ``o`` is linear in the scale."""
    r = interpreted["tensor_scale"][name]
    assert "error" not in r, r.get("error")
    assert r["o"] <= 2e-6, r
    assert r["dscale"] is not None, "no gradient reached the tensor scale"
    assert abs(r["dscale"] - r["dscale_ref"]) <= 2e-6 * abs(r["dscale_ref"]), r
    if name != "linear_attention_elu":  # φ(scale · q) is not linear in the scale
        assert abs(r["dscale_ref"] - r["hand"]) <= 1e-12 * abs(r["hand"]), r


# ----------------------------------------------------------------------------------------------
# 2. 16-bit inputs with an odd head dim: fla's simple-GLA backward asserts (auto picked it on CUDA)
# ----------------------------------------------------------------------------------------------


@needs_fla
def test_fla_simple_gla_backward_refuses_16bit_odd_head_dims(interpreted):
    """What the table rule below rests on (fla-core 0.6's ``chunk_bwd_dv``): the forward runs, the
    backward raises for bf16 with an odd K or V, and not for even ones."""
    r = interpreted["bf16_odd_head_dims"]
    assert "error" not in r, r.get("error")
    assert r["8x8"] == ""
    for key in ("7x8", "8x7"):
        assert r[key].startswith("AssertionError") and "even K and V" in r[key], r[key]


@pytest.fixture
def pretend_cuda(monkeypatch):
    """The table as on a CUDA machine with fla-core importable (no kernel runs in these tests)."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    monkeypatch.setattr(dispatch, "_device_problem", lambda device: None)
    monkeypatch.setattr(dispatch, "_import_problem", lambda backend: None)


@pytest.mark.parametrize("op", ["gated_linear_attention", "linear_attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K, V", [(7, 8), (8, 7), (15, 33)])
def test_auto_keeps_16bit_odd_head_dims_off_fla(pretend_cuda, op, dtype, K, V):
    """On CUDA ``auto`` sent a bf16/fp16 gated (scalar gate or none) or plain linear attention with
    an odd head dim to fla, whose backward then raised an AssertionError (the test above) in the
    middle of a training step; the table now says why and ``auto`` takes ``torch``."""
    call = dispatch.Call(op, torch.device("cuda"), (dtype,), "chunk", 32, K, V=V)
    why = dispatch._peer_problem(op, "fla", call)
    assert why is not None and "odd" in why and f"K = {K}, V = {V}" in why, why
    dispatch.reset_dispatch_log()
    assert dispatch.select(call) == "torch"
    ((key, n),) = dispatch.dispatch_log().items()
    assert key[:2] == (op, "torch") and "fla: " in key[2] and n == 1


@pytest.mark.parametrize(
    "dtype, K, V", [(torch.float32, 7, 5), (torch.bfloat16, 8, 16), (torch.float16, 64, 2)]
)
def test_even_or_float32_head_dims_still_go_to_fla(pretend_cuda, dtype, K, V):
    for op in ("gated_linear_attention", "linear_attention", "gated_delta_rule", "delta_rule"):
        call = dispatch.Call(op, torch.device("cuda"), (dtype,), "chunk", 32, K, V=V)
        assert dispatch.select(call) == "fla", op


def test_16bit_odd_head_dims_stay_allowed_for_the_delta_rules(pretend_cuda):
    """fla's delta-rule kernels have no such restriction (only the simple-GLA backward asserts)."""
    call = dispatch.Call("gated_delta_rule", torch.device("cuda"), (torch.bfloat16,), "chunk", 32, 7, V=9)
    assert dispatch.select(call) == "fla"


@needs_fla
@pytest.mark.parametrize("K, V", [(7, 8), (8, 7)])
def test_forcing_fla_on_16bit_odd_head_dims_names_the_reason(monkeypatch, K, V):
    """The public ops pass both head dims to the table (on ``meta``: shapes only, no kernel)."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    q = torch.empty(1, 8, 2, K, device="meta", dtype=torch.bfloat16)
    v = torch.empty(1, 8, 2, V, device="meta", dtype=torch.bfloat16)
    g = torch.empty(1, 8, 2, device="meta")
    with ops.use_backend("fla"):
        for name, call in (
            ("gated_linear_attention", lambda: ops.gated_linear_attention(q, q, v, g)),
            ("linear_attention", lambda: ops.linear_attention(q, q, v)),
        ):
            with pytest.raises(dispatch.BackendError, match=rf"{name}: backend 'fla'.*K = {K}, V = {V}"):
                call()
        o, _ = ops.gated_delta_rule(q, q, v, g, g.to(torch.bfloat16))  # (no such limit)
        assert o.shape == v.shape
        o, S = ops.gated_linear_attention(q.float(), q.float(), v.float(), g, output_final_state=True)
        assert o.shape == v.shape and S.shape == (1, 2, K, V)


# ----------------------------------------------------------------------------------------------
# 3. TRITON_INTERPRET read as Triton reads it
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["1", "true", "TRUE", "yes", "On", " 1", "1 ", " true ", "0", "", "2", "off"]
)
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value):
    """mnemo stripped the value (``" 1"`` meant "interpreting") where Triton does not (its kernels
    then compile for a GPU): on a CUDA machine a forced peer let CPU tensors through to kernels
    compiled for the GPU; on a CPU-only one the import check refused for a wrong reason ("imported
    before TRITON_INTERPRET=1 was set"). Now both read the value alike (Triton's own reader is the
    reference where it imports)."""
    from mnemo.ops._triton_interpret import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", value)
    expected = value in ("1", "true", "TRUE", "yes", "On")
    assert interpreting() is expected
    if importlib.util.find_spec("triton") is not None:
        from triton._C.libtriton import getenv_bool

        assert getenv_bool("TRITON_INTERPRET", False) is expected


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
