"""Break-it review of the backends: the dispatch table, the native kernels' switch and loading, the
peer adapters, the workspace cache and ``small_mm`` (cases that failed before their fix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mnemo.ops as ops
from mnemo.ops import _native, _peer_ops, dispatch
from tests.helpers import spy_native_calls

needs_native = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    monkeypatch.delenv("MNEMO_NATIVE", raising=False)


# ----------------------------------------------------------------------------------------------
# MNEMO_NATIVE: a typo must not leave the kernels on silently
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["O", "disable", "fasle", "2"])
def test_an_unknown_mnemo_native_value_is_refused(clean_env, monkeypatch, value):
    monkeypatch.setenv("MNEMO_NATIVE", value)
    with pytest.raises(ValueError, match=rf"MNEMO_NATIVE must be one of .*got '{value}'"):
        _native.enabled()


@pytest.mark.parametrize(
    "value, on",
    [("0", False), ("false", False), ("Off", False), (" no ", False), ("1", True), ("yes", True), ("", True)],
)
def test_the_known_mnemo_native_values(clean_env, monkeypatch, value, on):
    monkeypatch.setenv("MNEMO_NATIVE", value)
    assert _native.enabled() is on


# ----------------------------------------------------------------------------------------------
# the peers' import under torch.compile: the first call of a process imports under a lock
# ----------------------------------------------------------------------------------------------


def test_the_first_peer_import_of_a_process_runs_outside_a_compiled_graph(clean_env, monkeypatch):
    """A fresh process whose first peer-backed call is compiled (``mnemo train --compile`` on a
    GPU) imported the peer inside dynamo's trace: ``with _import_lock`` cannot be traced (a graph
    break; ``fullgraph=True`` raised ``Unsupported: ... lock context manager``). Simulated here
    with a cheap entry point in place of fla's kernels."""
    monkeypatch.setattr(_peer_ops, "_ENTRY", {"fla": {"sqrt": ("math", "sqrt")}})
    monkeypatch.setattr(_peer_ops, "_problems", {})
    monkeypatch.setattr(_peer_ops, "_fns", {})

    def f(x):
        return x + (1.0 if dispatch._import_problem("fla") is None else 2.0)

    torch._dynamo.reset()
    try:
        out = torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2))
    finally:
        torch._dynamo.reset()
    assert out.tolist() == [1.0, 1.0]
    assert _peer_ops._problems == {"fla": None}


# ----------------------------------------------------------------------------------------------
# the torch backend's backward (xfail: the fix belongs in the ops' autograd Functions)
# ----------------------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("op", ["gated_delta_rule", "gated_linear_attention", "ssd"])
def test_mnemo_backend_torch_keeps_the_c_kernels_out_of_the_backward(clean_env, monkeypatch, op):
    """``MNEMO_BACKEND=torch`` (documented: mnemo's PyTorch forms; ``use_backend``: "a backward pass
    runs the backward of whatever its forward ran") ran the C kernel ``scan_mat_bwd`` /
    ``scan_dec_bwd`` in the backward of a forward that ran none; the same backward with the kernels
    on does run them (the spy sees them), and both give the same gradient."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 20, 1, 4
    q = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    A = -torch.rand(H, generator=gen) - 0.5

    def run():
        q.grad = None
        if op == "gated_delta_rule":
            o, _ = ops.gated_delta_rule(q, k, v, g, beta, chunk_size=4)
        elif op == "gated_linear_attention":
            o, _ = ops.gated_linear_attention(q, k, v, g[..., None].expand(B, T, H, K), chunk_size=4)
        else:
            o, _ = ops.ssd(v, beta, A, k, q, chunk_size=4)
        return o

    calls = spy_native_calls(monkeypatch)
    o = run()
    o.sum().backward()
    assert calls, "with the kernels on, the backward runs one (else this test sees nothing)"
    want = q.grad.clone()
    monkeypatch.setenv("MNEMO_BACKEND", "torch")
    calls.clear()
    o = run()
    assert calls == []
    o.sum().backward()
    assert calls == [], f"the torch backend's backward ran C kernels: {calls}"
    torch.testing.assert_close(q.grad, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the peers on calls without elements (fla's delta rule divides by the number of heads)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's entry points replaced by one that fails as ``chunk_gated_delta_rule`` does on ``H = 0``
    (``HV % H``), recording its calls."""
    calls = []

    def fake(q, k, v, *args, **kwargs):
        calls.append(tuple(q.shape))
        q.shape[2] % q.shape[2]  # ZeroDivisionError for H = 0, as fla's HV % H
        return torch.zeros(*q.shape[:3], v.shape[-1]), None

    monkeypatch.setattr(_peer_ops, "_problems", {"fla": None})
    monkeypatch.setattr(
        _peer_ops, "_fns", {"fla": dict.fromkeys(("gated_delta_rule", "simple_gla", "gla"), fake)}
    )
    return calls


@pytest.mark.parametrize("shape", [(1, 5, 0, 4, 3), (0, 5, 2, 4, 3), (1, 5, 2, 4, 0)], ids=["H0", "B0", "V0"])
@pytest.mark.parametrize(
    "op", ["delta_rule", "gated_delta_rule", "gated_linear_attention", "linear_attention"]
)
def test_peer_custom_ops_on_calls_without_elements(fake_fla, op, shape):
    """``H = 0`` reached fla's ``chunk_gated_delta_rule`` (auto picks fla on CUDA for it), which
    raised ``ZeroDivisionError: integer modulo by zero``; now no kernel is asked, the output and the
    state are empty (zeros) and the backward gives empty gradients."""
    B, T, H, K, V = shape
    q, k = torch.randn(B, T, H, K, requires_grad=True), torch.randn(B, T, H, K, requires_grad=True)
    v = torch.randn(B, T, H, V, requires_grad=True)
    g = torch.zeros(B, T, H, requires_grad=True)
    beta = torch.rand(B, T, H)
    if op == "delta_rule":
        o, S = _peer_ops.delta_rule_fla(q, k, v, beta, None, None, 0.5, True)
    elif op == "gated_delta_rule":
        o, S = _peer_ops.gated_delta_rule_fla(q, k, v, g, beta, None, None, 0.5, True)
    elif op == "gated_linear_attention":
        o, S = _peer_ops.gated_linear_attention_fla(q, k, v, g, None, None, 0.5, True)
    else:
        o, S = _peer_ops.linear_attention_fla(q, k, v, None, None, 0.5, True)
    assert fake_fla == []
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V) and S.dtype == torch.float32
    assert o.numel() == 0 and S.numel() == 0
    (o.sum() + S.sum()).backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_peer_custom_op_with_elements_still_calls_the_kernel(fake_fla):
    q = torch.randn(1, 5, 2, 4)
    o, S = _peer_ops.gated_linear_attention_fla(q, q, q, None, None, None, 0.5, False)
    assert fake_fla == [(1, 5, 2, 4)] and o.shape == (1, 5, 2, 4) and S.numel() == 0


def test_mamba_custom_op_on_a_call_without_elements(monkeypatch):
    calls = []
    monkeypatch.setattr(_peer_ops, "_problems", {"mamba_ssm": None})
    monkeypatch.setattr(_peer_ops, "_fns", {"mamba_ssm": {"ssd": lambda *a, **k: calls.append(a) or 1 % 0}})
    x = torch.randn(1, 5, 0, 3, requires_grad=True)
    dt, A = torch.rand(1, 5, 0), -torch.rand(0)
    Bm = torch.randn(1, 5, 1, 4, requires_grad=True)
    y, S = _peer_ops.ssd_mamba_ssm(x, dt, A, Bm, Bm, None, 64, True)
    assert calls == [] and y.shape == x.shape and S.shape == (1, 0, 4, 3)
    (y.sum() + S.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(Bm.grad, torch.zeros_like(Bm))


def test_the_gpu_suites_peer_cases_name_real_specs():
    """tests/test_cuda.py compares each peer kernel with the torch backend for the specs its
    SPEC_OP names; a name matching no spec drops the case silently (``gla_none`` did, and the
    alias ``linear_attention``: the ungated GLA and linear attention never ran against fla on a
    GPU). Read from the file: the module skips without CUDA."""
    import ast
    from pathlib import Path

    from mnemo.testing.specs import SPECS

    tree = ast.parse((Path(__file__).parents[1] / "test_cuda.py").read_text())
    (table,) = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SPEC_OP"
    ]
    names = {ast.literal_eval(k) for k in table.keys}
    known = {s.name for s in SPECS}  # what the table is matched against (not the aliases)
    assert names <= known, sorted(names - known)


@needs_native
def test_a_compiled_chunk_form_leaves_the_native_switch_as_it_found_it(clean_env):
    """The backward's ``suppressed()`` block (``native_as_in_forward``) traced by dynamo ran its
    entry without its exit: after a compiled model's step the kernels stayed off in the thread for
    good (the compile tests then skipped as "native kernels unavailable")."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 12, 2, 4, generator=gen, requires_grad=True)
    dt = torch.randn(1, 12, 2, generator=gen)
    B, C = (torch.randn(1, 12, 1, 3, generator=gen) for _ in range(2))
    A = -torch.rand(2, generator=gen) - 0.5

    def step(x):
        o, _ = ops.ssd(x, dt, A, B, C, chunk_size=4)
        return o.square().sum()

    torch.compile(step, backend="aot_eager")(x).backward()
    assert getattr(_native._suppressed, "depth", 0) == 0 and _native.enabled()
