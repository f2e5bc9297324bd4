"""The Triton backends (fla, mamba_ssm) under Triton's interpreter, run in a child process.

``python -m tests.ops.interpret_worker [case ...]`` runs the cases below with
``TRITON_INTERPRET=1`` (set here, before anything imports triton: ``@triton.jit`` picks the
interpreter when a kernel module is imported, so a process that already imported fla-core without
the variable cannot switch) and prints one JSON object ``{case: result}``. Each parity case runs
an op forced onto a peer backend, onto the ``torch`` backend and as the token-loop reference
(``mode="recurrent"``, float64: the independent computation), in float32, and reports the relative
RMS error (``rms(a − b) / rms(b)``) of the output, the final state and the gradient of every input
against both. ``tests/ops/test_backends_interpret.py`` runs this once and asserts on the results.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # (imported by the test module: the parent's environment is left alone)
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mnemo.ops as ops  # noqa: E402
from mnemo.ops import dispatch  # noqa: E402

torch.set_num_threads(1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    den = b.square().mean().sqrt().item()
    return (a - b).square().mean().sqrt().item() / max(den, 1e-30)


def _run(fn, inputs: dict, backend: str | None, dtype=torch.float32, **kw):
    """``fn(**inputs, **kw)`` on copies of the float inputs that require grad; returns the
    output, the final state and the gradients of a fixed random projection of both."""
    xs = {
        n: (
            t.to(dtype).clone().requires_grad_(True)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t
        )
        for n, t in inputs.items()
    }
    ctx = (
        ops.use_backend(backend)
        if backend
        else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    )
    with ctx:
        o, S = fn(**xs, **kw)
    gen = torch.Generator().manual_seed(123)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
    if S is not None:
        loss = loss + (S.double() * torch.randn(S.shape, generator=gen, dtype=torch.float64)).sum()
    wrt = {n: t for n, t in xs.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return (
        o.detach(),
        (None if S is None else S.detach()),
        {n: (torch.zeros_like(t) if g is None else g) for (n, t), g in zip(wrt.items(), grads)},
    )


def parity(fn, inputs, backend, **kw) -> dict:
    """Errors of ``backend`` against the torch backend and the float64 token loop."""
    t0 = time.perf_counter()
    o, S, g = _run(fn, inputs, backend, **kw)
    seconds = time.perf_counter() - t0
    o_t, S_t, g_t = _run(fn, inputs, "torch", **kw)
    ref_kw = dict(kw, mode="recurrent")
    o_r, S_r, g_r = _run(fn, inputs, "torch", dtype=torch.float64, **ref_kw)
    out = {"seconds": round(seconds, 2), "vs_torch": {}, "vs_reference": {}}
    for key, (a, b, c) in {"o": (o, o_t, o_r), "state": (S, S_t, S_r)}.items():
        if a is not None:
            out["vs_torch"][key], out["vs_reference"][key] = rel(a, b), rel(a, c)
    for n in g:
        out["vs_torch"][f"d{n}"], out["vs_reference"][f"d{n}"] = rel(g[n], g_t[n]), rel(g[n], g_r[n])
    out["finite"] = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(x).all()) for x in g.values())
    out["log"] = [list(k) for k in dispatch.dispatch_log() if k[1] == backend and k[2] == "forced"]
    return out


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def matrix_inputs(B=2, T=40, H=2, K=16, V=16, *, gate="scalar", h0=True, seed=0, N=None):
    gen = _gen(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    d = {"q": q, "k": k, "v": v}
    if gate == "scalar":
        d["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
    elif gate == "channel":
        d["g"] = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
    if h0:
        d["initial_state"] = torch.randn(N or B, H, K, V, generator=gen)
    return d


def with_beta(d, seed=1):
    B, T, H = d["q"].shape[:3]
    d["beta"] = torch.rand(B, T, H, generator=_gen(seed)) * 0.9 + 0.1
    return d


def hard_resets(d):
    g = d["g"].clone()
    g[:, 5] = float("-inf")  # a hard reset
    g[:, 17] = -1e4  # a very negative log-gate
    g[:, 30] = -75.0  # below the clamp
    d["g"] = g
    return d


def ssd_inputs(B=1, T=40, H=4, P=8, G=2, N=16, *, seed=0, strong=False):
    gen = _gen(seed)
    d = {
        "x": torch.randn(B, T, H, P, generator=gen),
        "dt": torch.randn(B, T, H, generator=gen),
        "A": -torch.rand(H, generator=gen) - 0.5,
        "B": torch.randn(B, T, G, N, generator=gen),
        "C": torch.randn(B, T, G, N, generator=gen),
        "D": torch.randn(H, generator=gen),
        "dt_bias": torch.randn(H, generator=gen) * 0.1,
        "initial_state": torch.randn(B, H, N, P, generator=gen),
    }
    if strong:  # a positive step (no softplus in this case), dt · A far below the clamp at a few tokens
        d["dt"] = F.softplus(d["dt"])
        d["dt"][:, 7] = 200.0
        d["dt"][:, 21] = 80.0
    return d


def _cu(*lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# cases: name -> callable returning a JSON-able dict
# ----------------------------------------------------------------------------------------------

GDN = ops.gated_delta_rule


def _gdn(**kw):
    return lambda **x: GDN(**x, **kw)


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def gdn_state_scale():
    d = with_beta(matrix_inputs(T=80))
    return parity(ops.gated_delta_rule, d, "fla", scale=0.3, output_final_state=True)


@case
def gdn_hard_reset():
    d = hard_resets(with_beta(matrix_inputs()))
    return parity(ops.gated_delta_rule, d, "fla", output_final_state=True)


@case
def gdn_varlen():
    d = with_beta(matrix_inputs(B=1, T=40, N=4, seed=3))
    return parity(ops.gated_delta_rule, d, "fla", output_final_state=True, cu_seqlens=_cu(7, 0, 20, 13))


@case
def gdn_no_state():
    d = with_beta(matrix_inputs(h0=False, seed=4))
    return parity(ops.gated_delta_rule, d, "fla")


@case
def delta_rule_state():
    d = with_beta(matrix_inputs(gate=None, seed=5))
    return parity(ops.delta_rule, d, "fla", output_final_state=True)


@case
def gla_scalar_reset():
    d = hard_resets(matrix_inputs(seed=6))
    return parity(ops.gated_linear_attention, d, "fla", output_final_state=True, scale=0.5)


@case
def gla_channel_reset():
    d = matrix_inputs(gate="channel", seed=7)
    g = d["g"].clone()
    g[:, 5, :, :3] = float("-inf")
    g[:, 17] = -1e4
    d["g"] = g
    return parity(ops.gated_linear_attention, d, "fla", output_final_state=True)


@case
def gla_no_gate_varlen():
    d = matrix_inputs(B=1, gate=None, N=3, seed=8)
    d["g"] = None
    return parity(ops.gated_linear_attention, d, "fla", output_final_state=True, cu_seqlens=_cu(11, 25, 4))


@case
def linear_attention_identity():
    d = matrix_inputs(gate=None, seed=9)
    return parity(ops.linear_attention, d, "fla", output_final_state=True)


@case
def linear_attention_elu_normalize():
    d = matrix_inputs(gate=None, seed=10, h0=False)
    B, T, H, K = d["q"].shape
    d["initial_state"] = torch.rand(B, H, K, d["v"].shape[-1] + 1, generator=_gen(11))
    return parity(ops.linear_attention, d, "fla", output_final_state=True, feature_map="elu", normalize=True)


@case
def ssd_fla():
    d = ssd_inputs(seed=12)
    return parity(ops.ssd, d, "fla", output_final_state=True, dt_softplus=True)


@case
def ssd_mamba():
    d = ssd_inputs(seed=13)
    return parity(ops.ssd, d, "mamba_ssm", output_final_state=True, dt_softplus=True)


@case
def ssd_mamba_clamped():
    d = ssd_inputs(seed=14, strong=True)
    return parity(ops.ssd, d, "mamba_ssm", output_final_state=True, dt_softplus=False)


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


@case
def refusals():
    """What a forced peer refuses (BackendError with the reason), and what auto picks on a CPU."""
    d = with_beta(matrix_inputs(T=8, h0=False))
    out = {}
    with ops.use_backend("fla"):
        out["recurrent"] = _raises(lambda: GDN(**d, mode="recurrent"))
        out["parallel"] = _raises(
            lambda: ops.gated_linear_attention(d["q"], d["k"], d["v"], d["g"], mode="parallel")
        )
        out["float64"] = _raises(lambda: GDN(**{n: t.double() for n, t in d.items()}))
        out["bfloat16"] = _raises(lambda: GDN(**{n: t.bfloat16() for n, t in d.items()}))
        out["selective_scan_untouched"] = _raises(
            lambda: ops.selective_scan(
                torch.randn(1, 8, 4),
                torch.rand(1, 8, 4),
                -torch.rand(4, 3),
                torch.randn(1, 8, 3),
                torch.randn(1, 8, 3),
            )
        )
    with ops.use_backend("mamba_ssm"):
        out["mamba_gdn"] = _raises(lambda: GDN(**d))
        s = ssd_inputs(T=8)
        out["mamba_varlen"] = _raises(
            lambda: ops.ssd(**{n: t for n, t in s.items() if n != "initial_state"}, cu_seqlens=_cu(3, 5))
        )
    dispatch.reset_dispatch_log()
    GDN(**d)
    GDN(**d, mode="recurrent")
    out["auto_on_cpu"] = [list(k) for k in dispatch.dispatch_log()]
    # create_graph through the peer's backward
    x = {n: t.clone().requires_grad_(True) for n, t in d.items()}
    with ops.use_backend("fla"):
        o, _ = GDN(**x)

    def second_order():
        (gq,) = torch.autograd.grad(o.sum(), x["q"], create_graph=True)
        gq.sum().backward()

    out["create_graph"] = _raises(second_order)
    return out


@case
def shims():
    """The interpreter shims on two small kernels of our own: an autotuned kernel with two
    configurations (timed through a GPU driver without shim 1) and a ``range`` loop whose counter
    is used as a Triton scalar (``i.to(tl.int64)``: a Python int without shim 2)."""
    import triton
    import triton.language as tl

    from mnemo.ops import _triton_interpret

    installed = _triton_interpret.install()

    @triton.autotune(configs=[triton.Config({"BLOCK": 8}), triton.Config({"BLOCK": 16})], key=["n"])
    @triton.jit
    def cumulative(x_ptr, y_ptr, n, NB: tl.constexpr, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(NB):
            offs = i.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(y_ptr + tl.arange(0, BLOCK), acc)

    x = torch.arange(32, dtype=torch.float32)
    y = torch.zeros(8)
    cumulative[(1,)](x, y, 32, NB=4)  # the first configuration (BLOCK 8) is kept: 4 blocks of 8
    return {"installed": list(installed), "sum_ok": bool(torch.equal(y, x.view(4, 8).sum(0)))}


@case
def opcheck():
    """``torch.library.opcheck`` (schema, fake kernel, autograd registration, AOT dispatch) on
    one fla op and the mamba-ssm op, tiny shapes."""
    from mnemo.ops import _peer_ops

    out = {}
    gen = _gen(20)
    B, T, H, K = 1, 12, 1, 16
    q = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).requires_grad_(True)
    v = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen)).requires_grad_(True)
    beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
    h0 = torch.randn(B, H, K, K, generator=gen, requires_grad=True)
    _peer_ops.import_problem("fla")
    res = torch.library.opcheck(
        torch.ops.mnemo.gated_delta_rule_fla.default, (q, k, v, g, beta, h0, None, 0.25, True)
    )
    out["gated_delta_rule_fla"] = res
    if importlib.util.find_spec("mamba_ssm") is None:
        return out
    x = torch.randn(1, T, 2, 4, generator=gen, requires_grad=True)
    dt = (torch.rand(1, T, 2, generator=gen) * 0.5).requires_grad_(True)
    A = (-torch.rand(2, generator=gen) - 0.5).requires_grad_(True)
    Bm = torch.randn(1, T, 1, 16, generator=gen, requires_grad=True)
    Cm = torch.randn(1, T, 1, 16, generator=gen, requires_grad=True)
    s0 = torch.randn(1, 2, 16, 4, generator=gen, requires_grad=True)
    out["ssd_mamba_ssm"] = torch.library.opcheck(
        torch.ops.mnemo.ssd_mamba_ssm.default,
        (x, dt, A, Bm, Cm, s0, 16, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    return out


@case
def compiled():
    """The public op, forced onto fla, compiled with ``fullgraph=True`` (a graph break raises)."""
    d = with_beta(matrix_inputs(B=1, T=16, H=1, h0=True, seed=21))

    def f(q, k, v, g, beta, initial_state):
        with ops.use_backend("fla"):
            return GDN(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    o, S = cf(**d)
    o2, S2 = f(**d)
    return {"o": rel(o, o2), "state": rel(S, S2)}


def _results(cases: dict, names, timed: bool) -> dict:
    """``{case: result or {"error": traceback}}`` for ``names`` (default all) of ``cases``; with
    ``timed``, each result also holds its ``case_seconds``."""
    results = {}
    for name in names or cases:
        t0 = time.perf_counter()
        try:
            results[name] = cases[name]()
        except Exception:  # noqa: BLE001 (reported to the test)
            results[name] = {"error": traceback.format_exc()[-3000:]}
        if timed:
            results[name]["case_seconds"] = (
                round(time.perf_counter() - t0, 2) if isinstance(results[name], dict) else 0
            )
    return results


def main(names) -> None:
    print("JSON:" + json.dumps(_results(CASES, names, timed=True), default=str))


def run_cases(cases: dict, names) -> None:
    """The child's body for a test module's own interpreter cases: run ``names`` (default all) of
    ``cases`` (one thread), print ``JSON:`` and the ``{case: result or {"error": traceback}}`` object
    (:func:`run_child` reads it)."""
    torch.set_num_threads(1)
    print("JSON:" + json.dumps(_results(cases, names, timed=False), default=str))


def main_modules(wanted: dict[str, list[str]]) -> None:
    """The shared child's body (:func:`shared_child`): for each module in order, its cases as its own
    child ran them (this module's as :func:`main`, another's ``CASES`` as :func:`run_cases`); prints
    ``JSON:`` and ``{module: {case: result}}``."""
    out = {}
    for module, names in wanted.items():
        if module == "tests.ops.interpret_worker":
            out[module] = _results(CASES, names, timed=True)
            continue
        try:
            cases = importlib.import_module(module).CASES
        except Exception:  # noqa: BLE001 (each case of the module reports it)
            error = traceback.format_exc()[-3000:]
            out[module] = {name: {"error": error} for name in names}
            continue
        out[module] = _results(cases, names, timed=False)
    print("JSON:" + json.dumps(out, default=str))


def run_child(module: str, cases) -> dict:
    """``python -m module case ...`` in a child process with ``TRITON_INTERPRET=1`` (one thread,
    the repository on the path, no ``MNEMO_BACKEND``), and the ``{case: result}`` object it prints
    after ``JSON:``; asserts that the child succeeded (its stderr's tail in the message)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("MNEMO_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", module, *cases], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("JSON:")), None)
    assert proc.returncode == 0 and line, f"child failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(line[5:])


#: the shared child's results in this pytest process, by module
_shared: dict[str, dict] = {}


def shared_child(request, module: str, names) -> dict:
    """The results of ``module``'s interpreter cases ``names``, from one child process for every
    test module of the session that declares its cases (a module-level ``INTERPRETED = (module,
    names)``): the first module's fixture runs the cases of all those with tests in the session
    (this module's own first, then the others by name) in one ``python -m
    tests.ops.interpret_worker --modules``, so torch, triton and fla-core are imported once (~7 s a
    child, measured) instead of once per module; each module's cases run as in a child of its own
    (:func:`main_modules`). tests/conftest.py runs these modules on one xdist worker."""
    if module not in _shared:
        wanted = {module: list(names)}
        for item in request.session.items:
            spec = getattr(getattr(item, "module", None), "INTERPRETED", None)
            if spec is not None and spec[0] not in _shared:
                wanted.setdefault(spec[0], list(spec[1]))
        order = sorted(wanted, key=lambda m: (m != "tests.ops.interpret_worker", m))
        spec = json.dumps({m: wanted[m] for m in order})
        _shared.update(run_child("tests.ops.interpret_worker", ["--modules", spec]))
    return _shared[module]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--modules"]:
        main_modules(json.loads(sys.argv[2]))
    else:
        main(sys.argv[1:])
