"""Sixth break-it review of the backend table (fourth of the peers' glue): the leftovers of the fifth
(``mnemo verify`` under a forced backend that served nothing; the dispatch log under
``torch.compile``) and what was found after them.

The interpreter cases run in a child process (``python -m tests.ops.test_review6_backends``) with
``TRITON_INTERPRET=1`` set before anything imports triton (see :mod:`tests.ops.interpret_worker`).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the child: Triton's interpreter, set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mnemo.ops as ops  # noqa: E402
from mnemo.ops import dispatch  # noqa: E402
from tests.ops.interpret_worker import run_cases, shared_child  # noqa: E402

PEERS = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not PEERS, reason="triton or fla-core not installed")


def _gdn_inputs(seed=0, B=1, T=8, H=1, K=4, V=4):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.1
    return q, k, v, g, beta


# ----------------------------------------------------------------------------------------------
# leftover 1: `MNEMO_BACKEND=fla mnemo verify` where fla cannot run said "all passed", exit 0
# ----------------------------------------------------------------------------------------------


def test_verify_says_nothing_was_verified_on_a_forced_backend_that_served_nothing(monkeypatch, capsys):
    """With fla-core not importable (simulated) every fast form was listed as n/a, the token-loop
    rows (which run on mnemo's PyTorch code) passed, and the run ended "all passed", exit 0: a CI
    job meant to check the fla kernels passed without running one. Now: a warning on stderr,
    "nothing verified on backend 'fla'" instead of "all passed", exit 3 (documented in --help)."""
    from mnemo.commands import verify

    monkeypatch.setenv("MNEMO_BACKEND", "fla")
    monkeypatch.setattr(dispatch, "_installed", lambda backend: "fla-core not installed")
    rc = verify.main(["--ops", "delta_rule", "--checks", "forms", "--quick", "--third-party", "none"])
    cap = capsys.readouterr()
    assert rc == 3, cap.out
    assert "all passed" not in cap.out
    assert "nothing verified on backend 'fla'" in cap.out
    assert "WARNING: nothing verified on backend 'fla'" in cap.err and "fla-core not installed" in cap.err
    assert "3 when a forced backend served none of the checked calls" in verify._DESCRIPTION


def test_verify_on_a_forced_backend_that_served_a_form_still_passes(monkeypatch, capsys):
    """The rule counts the calls the forced backend served (the dispatch log), not the n/a rows:
    ``MNEMO_BACKEND=torch`` serves every form, and exits 0 as before."""
    from mnemo.commands import verify

    monkeypatch.setenv("MNEMO_BACKEND", "torch")
    rc = verify.main(["--ops", "delta_rule", "--checks", "forms", "--quick", "--third-party", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all passed" in out and "nothing verified" not in out


# ----------------------------------------------------------------------------------------------
# leftover 2: calls inside torch.compile were missing from the dispatch log
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("forced", [None, "torch"])
def test_the_dispatch_log_counts_compiled_calls_when_traced(forced):
    """``dispatch_log`` skipped every call made inside a function compiled by ``torch.compile`` (the choice
    is made at trace time, and the counter was not touched while tracing): a compiled training run
    showed an empty log. Now each call is counted when traced, its reason prefixed ``compiled``
    (documented), and ``fullgraph=True`` still holds (the count runs outside the graph)."""
    q, k, v, g, beta = _gdn_inputs()

    def f(q, k, v, g, beta):
        o, _ = ops.gated_delta_rule(q, k, v, g, beta, mode="chunk")
        o, _ = ops.gated_delta_rule(o, k, v, g, beta, mode="chunk")
        return o

    torch._dynamo.reset()
    dispatch.reset_dispatch_log()
    with (
        ops.use_backend(forced)
        if forced
        else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    ):
        out = torch.compile(f, fullgraph=True, backend="eager")(q, k, v, g, beta)
    torch.testing.assert_close(out, f(q, k, v, g, beta), rtol=1e-5, atol=1e-6)
    log = dispatch.dispatch_log()
    compiled = {key: n for key, n in log.items() if key[2].startswith("compiled")}
    assert sum(compiled.values()) == 2, log  # two call sites, one trace
    ((op, backend, reason),) = compiled
    assert (op, backend) == ("gated_delta_rule", "torch")
    if forced:
        assert reason == "compiled; forced"
    else:  # auto on a CPU while tracing: the C kernels are skipped, and said so
        assert reason.startswith("compiled; native: torch.compile traces"), reason
    assert "compiled" in dispatch.dispatch_log.__doc__


# ----------------------------------------------------------------------------------------------
# the child's cases (TRITON_INTERPRET=1, float32 on the CPU)
# ----------------------------------------------------------------------------------------------


def case_transforms_on_fla() -> dict:
    """``torch.func`` transforms and forward-mode AD through ops forced onto fla, against the torch
    backend: the custom ops have no jvp rule (``jvp`` gave a tangent of zeros, a dual tensor's
    output no tangent) and their autograd formula raises under ``grad`` / ``jacrev``."""
    import torch.autograd.forward_ad as fwAD

    q, k, v, g, beta = _gdn_inputs(seed=1, B=1, T=12, H=1, K=4, V=4)
    tq = torch.randn_like(q)

    def gdn(q):
        return ops.gated_delta_rule(q, k, v, g, beta, mode="chunk")[0]

    def gla(q):
        return ops.gated_linear_attention(q, k, v, g, mode="chunk")[0]

    def la(q):
        return ops.linear_attention(q, k, v, mode="chunk")[0]

    def dual(fn, q):
        with fwAD.dual_level():
            t = fwAD.unpack_dual(fn(fwAD.make_dual(q, tq))).tangent
        return torch.zeros_like(q) if t is None else t

    runs = {
        "jvp_gated_delta_rule": lambda: torch.func.jvp(gdn, (q,), (tq,))[1],
        "jvp_gated_linear_attention": lambda: torch.func.jvp(gla, (q,), (tq,))[1],
        "jvp_linear_attention": lambda: torch.func.jvp(la, (q,), (tq,))[1],
        "dual_tensor": lambda: dual(gdn, q),
        "grad": lambda: torch.func.grad(lambda q: gdn(q).square().sum())(q),
        "jacrev": lambda: torch.func.jacrev(lambda q: gdn(q)[0, :3, 0, :2].reshape(-1))(q),
        "vmap": lambda: torch.vmap(lambda q: gdn(q[None])[0])(q[0][None].expand(2, -1, -1, -1)),
    }
    out = {}
    for name, run in runs.items():
        try:
            with ops.use_backend("fla"):
                t = run()
            out[name] = {"ran": True, "max_abs": float(t.abs().max())}
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


CASES = {"transforms_on_fla": case_transforms_on_fla}


#: the child's cases (:func:`tests.ops.interpret_worker.shared_child`)
INTERPRETED = ("tests.ops.test_review6_backends", tuple(CASES))


@pytest.fixture(scope="module")
def interpreted(request):
    return shared_child(request, *INTERPRETED)


# ----------------------------------------------------------------------------------------------
# torch.func transforms and forward-mode AD reached the peers' custom ops
# ----------------------------------------------------------------------------------------------


@needs_fla
def test_torch_func_transforms_are_refused_by_the_peers(interpreted):
    """``torch.func.jvp`` through an op forced onto fla returned a tangent of exactly zero (rel error
    1.0 against the torch backend; a dual tensor's output had no tangent at all), and
    ``torch.func.grad`` / ``jacrev`` raised an unnamed RuntimeError of ``autograd.Function``
    ("must override the setup_context staticmethod"); on CUDA ``auto`` chose fla for such calls,
    which mnemo's own forms support (documented). The table now refuses the peers under any
    ``torch.func`` transform and forward-mode AD, by name; ``auto`` falls back to mnemo's forms."""
    res = interpreted["transforms_on_fla"]
    assert set(res) == {
        "jvp_gated_delta_rule",
        "jvp_gated_linear_attention",
        "jvp_linear_attention",
        "dual_tensor",
        "grad",
        "jacrev",
        "vmap",
    }
    for name, r in res.items():
        err = r.get("error", "")
        assert err.startswith("BackendError") and "torch.func transform or forward-mode AD" in err, (name, r)


def _spy(monkeypatch):
    calls = []
    select = dispatch.select

    def spy(call):
        calls.append(call)
        return select(call)

    monkeypatch.setattr(dispatch, "select", spy)
    return calls


def _ops_calls(wrapped_arg, how):
    """Each public op with a peer, once, with a tangent (``how="dual"``) or under ``torch.func.grad``
    (``how="grad"``) on the argument ``wrapped_arg`` names."""
    import torch.autograd.forward_ad as fwAD

    q, k, v, g, beta = _gdn_inputs(seed=3)
    gen = torch.Generator().manual_seed(4)
    x, dt = torch.randn(1, 8, 2, 4, generator=gen), torch.rand(1, 8, 2, generator=gen)
    A = -torch.rand(2, generator=gen)
    Bm, Cm = torch.randn(1, 8, 4, generator=gen), torch.randn(1, 8, 4, generator=gen)
    args = {"q": q, "beta": beta, "scale": torch.tensor(0.5), "k": k, "g": g, "v": v, "dt": dt}

    def body(t):
        a = {**args, wrapped_arg: t}
        out = ops.gated_delta_rule(a["q"], k, v, g, a["beta"], scale=a["scale"])[0].sum()
        out = out + ops.delta_rule(q, a["k"], v, beta)[0].sum()
        out = out + ops.gated_linear_attention(q, k, v, a["g"])[0].sum()
        out = out + ops.linear_attention(q, k, a["v"])[0].sum()
        return out + ops.ssd(x, a["dt"], A, Bm, Cm)[0].sum()

    t = args[wrapped_arg]
    if how == "grad":
        torch.func.grad(body)(t)
    else:
        with fwAD.dual_level():
            body(fwAD.make_dual(t, torch.ones_like(t)))


@pytest.mark.parametrize("how", ["dual", "grad"])
@pytest.mark.parametrize("wrapped_arg", ["q", "beta", "scale", "k", "g", "v", "dt"])
def test_the_ops_tell_the_table_about_transforms(monkeypatch, wrapped_arg, how):
    """Every public op with a peer passes ``transformed`` (a transform sees any of its tensors, a
    tensor ``scale`` included) to the table, and ``auto`` on CUDA then keeps the call off the peers."""
    calls = _spy(monkeypatch)
    _ops_calls(wrapped_arg, how)
    ops_order = ["gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention", "ssd"]
    calls = calls[:5]  # (under a transform ssd runs gated linear attention inside: a sixth call)
    assert [c.op for c in calls] == ops_order
    owner = {"q": 0, "beta": 0, "scale": 0, "k": 1, "g": 2, "v": 3, "dt": 4}[wrapped_arg]
    assert [c.transformed for c in calls] == [i == owner for i in range(5)]
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    monkeypatch.setattr(dispatch, "_device_problem", lambda device: None)
    monkeypatch.setattr(dispatch, "_import_problem", lambda backend: None)
    for c in calls:
        cuda = dispatch.Call(
            c.op, torch.device("cuda"), c.dtypes, "chunk", c.T, c.K, c.varlen, c.V, c.transformed
        )
        assert (dispatch.select(cuda) == "torch") == c.transformed, c


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
