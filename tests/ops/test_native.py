"""The C selective-scan kernel (``mnemo.ops._native``) against the token-loop reference: shapes
that exercise its channel tiles (padding, groups), its backward blocks (lengths that are not a
multiple of the block, a block longer than the sequence) and its threads; float32 against a
float64 reference; dispatch, the ``MNEMO_NATIVE`` switch and the fallback when it cannot be
built."""

from __future__ import annotations

import importlib

import pytest
import torch

from mnemo.ops import _native, selective_scan
from tests.helpers import assert_close

ss = importlib.import_module("mnemo.ops.selective_scan")

needs_native = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)


def _quick_build_flags(monkeypatch):
    """``-O0`` instead of ``-O3`` for a test that checks how and where the library is built, not
    how fast it runs (a build ~7x quicker; the same sources, IEEE arithmetic either way, and the
    ``-O3`` build is the one every other test here loads)."""
    monkeypatch.setattr(_native, "_FLAGS", ["-O0" if f == "-O3" else f for f in _native._FLAGS])


def _inputs(Bsz, T, D, N, G, dtype, seed=0, dt_scale=1.0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return {
        "delta": (torch.rand(Bsz, T, D, generator=gen, dtype=torch.float64) * dt_scale).to(dtype),
        "u": r(Bsz, T, D),
        "A": -(r(D, N, scale=0.7).exp()),
        "B": r(Bsz, T, G, N),
        "C": r(Bsz, T, G, N),
        "h0": r(Bsz, D, N),
    }


def _value_and_grads(fn, x, seed=1):
    x = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    y, h = fn(x["delta"], x["u"], x["A"], x["B"], x["C"], x["h0"])
    gen = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)
    gh = torch.randn(h.shape, generator=gen, dtype=torch.float64).to(h.dtype)
    grads = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), list(x.values()))
    return [y, h, *grads]


def _outputs_and_grads(fn, x: dict, threads: int | None = None) -> list:
    """``[y, h, *grads]`` of ``fn(**x)`` under a fixed random loss on ``y`` and ``h``, with the grads
    in ``x``'s order; on ``threads`` torch threads if given."""
    xs = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        y, h = fn(**xs)
        g = torch.Generator().manual_seed(1)
        loss = (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum() + (
            h * torch.randn(h.shape, generator=g, dtype=h.dtype)
        ).sum()
        return [y, h, *torch.autograd.grad(loss, list(xs.values()))]
    finally:
        torch.set_num_threads(prev)


NAMES = ["y", "h_T", "d delta", "d u", "d A", "d B", "d C", "d h0"]


@needs_native
@pytest.mark.parametrize(
    "Bsz,T,D,N,G,block",
    [
        (2, 37, 8, 5, 2, 32),  # groups of 4 channels, each padded to a 16-channel tile; T % block != 0
        (1, 64, 48, 16, 1, 16),  # three full tiles, T a multiple of the block
        (3, 5, 20, 3, 4, 32),  # block longer than the sequence; groups of 5 channels
        (2, 70, 32, 16, 2, 7),  # exactly one tile per group, odd block
        (1, 1, 16, 4, 1, 32),  # a single token
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_matches_token_loop_float64(Bsz, T, D, N, G, block, threads):
    x = _inputs(Bsz, T, D, N, G, torch.float64)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _value_and_grads(lambda *a: ss.ss_native(*a, chunk_size=block), x)
    finally:
        torch.set_num_threads(prev)
    ref = _value_and_grads(ss.ss_recurrent, x)
    for a, b, what in zip(got, ref, NAMES):
        assert_close(a, b, 1e-12, what=what)


@needs_native
@pytest.mark.parametrize("skip,gate", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_skip_and_gate_match_token_loop(skip, gate, threads):
    """``y = (C h + D u) silu(z)`` in the kernel: values and the gradients of D and z too."""
    Bsz, T, Dm, N, G = 2, 23, 20, 3, 2  # groups of 10 channels, each padded to 16
    x = _inputs(Bsz, T, Dm, N, G, torch.float64, seed=7)
    gen = torch.Generator().manual_seed(8)
    if skip:
        x["D"] = torch.randn(Dm, generator=gen, dtype=torch.float64)
    if gate:
        x["z"] = 3 * torch.randn(Bsz, T, Dm, generator=gen, dtype=torch.float64)

    def fused(delta, u, A, B, C, h0, D=None, z=None):
        return ss.ss_native(delta, u, A, B, C, h0, 5, D=D, z=z)

    def reference(delta, u, A, B, C, h0, D=None, z=None):
        y, h = ss.ss_recurrent(delta, u, A, B, C, h0)
        if D is not None:
            y = y + u * D
        if z is not None:
            y = y * torch.nn.functional.silu(z)
        return y, h

    got = _outputs_and_grads(fused, x, threads)
    want = _outputs_and_grads(reference, x)
    labels = NAMES + ["d D"] * skip + ["d z"] * gate
    assert len(got) == len(want) == len(labels)
    for a, b, what in zip(got, want, labels):
        assert_close(a, b, 1e-12, what=what)


@needs_native
@pytest.mark.parametrize("softplus", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_matches_token_loop(softplus, threads):
    """``Δ = softplus(δ + bias)`` (or ``δ + bias``) formed in the kernel: values and the gradients of
    the raw step and the bias, with raw steps on both sides of softplus's threshold (20)."""
    Bsz, T, Dm, N, G = 2, 19, 24, 3, 2  # groups of 12 channels, each padded to a tile
    x = _inputs(Bsz, T, Dm, N, G, torch.float64, seed=11)
    gen = torch.Generator().manual_seed(12)
    if softplus:  # raw steps from -30 to 25 (exp(Δ A) stays above the clamp)
        x["delta"] = torch.rand(Bsz, T, Dm, generator=gen, dtype=torch.float64) * 55 - 30
    x["bias"] = torch.randn(Dm, generator=gen, dtype=torch.float64)
    x["A"] = x["A"] / 40

    def step(delta, bias):
        d = delta + bias
        return torch.nn.functional.softplus(d) if softplus else d

    def fused(delta, u, A, B, C, h0, bias):
        return ss.ss_native(delta, u, A, B, C, h0, 4, delta_bias=bias, softplus=softplus)

    got = _outputs_and_grads(fused, x, threads)
    want = _outputs_and_grads(
        lambda delta, u, A, B, C, h0, bias: ss.ss_recurrent(step(delta, bias), u, A, B, C, h0), x
    )
    for a, b, what in zip(got, want, NAMES + ["d bias"]):
        assert_close(a, b, 1e-12, what=what)


@needs_native
def test_float32_softplus_step_is_accurate_everywhere():
    """With ``T = 1``, ``h0 = 0``, ``B = C = u = 1`` and ``N = 1`` the output is the step itself, so
    the float32 kernel's own softplus (exp, log1p) and its derivative σ are read directly, element by
    element, over raw steps from -80 (where softplus underflows towards e^δ) to 40."""
    raw = torch.cat(
        [torch.linspace(-80, 40, 4001, dtype=torch.float64), torch.tensor([0.0, 19.999, 20.0, 20.001])]
    )
    D = raw.numel()
    delta = raw.float().view(1, 1, D).requires_grad_()
    one = torch.ones(1, 1, 1, 1)
    y, _ = ss.ss_native(
        delta, torch.ones(1, 1, D), -torch.ones(D, 1), one, one, torch.zeros(1, D, 1), softplus=True
    )
    (g,) = torch.autograd.grad(y.sum(), delta)
    x = delta.detach().double()  # the float32 inputs, exactly
    want = torch.nn.functional.softplus(x).flatten()
    dwant = torch.sigmoid(x).flatten()
    dwant[x.flatten() > 20] = 1.0  # torch's softplus is the identity (slope 1) above its threshold
    # bound: exp (below 1e-7, selective_scan.c) + log (below 1e-8) + about four float32 roundings
    # (6e-8 each) = 3.5e-7; measured 2.0e-7 and 1.5e-7 here (2.7e-7 and 1.7e-7 on a 100x finer grid;
    # torch's own float32 softplus: 1.1e-7)
    assert ((y.double().flatten() - want).abs() / want).max() < 4e-7
    assert ((g.double().flatten() - dwant).abs() / dwant).max() < 4e-7


@needs_native
def test_float32_exp_matches_torch_up_to_overflow():
    """With ``T = 1``, ``Δ = 1``, ``h0 = 1``, ``u = 0`` and ``C = 1`` the output is ``exp(A)``: the
    kernel's float32 exp over [-60, 100] (the clamp's floor up to past overflow at 88.72) against
    float64, and inf where float32 overflows, as ``torch.exp`` gives."""
    A = torch.cat([torch.linspace(-60, 100, 3001), torch.tensor([88.72, 88.73, float("inf")])])
    D = A.numel()
    one = torch.ones(1, 1, 1, 1)
    y, _ = ss.ss_native(torch.ones(1, 1, D), torch.zeros(1, 1, D), A[:, None], one, one, torch.ones(1, D, 1))
    want = torch.exp(A.double())
    got = y.double().flatten()
    finite = torch.isfinite(torch.exp(A))
    assert torch.equal(torch.isinf(got), ~finite)
    # documented: relative error below 1e-7 before the final rounding to float32 (2^-24 more);
    # measured 6.7e-8 (7.4e-8 on a 100x finer grid; torch.exp: 6.3e-8)
    assert ((got[finite] - want[finite]).abs() / want[finite]).max() < 1e-7 + 2**-24


@needs_native
def test_openmp_and_thread_pool_slots_agree(monkeypatch):
    """The slots give the same bits whether PyTorch's OpenMP threads or our pool run them."""
    if not _native.openmp():
        pytest.skip("library built without OpenMP")
    x = _inputs(2, 45, 40, 5, 1, torch.float32, seed=4)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        omp = _value_and_grads(ss.ss_native, x)
        monkeypatch.setattr(_native, "_forked", True)  # what a forked child uses
        assert not _native.openmp()
        pool = _value_and_grads(ss.ss_native, x)
    finally:
        torch.set_num_threads(prev)
    for a, b, what in zip(omp, pool, NAMES):
        assert torch.equal(a, b), what


@needs_native
def test_native_float32_matches_float64_reference():
    """The float32 kernel (its own vectorised exp) against the float64 token loop."""
    x = _inputs(2, 300, 40, 16, 1, torch.float64, seed=3)
    ref = _value_and_grads(ss.ss_recurrent, x)
    got = _value_and_grads(ss.ss_native, {k: v.float() for k, v in x.items()})
    for a, b, what in zip(got, ref, NAMES):
        assert a.dtype == torch.float32
        assert_close(a, b, 2e-5, what=what)


@needs_native
def test_native_clamps_like_the_reference():
    """Huge steps (Δ A far below the -60 floor): same values and zero gradient through the clamp."""
    x = _inputs(1, 24, 16, 4, 1, torch.float64, seed=5, dt_scale=500.0)
    ref = _value_and_grads(ss.ss_recurrent, x)
    got = _value_and_grads(ss.ss_native, x)
    for a, b, what in zip(got, ref, NAMES):
        assert_close(a, b, 1e-12, what=what)


@needs_native
def test_chunk_mode_dispatches_to_native_on_cpu(monkeypatch):
    x = _inputs(1, 9, 16, 4, 1, torch.float32)

    def fail(*a, **k):
        raise AssertionError("the PyTorch blocked form ran although the kernel is available")

    monkeypatch.setattr(ss, "ss_chunk_torch", fail)
    y, _ = selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], mode="chunk")
    y_ref, _ = selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], mode="recurrent")
    assert_close(y, y_ref, 1e-6)  # float32 (measured 7e-8)
    monkeypatch.setenv("MNEMO_NATIVE", "0")
    with pytest.raises(AssertionError, match="PyTorch blocked form ran"):
        selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], mode="chunk")


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    """A compiler that fails: one RuntimeWarning naming the cause, then the PyTorch form (same result)."""
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setenv("MNEMO_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 without output
    monkeypatch.delenv("MNEMO_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="native CPU kernels unavailable .*false exited with 1"):
        assert _native.library() is None
    assert _native.library() is None  # no second attempt, no second warning
    x = _inputs(1, 11, 16, 4, 1, torch.float64)
    y, h = selective_scan(
        x["u"], x["delta"], x["A"], x["B"], x["C"], initial_state=x["h0"], output_final_state=True
    )
    yr, hr = selective_scan(
        x["u"],
        x["delta"],
        x["A"],
        x["B"],
        x["C"],
        initial_state=x["h0"],
        output_final_state=True,
        mode="recurrent",
    )
    assert_close(y, yr, 1e-12)
    assert_close(h, hr, 1e-12)
    assert not list(tmp_path.glob("*.so"))


@needs_native
def test_compiler_without_openmp_gives_the_thread_pool_build(monkeypatch, tmp_path):
    """A compiler that cannot build with ``-fopenmp``: no warning, the thread-pool build (correct
    results on two threads), and a marker so later processes do not try ``-fopenmp`` again."""
    import shutil
    import warnings

    log = tmp_path / "calls.log"
    cc = tmp_path / "cc-no-openmp"
    real = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    cc.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\ncase "$*" in *-fopenmp*) exit 1;; esac\nexec {real} "$@"\n'
    )
    cc.chmod(0o755)
    _quick_build_flags(monkeypatch)
    monkeypatch.setenv("MNEMO_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.delenv("MNEMO_NATIVE", raising=False)
    for _ in range(2):  # the second round stands for a later process
        monkeypatch.setattr(_native, "_tried", False)
        monkeypatch.setattr(_native, "_lib", None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _native.library() is not None
        assert not _native.openmp()
    assert sum("-fopenmp" in line for line in log.read_text().splitlines()) == 1
    assert list((tmp_path / "cache").glob("*.failed"))
    x = _inputs(2, 21, 40, 4, 1, torch.float64, seed=9)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = _value_and_grads(ss.ss_native, x)
    finally:
        torch.set_num_threads(prev)
    for a, b, what in zip(got, _value_and_grads(ss.ss_recurrent, x), NAMES):
        assert_close(a, b, 1e-12, what=what)


@needs_native
@pytest.mark.skipif(
    not __import__("os").path.isdir("/proc"), reason="needs /proc: a directory nobody can write to"
)
def test_unwritable_cache_directory_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    """A cache directory that exists but cannot be written (``/proc``, even for root): the library
    is built in the temporary directory instead, with no warning."""
    import tempfile
    import warnings

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _quick_build_flags(monkeypatch)
    monkeypatch.setenv("MNEMO_NATIVE_CACHE", "/proc")
    monkeypatch.delenv("MNEMO_NATIVE", raising=False)
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_lib", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.library() is not None
    assert list(tmp_path.glob("mnemo-native-*/libmnemo_*.so"))


@needs_native
def test_backward_finishes_when_the_switch_changes_after_the_forward(monkeypatch):
    """``MNEMO_NATIVE=0`` set between forward and backward: the backward still uses the kernel its
    forward used (and gives the reference gradients)."""
    from mnemo.layers import ShortConvolution

    x = _inputs(1, 13, 20, 3, 1, torch.float64, seed=2)
    xs = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    y, h = ss.ss_native(xs["delta"], xs["u"], xs["A"], xs["B"], xs["C"], xs["h0"])
    conv = ShortConvolution(20, 4).double()
    yc = conv(xs["u"])[0]
    monkeypatch.setenv("MNEMO_NATIVE", "0")
    got = torch.autograd.grad(y.sum() + h.sum() + yc.sum(), list(xs.values()))
    monkeypatch.delenv("MNEMO_NATIVE")
    xr = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    yr, hr = ss.ss_recurrent(xr["delta"], xr["u"], xr["A"], xr["B"], xr["C"], xr["h0"])
    want = torch.autograd.grad(yr.sum() + hr.sum() + conv(xr["u"])[0].sum(), list(xr.values()))
    for a, b, what in zip(got, want, NAMES[2:]):
        assert_close(a, b, 1e-12, what=what)


@needs_native
def test_call_refuses_non_contiguous_or_wrong_dtype_tensors():
    y = torch.empty(4, 16)
    for bad in (torch.empty(16, 4).t(), torch.empty(4, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="must be contiguous torch.float32"):
            _native.call("conv_fwd", torch.float32, 16, 1, [1, 4, 16, 1, bad, torch.empty(1, 16), None, y])


def test_switch_values(monkeypatch):
    for value, on in [("0", False), ("off", False), ("false", False), ("1", True), ("", True)]:
        monkeypatch.setenv("MNEMO_NATIVE", value)
        assert _native.enabled() is on


def _conv_sum_in_child(q):
    from mnemo.layers import ShortConvolution

    torch.manual_seed(0)
    torch.set_num_threads(2)
    q.put(ShortConvolution(40, 4)(torch.randn(2, 30, 40))[0].sum().item())


@needs_native
def test_kernels_run_in_a_forked_child_after_the_parent_used_them():
    """A forked child inherits the thread pool object but not its threads; it must make its own."""
    import multiprocessing as mp

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = _inputs(1, 9, 32, 4, 1, torch.float32)
        selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"])  # the parent's pool now exists
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_conv_sum_in_child, args=(q,))
        p.start()
        got = q.get(timeout=60)
        p.join(timeout=60)
        q2 = ctx.Queue()
        _conv_sum_in_child(q2)  # the same computation in this process
        want = q2.get()
    finally:
        torch.set_num_threads(prev)
    assert p.exitcode == 0
    assert got == pytest.approx(want)


@needs_native
def test_mamba_layer_under_torch_compile_matches_eager():
    """``torch.compile(backend="eager")`` around a Mamba layer: while dynamo traces, the native
    kernels step aside (:func:`mnemo.ops._native.usable` is ``False``) and their PyTorch twins run,
    so the layer is one graph; outputs and gradients equal eager's (which runs the kernels) up to
    float32 rounding (the two forms sum in different orders: relative RMS ~1e-7, bound 1e-5)."""
    import warnings

    from mnemo.layers import Mamba

    torch.manual_seed(0)
    m = Mamba(32)
    x = torch.randn(2, 37, 32)

    def eager(x):
        return m(x)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(eager, backend="eager")
        res = []
        for f in (eager, compiled):
            m.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            y = f(xx)
            y.square().sum().backward()
            res.append([y.detach(), xx.grad, m.A_log.grad, m.dt_proj.bias.grad, m.conv.weight.grad])
    for a, b in zip(*res):
        assert ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item() < 1e-5
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch._dynamo.explain(eager)(x).graph_break_count == 0
