"""The C kernels for the chunked forms' sequential parts (``mnemo/ops/_native/chunk_scan.c``)
against their PyTorch twins in ``mnemo.ops._chunked``: the chunk-state passes of the delta rule
(``S ← M S + D``) and of gated linear attention (``S ← λ ⊙ S + dS``), forward and reverse with the
decay-gradient dots, and the unit lower-triangular inverse. Shapes that are not multiples of the
SIMD width, strided views, one chunk, several heads over one and two threads, float64 and
float32. The ops' own tests (chunk form against the token loop) run through the kernels, so with
these twin checks both backends are covered."""

from __future__ import annotations

import pytest
import torch

from mnemo.ops import _chunked as ch
from mnemo.ops import _native
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)

SHAPES = [(1, 4, 16, 64, 64), (2, 3, 5, 7, 9), (1, 1, 1, 4, 3), (2, 2, 9, 20, 33)]  # B, H, n, K, V


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _tol(dtype):
    return 1e-12 if dtype == torch.float64 else 2e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,H,n,K,V", SHAPES)
def test_matrix_scan_forward_and_reverse_match_pytorch(B, H, n, K, V, dtype, threads):
    """``M`` and ``D`` are the two halves of one packed ``[.., K, K + V]`` product (strided views),
    as in the delta rule."""
    MD = _rand(B, H, n, K, K + V, dtype=dtype, seed=1, scale=0.3)
    M, D = MD[..., :K], MD[..., K:]
    S0 = _rand(B, H, K, V, dtype=dtype, seed=2)
    st, Sf = ch.scan_matrix(S0, D, M)
    st_ref, Sf_ref = ch.scan_matrix_torch(S0, D, M)
    assert_close(st, st_ref, _tol(dtype), what="states")
    assert_close(Sf, Sf_ref, _tol(dtype), what="final state")
    R = _rand(B, H, n, K, V, dtype=dtype, seed=3)
    dSf = _rand(B, H, K, V, dtype=dtype, seed=4)
    Gs, dS0, dots = ch.scan_matrix_reverse_(dSf, R.clone(), M, dots_with=(st_ref, Sf_ref))
    Gs_ref, dS0_ref = ch.scan_matrix_reverse_torch_(dSf, R.clone(), M)
    assert_close(Gs, Gs_ref, _tol(dtype), what="Gs")
    assert_close(dS0, dS0_ref, _tol(dtype), what="dS0")
    assert_close(dots, ch.next_state_dots(Gs_ref, st_ref, Sf_ref), _tol(dtype), what="dots")
    assert ch.scan_matrix_reverse_(dSf, R.clone(), M)[2] is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,H,n,K,V", SHAPES)
@pytest.mark.parametrize("decay", ["none", "per chunk", "per key"])
def test_decay_scan_forward_and_reverse_match_pytorch(B, H, n, K, V, dtype, decay, threads):
    lam = {
        "none": None,
        "per chunk": _rand(B, H, n, 1, 1, dtype=dtype, seed=5).sigmoid(),
        "per key": _rand(B, H, n, K, 1, dtype=dtype, seed=5).sigmoid(),
    }[decay]
    S0 = _rand(B, H, K, V, dtype=dtype, seed=6)
    dS = _rand(B, H, n, K, V, dtype=dtype, seed=7)
    st, Sf = ch.scan_decay_(S0, dS.clone(), lam)
    st_ref, Sf_ref = ch.scan_decay_torch_(S0, dS.clone(), lam)
    assert_close(st, st_ref, _tol(dtype), what="states")
    assert_close(Sf, Sf_ref, _tol(dtype), what="final state")
    R = _rand(B, H, n, K, V, dtype=dtype, seed=8)
    dSf = _rand(B, H, K, V, dtype=dtype, seed=9)
    Gs_ref, dS0_ref = ch.scan_decay_reverse_torch_(dSf, R.clone(), lam)
    dots_ref = ch.next_state_dots(Gs_ref, st_ref, Sf_ref)
    for scale_out in (False, True):
        Gs, dS0, dots = ch.scan_decay_reverse_(
            dSf, R.clone(), lam, dots_with=(st_ref, Sf_ref), scale_out=scale_out
        )
        want = Gs_ref * lam if scale_out and lam is not None else Gs_ref
        assert_close(Gs, want, _tol(dtype), what=f"Gs (scale_out={scale_out})")
        assert_close(dS0, dS0_ref, _tol(dtype), what="dS0")
        assert_close(dots, dots_ref, _tol(dtype), what="dots")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("C", [1, 2, 5, 16, 17, 64, 100])
def test_unit_lower_inverse_matches_pytorch_and_linalg(C, dtype, threads):
    A = _rand(3, 7, C, C, dtype=dtype, seed=10, scale=0.2).tril_(-1)
    A.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    want = torch.linalg.inv(A.double())
    got = ch.unit_lower_inverse_(A.clone())
    assert_close(got, want.to(dtype), _tol(dtype) * 10, what="native vs linalg.inv")
    assert_close(
        got, ch.unit_lower_inverse_torch_(A.clone()), _tol(dtype) * 10, what="native vs PyTorch twin"
    )


def test_kernels_step_aside_when_autograd_records():
    """Inputs that require grad under grad mode take the PyTorch form (the kernels are not
    differentiable; the ops call them inside their own backward)."""
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    MD = torch.randn(1, 2, 5, 4, 7, dtype=torch.float64) * 0.3
    M = MD[..., :4]
    st, Sf = ch.scan_matrix(S0, MD[..., 4:], M)
    assert Sf.grad_fn is not None
    (g,) = torch.autograd.grad(Sf.sum(), S0)
    # S_final = M_4 ⋯ M_0 S0 + (terms without S0): the gradient of its sum is (M_4 ⋯ M_0)ᵀ 1
    P = torch.eye(4, dtype=torch.float64).expand(1, 2, 4, 4)
    for i in range(5):
        P = M[:, :, i] @ P
    assert_close(g, P.mT @ torch.ones(1, 2, 4, 3, dtype=torch.float64), 1e-12)
