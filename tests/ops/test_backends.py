"""The ops' backend table (:mod:`mnemo.ops.dispatch`) in this process, without Triton's interpreter:
the table, forcing (``use_backend``, ``MNEMO_BACKEND``) and its errors, ``auto`` on a CPU (as
before the table: native, else torch), the torch backend with the C kernels off, the peers absent
(simulated), meta tensors and ``FakeTensorMode`` through the custom ops, and ``mnemo info``.
The peers' kernels themselves run in :mod:`tests.ops.test_backends_interpret`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mnemo.ops as ops
from mnemo.ops import _native, _peer_ops, dispatch
from tests.helpers import assert_close, spy_native_calls


def _gdn_inputs(B=1, T=20, H=2, K=8, V=8, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
    beta = torch.rand(B, T, H, generator=gen)
    return [t.to(device) for t in (q, k, v, g, beta)]


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    dispatch.reset_dispatch_log()


def test_table_has_one_row_per_op_and_backend(no_interpreter):
    rows = ops.backends("cpu")
    assert [(r.op, r.backend) for r in rows] == [(o, b) for o in dispatch.OPS for b in dispatch.BACKENDS]
    by = {(r.op, r.backend): r for r in rows}
    for op in dispatch.OPS:
        assert by[(op, "torch")].available
        assert by[(op, "native")].available == (_native.library() is not None)
        fla = by[(op, "fla")]
        assert not fla.available and fla.reason, fla
        assert "TRITON_INTERPRET=1" in fla.reason or "not installed" in fla.reason
    for op in ("gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention"):
        assert by[(op, "mamba_ssm")].reason == f"mamba-ssm has no kernel for {op}"
    text = dispatch.format_table(rows)
    assert len(text.splitlines()) == 1 + len(rows)


def test_table_on_cuda_without_cuda_says_so(no_interpreter, monkeypatch):
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    rows = {(r.op, r.backend): r for r in ops.backends("cuda")}
    if not torch.cuda.is_available():
        assert rows[("gated_delta_rule", "fla")].reason == "no CUDA"
        assert rows[("ssd", "mamba_ssm")].reason == "no CUDA"
        assert "CPU-only" in rows[("ssd", "native")].reason


def test_interpreter_makes_the_peers_available_on_cpu(no_interpreter, monkeypatch):
    """With ``TRITON_INTERPRET=1`` the peers serve CPU calls (here their import is stubbed: the
    real import runs in the interpreter tests' child process)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    monkeypatch.setattr(dispatch, "_import_problem", lambda backend: None)
    by = {(r.op, r.backend): r for r in ops.backends("cpu")}
    assert all(by[(op, "fla")].available for op in dispatch.OPS)
    assert by[("ssd", "mamba_ssm")].available
    # ... and auto still prefers mnemo's own forms on a CPU
    q, k, v, g, beta = _gdn_inputs()
    ops.gated_delta_rule(q, k, v, g, beta)
    assert [key[1] for key in ops.dispatch_log()] == ["native" if _native.library() is not None else "torch"]


def test_auto_on_cpu_is_unchanged(no_interpreter):
    q, k, v, g, beta = _gdn_inputs()
    o, S = ops.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    o_r, S_r = ops.gated_delta_rule(q, k, v, g, beta, output_final_state=True, mode="recurrent")
    assert_close(o, o_r, 1e-5)
    assert_close(S, S_r, 1e-5)
    log = ops.dispatch_log()
    first = "native" if _native.library() is not None else "torch"
    assert log[("gated_delta_rule", first, "" if first == "native" else next(iter(log))[2])] == 1
    assert any(key[1] == "torch" and "mode='recurrent'" in key[2] for key in log)


def test_forced_torch_turns_the_c_kernels_off(no_interpreter, monkeypatch):
    if _native.library() is None:
        pytest.skip("no C compiler: the native kernels are unavailable here")
    calls = spy_native_calls(monkeypatch)
    q, k, v, g, beta = _gdn_inputs(T=70)
    o_auto, _ = ops.gated_delta_rule(q, k, v, g, beta)
    assert calls, "auto on a CPU should have used a C kernel"
    calls.clear()
    with ops.use_backend("torch"):
        o_torch, _ = ops.gated_delta_rule(q, k, v, g, beta)
    assert not calls, f"the torch backend ran C kernels: {calls}"
    assert_close(o_torch, o_auto, 1e-5)


@pytest.mark.parametrize(
    "backend, mode, words",
    [
        ("native", "recurrent", ("gated_delta_rule", "'native'", "mode='recurrent'")),
        ("fla", "chunk", ("gated_delta_rule", "'fla'", "")),
        ("mamba_ssm", "chunk", ("gated_delta_rule", "'mamba_ssm'", "no kernel")),
    ],
)
def test_forcing_a_backend_that_cannot_serve_raises(no_interpreter, backend, mode, words):
    q, k, v, g, beta = _gdn_inputs()
    with ops.use_backend(backend), pytest.raises(ops.BackendError) as err:
        ops.gated_delta_rule(q, k, v, g, beta, mode=mode)
    for w in words:
        assert w in str(err.value)
    assert "cannot serve this call" in str(err.value)


def test_environment_variable_and_nesting(no_interpreter, monkeypatch):
    q, k, v, g, beta = _gdn_inputs()
    monkeypatch.setenv("MNEMO_BACKEND", "mamba_ssm")
    assert ops.current_backend() == "mamba_ssm"
    with pytest.raises(ops.BackendError, match="mamba_ssm"):
        ops.gated_delta_rule(q, k, v, g, beta)
    with ops.use_backend("torch"):  # the block wins over the variable
        assert ops.current_backend() == "torch"
        with ops.use_backend("auto"):
            assert ops.current_backend() == "auto"
            ops.gated_delta_rule(q, k, v, g, beta)
        assert ops.current_backend() == "torch"
    assert ops.current_backend() == "mamba_ssm"
    monkeypatch.setenv("MNEMO_BACKEND", "cuda")
    with pytest.raises(
        ValueError, match="MNEMO_BACKEND must be one of auto, torch, native, fla, mamba_ssm, got 'cuda'"
    ):
        ops.gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(ValueError, match="backend must be one of"):
        with ops.use_backend("triton"):
            pass


def test_ops_without_a_peer_ignore_the_table(no_interpreter):
    x = torch.randn(1, 6, 2, 4)
    with ops.use_backend("fla"):
        ops.softmax_attention(x, x, x)
        ops.selective_scan(
            torch.randn(1, 6, 4),
            torch.rand(1, 6, 4),
            -torch.rand(4, 3),
            torch.randn(1, 6, 3),
            torch.randn(1, 6, 3),
        )


def test_peers_absent(no_interpreter, monkeypatch):
    """Without triton/fla-core/mamba-ssm (simulated): the table says so, auto is unaffected and a
    forced peer raises with the reason; mnemo itself never imports them."""
    monkeypatch.setattr(dispatch, "_installed", lambda backend: "triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = {(r.op, r.backend): r for r in ops.backends("cpu")}
    assert rows[("gated_delta_rule", "fla")].reason == "triton not installed"
    assert rows[("ssd", "mamba_ssm")].reason == "triton not installed"
    q, k, v, g, beta = _gdn_inputs()
    ops.gated_delta_rule(q, k, v, g, beta)
    with ops.use_backend("fla"), pytest.raises(ops.BackendError, match="triton not installed"):
        ops.gated_delta_rule(q, k, v, g, beta)


def test_mnemo_imports_without_the_peers():
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('triton', 'fla', 'mamba_ssm'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, mnemo.ops as ops\n"
        "from mnemo.ops import dispatch\n"
        "dispatch._installed = lambda b: 'not installed (blocked)'\n"
        "rows = ops.backends('cpu')\n"
        "x = torch.randn(1, 9, 2, 4)\n"
        "ops.gated_linear_attention(x, x, x, -torch.rand(1, 9, 2))\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('triton', 'fla', 'mamba_ssm')]\n"
        "print(sum(r.available for r in rows))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) in (5, 10)  # torch (and native, with a C compiler) for 5 ops


def test_meta_tensors_through_the_custom_ops(no_interpreter, monkeypatch):
    """The fake kernels: shapes and dtypes of every custom op, on meta tensors, from the public
    ops (forced onto the peer) and directly; no kernel runs, no package is imported."""
    monkeypatch.setattr(dispatch, "_installed", lambda backend: None)
    q, k, v, g, beta = _gdn_inputs(B=2, T=9, H=3, K=4, V=5, device="meta")
    h0 = torch.zeros(2, 3, 4, 5, device="meta")
    with ops.use_backend("fla"):
        o, S = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert o.shape == (2, 9, 3, 5) and o.device.type == "meta" and S.shape == (2, 3, 4, 5)
        assert S.dtype == torch.float32
        o, S = ops.delta_rule(q.bfloat16(), k, v, beta, output_final_state=True)
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
        o, S = ops.gated_linear_attention(q, k, v, torch.zeros(2, 9, 3, 4, device="meta"))
        assert o.shape == (2, 9, 3, 5) and S is None
        o, S = ops.linear_attention(q, k, v, feature_map="elu", normalize=True, output_final_state=True)
        assert o.shape == (2, 9, 3, 5) and S.shape == (2, 3, 4, 6)
    x = torch.zeros(2, 9, 4, 6, device="meta")
    Bm = torch.zeros(2, 9, 2, 8, device="meta")
    with ops.use_backend("mamba_ssm"):
        y, S = ops.ssd(
            x,
            torch.zeros(2, 9, 4, device="meta"),
            torch.zeros(4, device="meta"),
            Bm,
            Bm,
            torch.zeros(4, device="meta"),
            output_final_state=True,
        )
        assert y.shape == (2, 9, 4, 6) and S.shape == (2, 4, 8, 6)  # mnemo's [B, H, N, P]
    cu = torch.tensor([0, 4, 9], device="meta")
    o, S = torch.ops.mnemo.gated_delta_rule_fla(q[:1], k[:1], v[:1], g[:1], beta[:1], None, cu, 0.5, True)
    assert S.shape == (2, 3, 4, 5)


def test_fake_tensor_mode_and_backward_through_the_custom_op(no_interpreter):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, g, beta = (t.requires_grad_(True) for t in _gdn_inputs(T=9))
        o, S = _peer_ops.gated_delta_rule_fla(q, k, v, g, beta, None, None, 0.5, True)
        (o.sum() + S.sum()).backward()  # the backward custom op's fake kernel
        assert q.grad.shape == q.shape and g.grad.shape == g.shape and beta.grad.shape == beta.shape


def test_mnemo_info(no_interpreter, capsys):
    from mnemo.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "gated_delta_rule        fla" in out and "TRITON_INTERPRET=1" in out
    assert main(["info", "--json", "--device", "meta"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(dispatch.OPS) * len(dispatch.BACKENDS)
