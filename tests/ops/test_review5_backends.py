"""Fifth break-it review of the backend table, the peers' glue and the interpreter shims (cases that
failed before their fix, plus the mamba-ssm glue checked against an independent kernel here, where
mamba-ssm is not installed and the interpreter cases of ``test_backends_interpret`` skip).

The interpreter cases run in a child process (``python -m tests.ops.test_review5_backends``) with
``TRITON_INTERPRET=1`` set before anything imports triton (see :mod:`tests.ops.interpret_worker`).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the child: Triton's interpreter, set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mnemo.ops as ops  # noqa: E402
from mnemo.ops import _peer_ops, dispatch  # noqa: E402
from tests.ops.interpret_worker import rel, run_cases, shared_child  # noqa: E402

PEERS = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not PEERS, reason="triton or fla-core not installed")


def _matrix(seed=0, B=1, T=20, H=2, K=8, V=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.1
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


# ----------------------------------------------------------------------------------------------
# the child's cases (TRITON_INTERPRET=1, float32 on the CPU)
# ----------------------------------------------------------------------------------------------


def case_range_counter() -> dict:
    """A ``range`` loop whose bound is an ``int64`` scalar: compiled Triton gives the counter the
    bounds' promoted type (``int64``), so ``i + (2**31 - 1)`` does not wrap; the shim gave ``int32``."""
    import triton
    import triton.language as tl

    from mnemo.ops import _triton_interpret

    _triton_interpret.install()

    @triton.jit
    def count(y_ptr, n):
        m = n.to(tl.int64)
        for i in range(m):
            tl.store(y_ptr + i, i + 2147483647)

    @triton.jit
    def count32(y_ptr, n):
        for i in range(n):
            tl.store(y_ptr + i, (i + 2147483646).to(tl.int64))

    y, y32 = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (NumPy's overflow warning, before the fix)
        count[(1,)](y, 2)
        count32[(1,)](y32, 2)
    return {"int64": y.tolist(), "int32": y32.tolist()}


def case_one_value_scale_on_fla() -> dict:
    """A learned scale stored as a one-value tensor of shape ``[1, 1, 1, 1, 1]`` through the fla
    glue (``q * scale`` made ``q`` 5-D): output shape, values and the scale's gradient against
    the float64 token loop with a float scale."""
    out = {}
    q, k, v, g, beta, h0 = _matrix(seed=3)
    w = torch.randn(*v.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    fns = {
        "gated_linear_attention": lambda s, dt, mode: ops.gated_linear_attention(
            q.to(dt), k.to(dt), v.to(dt), g.to(dt), scale=s, initial_state=h0.to(dt), mode=mode
        ),
        "gated_delta_rule": lambda s, dt, mode: ops.gated_delta_rule(
            q.to(dt), k.to(dt), v.to(dt), g.to(dt), beta.to(dt), scale=s, initial_state=h0.to(dt), mode=mode
        ),
    }
    for name, fn in fns.items():
        try:
            s = torch.full((1, 1, 1, 1, 1), 0.3, requires_grad=True)
            with ops.use_backend("fla"):
                o, _ = fn(s, torch.float32, "chunk")
            (ds,) = torch.autograd.grad((o.double() * w).sum(), s)
            s_r = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
            o_r, _ = fn(s_r, torch.float64, "recurrent")
            (ds_r,) = torch.autograd.grad((o_r * w).sum(), s_r)
            out[name] = {
                "shape": list(o.shape),
                "o": rel(o, o_r),
                "dscale": float(ds.sum()),
                "dscale_ref": float(ds_r),
            }
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


CASES = {"range_counter": case_range_counter, "one_value_scale_on_fla": case_one_value_scale_on_fla}


#: the child's cases (:func:`tests.ops.interpret_worker.shared_child`)
INTERPRETED = ("tests.ops.test_review5_backends", tuple(CASES))


@pytest.fixture(scope="module")
def interpreted(request):
    return shared_child(request, *INTERPRETED)


# ----------------------------------------------------------------------------------------------
# 1. the interpreter's loop counters: the type compiled Triton gives them
# ----------------------------------------------------------------------------------------------


@needs_fla
def test_interpreter_loop_counter_takes_the_bounds_type(interpreted):
    """Shim 2 (documented: "gives the loop counter the type compiled code gives it") yielded
    ``int32`` counters whatever the bounds' type; compiled Triton promotes the bounds' types, so a
    loop bounded by an ``int64`` scalar counts in ``int64``. Under the shim ``i + (2**31 - 1)``
    wrapped to ``-2**31`` at ``i = 1`` (compiled: ``2**31``). Python-int bounds stay ``int32``."""
    r = interpreted["range_counter"]
    assert "error" not in r, r.get("error")
    assert r["int64"] == [2147483647, 2147483648], r
    assert r["int32"] == [2147483646, 2147483647], r


# ----------------------------------------------------------------------------------------------
# 2. a one-value tensor scale of any shape
# ----------------------------------------------------------------------------------------------


@needs_fla
@pytest.mark.parametrize("name", ["gated_linear_attention", "gated_delta_rule"])
def test_one_value_scale_of_any_shape_on_fla(interpreted, name):
    """``default_scale`` accepts a tensor holding one value of any shape, but returned it as given,
    so ``q * scale`` broadcast ``q`` to 5-D for a ``[1, 1, 1, 1, 1]`` scale (fla's kernel then got a
    5-D ``q``). Now it is taken as a 0-d tensor: the output is ``[B, T, H, V]`` and agrees with
    the float64 token loop (relative RMS ≤ 2e-6), and so does the scale's gradient."""
    r = interpreted["one_value_scale_on_fla"][name]
    assert "error" not in r, r.get("error")
    assert r["shape"] == [1, 20, 2, 8], r
    assert r["o"] <= 2e-6, r
    assert abs(r["dscale"] - r["dscale_ref"]) <= 2e-6 * abs(r["dscale_ref"]), r


_SCALE_CALLS = {
    "gated_linear_attention": lambda q, k, v, g, beta, **kw: ops.gated_linear_attention(q, k, v, g, **kw),
    "gated_delta_rule": lambda q, k, v, g, beta, **kw: ops.gated_delta_rule(q, k, v, g, beta, **kw),
    "delta_rule": lambda q, k, v, g, beta, **kw: ops.delta_rule(q, k, v, beta, **kw),
    "linear_attention": lambda q, k, v, g, beta, **kw: ops.linear_attention(q, k, v, **kw),
    "linear_attention_elu": lambda q, k, v, g, beta, **kw: ops.linear_attention(
        q, k, v, feature_map="elu", **kw
    ),
}


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("name", sorted(_SCALE_CALLS))
def test_one_value_scale_of_any_shape(name, mode):
    """On mnemo's own forms the ``[1, 1, 1, 1, 1]`` scale raised an unnamed "too many values to
    unpack" (chunk) or returned a 5-D output silently (recurrent). Now every form equals the call
    with the float scale (float64: ≤ 1e-12), and the scale's gradient keeps the scale's shape."""
    q, k, v, g, beta, h0 = (t.double() for t in _matrix(seed=5, T=19))
    fn = _SCALE_CALLS[name]
    s = torch.full((1, 1, 1, 1, 1), 0.3, dtype=torch.float64, requires_grad=True)
    o, _ = fn(q, k, v, g, beta, scale=s, mode=mode)
    o_ref, _ = fn(q, k, v, g, beta, scale=0.3, mode=mode)
    assert o.shape == v.shape, f"output {list(o.shape)}, expected {list(v.shape)}"
    assert rel(o, o_ref) <= 1e-12
    o.sum().backward()
    assert s.grad is not None and s.grad.shape == s.shape


# ----------------------------------------------------------------------------------------------
# 3. tensors on another device than q / x
# ----------------------------------------------------------------------------------------------

_DEVICE_CALLS = {
    "gated_delta_rule": (
        ("k", "v", "g", "beta", "initial_state"),
        lambda t: ops.gated_delta_rule(
            t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"]
        ),
    ),
    "delta_rule": (
        ("beta", "initial_state"),
        lambda t: ops.delta_rule(t["q"], t["k"], t["v"], t["beta"], initial_state=t["initial_state"]),
    ),
    "gated_linear_attention": (
        ("k", "g", "initial_state"),
        lambda t: ops.gated_linear_attention(
            t["q"], t["k"], t["v"], t["g"], initial_state=t["initial_state"]
        ),
    ),
    "linear_attention": (
        ("v", "initial_state"),
        lambda t: ops.linear_attention(t["q"], t["k"], t["v"], initial_state=t["initial_state"]),
    ),
}


@pytest.mark.parametrize(
    "op, arg", [(op, a) for op, (args, _) in _DEVICE_CALLS.items() for a in args], ids=lambda x: str(x)
)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_an_input_on_another_device_is_refused_by_name(monkeypatch, op, arg, backend):
    """The table picks a backend by ``q``'s device alone. With ``q`` on the CPU and ``beta`` on
    ``meta``, ``gated_delta_rule``'s chunk form (native or torch) ran and returned values off by
    ~3e3 (the meta tensor read as uninitialised memory); forced onto fla under the interpreter, a
    meta ``initial_state`` reached the Triton kernel the same way; on a GPU machine a CPU tensor
    next to CUDA ones reaches a CUDA kernel (or a CUDA one the C kernels). Now a ``ValueError``
    names the op, the argument, the expected and the received device (T = 70: past one chunk)."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    q, k, v, g, beta, h0 = _matrix(seed=6, T=70)
    t = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    t[arg] = t[arg].to("meta")
    _, call = _DEVICE_CALLS[op]
    with ops.use_backend(backend), pytest.raises(ValueError) as err:
        call(t)
    msg = str(err.value)
    assert msg == f"{op}: {arg} must be on q's device cpu, got {arg} on meta", msg


@pytest.mark.parametrize("arg", ["dt", "A", "B", "C", "D", "dt_bias", "initial_state"])
def test_an_ssd_input_on_another_device_is_refused_by_name(monkeypatch, arg):
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    gen = torch.Generator().manual_seed(7)
    t = {
        "x": torch.randn(1, 70, 2, 3, generator=gen),
        "dt": torch.rand(1, 70, 2, generator=gen),
        "A": -torch.rand(2, generator=gen),
        "B": torch.randn(1, 70, 4, generator=gen),
        "C": torch.randn(1, 70, 4, generator=gen),
        "D": torch.randn(2, generator=gen),
        "dt_bias": torch.rand(2, generator=gen),
        "initial_state": torch.randn(1, 2, 4, 3, generator=gen),
    }
    t[arg] = t[arg].to("meta")
    with pytest.raises(ValueError) as err:
        ops.ssd(**t)
    assert str(err.value) == f"ssd: {arg} must be on x's device cpu, got {arg} on meta"


def test_all_inputs_on_meta_still_run_shapes_only(monkeypatch):
    """The device check compares devices only: a call with every tensor on ``meta`` still runs
    (shapes only), on every op with a backend table."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    q, k, v, g, beta, h0 = (t.to("meta") for t in _matrix(seed=8))
    o, S = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.device.type == "meta" and S.shape == h0.shape
    o, _ = ops.gated_linear_attention(q, k, v, g, initial_state=h0)
    assert o.shape == v.shape


# ----------------------------------------------------------------------------------------------
# 4. the mamba-ssm glue against an independent kernel (mamba-ssm is not installed here)
# ----------------------------------------------------------------------------------------------


def _scan_like_mamba(
    x, dt, A, B, C, chunk_size, initial_states=None, dt_limit=(0.0, float("inf")), return_final_states=False
):
    """``mamba_chunk_scan_combined``'s contract as a token loop: states ``[B, H, P, N]`` (mamba's
    layout), ``h_t = exp(dt_t A) h_{t−1} + (dt_t x_t) B_tᵀ``, ``y_t = h_t C_t``, head ``h`` reading
    group ``h // (H / G)``; no ``D``, no softplus, no clamp of ``dt · A``; ``dt`` clamped to
    ``dt_limit`` (mamba-ssm's default ``(0, inf)``; review 7 found the glue relying on it)."""
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


@pytest.mark.parametrize("softplus", [False, True])
def test_mamba_glue_against_the_token_loop(monkeypatch, softplus):
    """``ssd`` forced onto ``mamba_ssm`` with an independent kernel in mamba-ssm's place: the
    glue's layouts (``[B, H, N, P]`` ↔ ``[B, H, P, N]``), ``D`` on the unscaled ``x``, the bias and
    softplus before, and the clamp of ``dt · A`` at -60 (``dt' = -60 / A``, ``x' = x · dt / dt'``
    at tokens with ``dt = 200`` and ``80``) against the float64 token loop: output, final state and
    every input's gradient within 3e-6 relative RMS (measured ≤ 2e-7, and 1.2e-6 for ``dA``, four
    sums of large float32 terms: mnemo's own float32 chunk form is off by 8e-6 there)."""
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    monkeypatch.setattr(dispatch, "_device_problem", lambda device: None)
    monkeypatch.setattr(dispatch, "_import_problem", lambda backend: None)
    monkeypatch.setitem(_peer_ops._fns, "mamba_ssm", {"ssd": _scan_like_mamba})
    monkeypatch.setitem(_peer_ops._problems, "mamba_ssm", None)
    gen = torch.Generator().manual_seed(9)
    Bz, T, H, P, G, N = 2, 20, 4, 3, 2, 5
    d = {
        "x": torch.randn(Bz, T, H, P, generator=gen),
        "dt": torch.rand(Bz, T, H, generator=gen),
        "A": -torch.rand(H, generator=gen) - 0.5,
        "B": torch.randn(Bz, T, G, N, generator=gen),
        "C": torch.randn(Bz, T, G, N, generator=gen),
        "D": torch.randn(H, generator=gen),
        "dt_bias": torch.rand(H, generator=gen) * 0.1,
        "initial_state": torch.randn(Bz, H, N, P, generator=gen),
    }
    d["dt"][:, 7] = 200.0
    d["dt"][:, 12, 1] = 80.0
    w = torch.randn(Bz, T, H, P, generator=gen, dtype=torch.float64)
    wS = torch.randn(Bz, H, N, P, generator=gen, dtype=torch.float64)

    def run(backend, dtype, mode):
        xs = {n: t.to(dtype).clone().requires_grad_(True) for n, t in d.items()}
        with ops.use_backend(backend):
            y, S = ops.ssd(**xs, dt_softplus=softplus, output_final_state=True, mode=mode)
        loss = (y.double() * w).sum() + (S.double() * wS).sum()
        return y, S, dict(zip(xs, torch.autograd.grad(loss, list(xs.values()))))

    dispatch.reset_dispatch_log()
    y, S, g = run("mamba_ssm", torch.float32, "chunk")
    assert ("ssd", "mamba_ssm", "forced") in dispatch.dispatch_log()
    y_r, S_r, g_r = run("torch", torch.float64, "recurrent")
    errs = {"y": rel(y, y_r), "S": rel(S, S_r), **{f"d{n}": rel(g[n], g_r[n]) for n in g}}
    bad = {n: e for n, e in errs.items() if not e <= 3e-6}
    assert not bad, bad


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
