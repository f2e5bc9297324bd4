"""``mnemo.ops.small_mm``: a few rows times a weight matrix (one-token decoding's products).

What the values mean is checked against a hand loop of the definition ``y[b, n] = Σ_k x[b, k]
w[n, k] + bias[n]`` in float64 and against known answers (a permutation weight returns the
permuted columns of ``x``). Shapes straddle the kernel's blocks: every row count 1-8 (each has a
block of its own in C), ``N`` not a multiple of any block (the rows left after the blocks), ``K``
below, at and above the SIMD width and not a multiple of it (the columns after the last full
register). Float64 agrees with the loop to rounding (measured ≤ 3.3e-16 relative RMS: tolerance
1e-13, the suite's float64 bound); float32 to its precision over ``K`` terms (measured ≤ 8.5e-8 of
the float64 loop on float32 inputs: tolerance 2e-6, the native kernels' float32 bound in
``tests/ops/test_native_fallback.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mnemo.ops.small_mm as sm
from mnemo.ops import _native
from mnemo.ops.small_mm import small_mm
from tests.helpers import assert_close

needs_native = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)

TOL = {torch.float64: 1e-13, torch.float32: 2e-6}


def _loop(x, w, b):
    """The definition, one output at a time, in float64."""
    x, w = x.double(), w.double()
    M, N = x.shape[0], w.shape[0]
    y = torch.zeros(M, N, dtype=torch.float64)
    for i in range(M):
        for n in range(N):
            y[i, n] = sum(float(x[i, k]) * float(w[n, k]) for k in range(x.shape[1]))
            if b is not None:
                y[i, n] += float(b[n])
    return y


@pytest.fixture
def native_on(monkeypatch):
    monkeypatch.setenv("MNEMO_NATIVE", "1")
    if _native.library() is None:
        pytest.skip("native kernels unavailable")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("K", [3, 16, 45])
def test_every_row_count_matches_the_definition(dtype, K, native_on, monkeypatch):
    """Rows 1-8, with and without a bias, one thread slot and two (the threshold set to 0): the
    kernel runs (a spy on the native call), and its values are the hand loop's."""
    g = torch.Generator().manual_seed(K)
    N = 37  # a prime: rows left over after every block size
    w = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    calls = []
    real = _native.call
    monkeypatch.setattr(_native, "call", lambda name, *a: (calls.append((name, a[2])), real(name, *a))[1])
    for threaded_min in (1 << 30, 0):
        monkeypatch.setattr(sm, "_THREADED_MIN_WEIGHT", threaded_min)
        for M in range(1, 9):
            x = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
            for bias in (None, b):
                y = small_mm(x, w, bias)
                assert y.dtype == dtype and y.shape == (M, N)
                assert_close(y, _loop(x, w, bias), TOL[dtype], what=f"M={M} K={K} bias={bias is not None}")
    assert [name for name, _ in calls] == ["smm_fwd"] * 32
    slots = {nt for _, nt in calls}
    assert 1 in slots and (torch.get_num_threads() == 1 or max(slots) > 1)


@needs_native
def test_a_permutation_weight_returns_the_permuted_columns(native_on):
    """Known answer: ``w = P`` (a permutation matrix) gives ``y = x[:, perm]`` exactly (one
    nonzero term per output), and a bias adds itself."""
    g = torch.Generator().manual_seed(3)
    K = 70
    perm = torch.randperm(K, generator=g)
    w = torch.eye(K)[perm]
    x = torch.randn(8, K, generator=g)
    assert torch.equal(small_mm(x, w), x[:, perm])
    bias = torch.arange(K, dtype=torch.float32)
    assert torch.equal(small_mm(x[:3], w, bias), x[:3, perm] + bias)


@needs_native
def test_views_are_read_as_their_values(native_on):
    """A transposed ``x`` and a weight seen through two transposes (not contiguous as stored)
    give the product of their values."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 5, generator=g).t()  # [5, 33], strides (1, 5)
    w = torch.randn(33, 20, generator=g).t()  # [20, 33], not contiguous
    assert not x.is_contiguous() and not w.is_contiguous()
    assert_close(small_mm(x, w), _loop(x, w, None), TOL[torch.float32])


def test_gradients_are_the_linear_maps(monkeypatch):
    """Differentiable (the op forward, PyTorch products backward), with the kernels on and off:
    ``gradcheck`` in float64, and equal to ``F.linear``'s gradients."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    for switch in ("1", "0"):
        monkeypatch.setenv("MNEMO_NATIVE", switch)
        assert torch.autograd.gradcheck(small_mm, (x, w, b))
        assert torch.autograd.gradcheck(lambda x, w: small_mm(x, w), (x, w))
        dy = torch.randn(3, 6, generator=g, dtype=torch.float64)
        got = torch.autograd.grad(small_mm(x, w, b), (x, w, b), dy)
        want = torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy)
        for a, e in zip(got, want):
            assert_close(a, e, 1e-13)


def test_forward_mode_and_func_transforms_get_the_linear_map(monkeypatch):
    """A dual tensor (forward-mode AD) or a ``torch.func`` transform runs ``F.linear``, whose rules
    they need: the tangent of ``x ↦ x wᵀ`` is ``t wᵀ`` (not zero), ``vmap`` maps over rows."""
    import torch.autograd.forward_ad as fwAD

    monkeypatch.setenv("MNEMO_NATIVE", "1")
    g = torch.Generator().manual_seed(8)
    x, t, w = (
        torch.randn(3, 10, generator=g),
        torch.randn(3, 10, generator=g),
        torch.randn(4, 10, generator=g),
    )
    _, tangent = torch.func.jvp(lambda x: small_mm(x, w), (x,), (t,))
    assert_close(tangent, t @ w.t(), 1e-6)
    with fwAD.dual_level():
        y = small_mm(fwAD.make_dual(x, t), w)
        assert_close(fwAD.unpack_dual(y).tangent, t @ w.t(), 1e-6)
    batched = torch.func.vmap(lambda xi: small_mm(xi[None], w)[0])(x)
    assert_close(batched, x @ w.t(), 1e-6)


def test_an_empty_shared_dimension_gives_the_bias(native_on):
    """``K = 0`` (the kernel takes ``K ≥ 1``): the product is the bias on every row, or zeros."""
    x, w, b = torch.zeros(3, 0), torch.zeros(5, 0), torch.arange(5.0)
    assert torch.equal(small_mm(x, w, b), b.expand(3, 5))
    assert torch.equal(small_mm(x, w), torch.zeros(3, 5))


def test_the_twin_runs_where_the_kernel_cannot(monkeypatch):
    """``MNEMO_NATIVE=0`` and bfloat16 go to ``F.linear`` (the twin, seen by a spy), never to the
    native call, with ``F.linear``'s values."""
    called, twin = [], sm._linear
    monkeypatch.setattr(_native, "call", lambda *a: called.append(a))
    monkeypatch.setattr(sm, "_linear", lambda *a: (called.append("twin"), twin(*a))[1])
    g = torch.Generator().manual_seed(6)
    x, w, b = torch.randn(4, 9, generator=g), torch.randn(5, 9, generator=g), torch.randn(5, generator=g)
    monkeypatch.setenv("MNEMO_NATIVE", "0")
    assert torch.equal(small_mm(x, w, b), F.linear(x, w, b))
    monkeypatch.setenv("MNEMO_NATIVE", "1")
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(small_mm(xb, wb), F.linear(xb, wb))
    assert called == ["twin"] * 2


def test_the_fake_kernel_gives_the_shape_without_reading_values():
    """On the ``meta`` device (what ``torch.compile`` traces with): ``[M, N]``, no value read."""
    y = torch.ops.mnemo.small_mm(torch.empty(3, 7, device="meta"), torch.empty(11, 7, device="meta"), None)
    assert y.shape == (3, 11) and y.device.type == "meta"


@pytest.mark.parametrize(
    "args,match",
    [
        (
            (torch.zeros(0, 4), torch.zeros(3, 4)),
            r"x: expected \[M, K\] with 1 <= M <= 8, got shape \[0, 4\]",
        ),
        (
            (torch.zeros(9, 4), torch.zeros(3, 4)),
            r"x: expected \[M, K\] with 1 <= M <= 8, got shape \[9, 4\]",
        ),
        ((torch.zeros(4), torch.zeros(3, 4)), r"x: expected \[M, K\].*got shape \[4\]"),
        ((torch.zeros(2, 4), torch.zeros(3, 5)), r"weight: expected \[N, K\] with K = 4.*got shape \[3, 5\]"),
        ((torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(4)), r"bias: expected shape \[3\].*got \[4\]"),
        (
            (torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float64)),
            r"x, weight: expected one dtype, got x torch.float32, weight torch.float64",
        ),
        (
            (torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64)),
            r"x, weight, bias: expected one dtype, got x torch.float32, weight torch.float32, "
            r"bias torch.float64",
        ),
        ((torch.zeros(2, 4), torch.zeros(3, 4, 1)), r"weight: expected \[N, K\].*got shape \[3, 4, 1\]"),
    ],
)
@pytest.mark.parametrize("native", ["1", "0"])
def test_bad_input_names_the_argument(args, match, native, monkeypatch):
    """The function and the operator itself raise the same error, with the kernel and with its
    twin (a wrong call to the op must not be computed as some other shape)."""
    monkeypatch.setenv("MNEMO_NATIVE", native)
    with pytest.raises(ValueError, match=match):
        small_mm(*args)
    with pytest.raises(ValueError, match=match):
        torch.ops.mnemo.small_mm(*args, *([None] if len(args) == 2 else []))


def test_a_bias_that_is_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="bias: expected a tensor or None, got float"):
        small_mm(torch.zeros(2, 4), torch.zeros(3, 4), 0.5)


def test_compiles_into_one_graph():
    """``small_mm`` under ``torch.compile(fullgraph=True)``: no graph break (while tracing it is
    ``F.linear``), the values and gradients of ``F.linear``, also through ``torch.func.grad`` and
    ``jvp`` traced by dynamo (the op has no rule for them)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    w = torch.randn(5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64)

    def f(x, w, b):
        return small_mm(x, w, b).relu()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert_close(compiled(x, w, b), F.linear(x, w, b).relu(), 1e-12)
    y = compiled(x, w, b)
    (gw,) = torch.autograd.grad(y.sum(), [w])
    w2 = w.detach().requires_grad_(True)
    (gw2,) = torch.autograd.grad(F.linear(x, w2, b).relu().sum(), [w2])
    assert_close(gw, gw2, 1e-12)

    def loss(w):
        return small_mm(x, w, b).square().sum()

    w0, t = w.detach(), torch.randn(5, 16, generator=g, dtype=torch.float64)
    want = torch.func.grad(lambda w: F.linear(x, w, b).square().sum())(w0)
    assert_close(torch.compile(torch.func.grad(loss), fullgraph=True, backend="aot_eager")(w0), want, 1e-12)
    _, tangent = torch.compile(lambda w, t: torch.func.jvp(loss, (w,), (t,)), backend="aot_eager")(w0, t)
    _, want_tangent = torch.func.jvp(lambda w: F.linear(x, w, b).square().sum(), (w0,), (t,))
    assert_close(tangent, want_tangent, 1e-12)
    torch._dynamo.reset()


def test_the_last_level_cache_size_is_read_from_sysfs(tmp_path):
    """The largest ``index*/size`` (``K``/``M``/``G`` suffixes), whatever the order; the default
    where nothing readable is there."""
    from mnemo.ops.small_mm import last_level_cache_bytes

    for i, size in enumerate(["32K", "1024K", "32768K", "64K"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(root=tmp_path) == 32 << 20
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("1M")
    assert last_level_cache_bytes(root=tmp_path) == 32 << 20
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "size").write_text("2G")
    assert last_level_cache_bytes(root=tmp_path) == 2 << 30
    assert last_level_cache_bytes(default=123, root=tmp_path / "missing") == 123
    (tmp_path / "odd" / "index0").mkdir(parents=True)
    (tmp_path / "odd" / "index0" / "size").write_text("lots")
    assert last_level_cache_bytes(default=7, root=tmp_path / "odd") == 7
