"""The gated RMSNorm (:func:`mnemo.layers.norm.gated_rms_norm`): its C kernel against the PyTorch
form and against a hand loop of the equation, its gradients (finite differences, a graph of the
gradient), the fallbacks, the errors, and the layers that use it.

Tolerances: float64 kernel vs PyTorch form ``1e-12`` (measured ~3e-16: the same operations in
another summation order); float32 ``1e-6`` (measured ~2e-7: rounding of a 36-64 term sum)."""

from __future__ import annotations

import math

import pytest
import torch

import mnemo.layers.norm as norm_mod
from mnemo.layers.norm import RMSNorm, _gated_rms_norm_reference, gated_rms_norm
from mnemo.ops import _native
from tests.helpers import assert_close, spy_native_calls

needs_native = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)


def _inputs(shape, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, D, generator=g, dtype=dtype)
    z = 2 * torch.randn(*shape, D, generator=g, dtype=dtype)  # both tails of the sigmoid
    w = 1 + 0.3 * torch.randn(D, generator=g, dtype=dtype)
    dy = torch.randn(*shape, D, generator=g, dtype=dtype)
    return x, z, w, dy


def _value_and_grads(fn, x, z, w, dy, **kw):
    x, z, w = (t.clone().requires_grad_(True) for t in (x, z, w))
    y = fn(x, z, w, 1e-5, **kw)
    return (y, *torch.autograd.grad(y, (x, z, w), dy))


def _reference(x, z, w, eps, *, groups, gate_first):
    return _gated_rms_norm_reference(x, z, w, eps, groups, gate_first)


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("D,groups", [(64, 1), (64, 4), (36, 4), (5, 1)])
def test_kernel_matches_the_pytorch_form(dtype, tol, gate_first, D, groups):
    """Values and the three gradients; ``D = 36`` in 4 groups and ``D = 5`` leave partial SIMD
    registers (groups of 9 and 5 channels), and 15 rows split unevenly over the threads."""
    x, z, w, dy = _inputs((3, 5), D, dtype)
    calls = []
    real = _native.call

    def spy(name, *args):
        calls.append(name)
        return real(name, *args)

    _native.call = spy
    try:
        got = _value_and_grads(gated_rms_norm, x, z, w, dy, groups=groups, gate_first=gate_first)
    finally:
        _native.call = real
    assert calls == ["gn_fwd", "gn_bwd"]  # the kernel really ran
    want = _value_and_grads(_reference, x, z, w, dy, groups=groups, gate_first=gate_first)
    for what, a, b in zip(("y", "dx", "dz", "dw"), got, want):
        assert_close(a, b, tol, what=what)


@pytest.mark.parametrize("gate_first", [False, True])
def test_the_equation_by_hand(gate_first):
    """A hand loop of ``RMSNorm(x ⊙ silu(z)) ⊙ w`` / ``RMSNorm(x) ⊙ w ⊙ silu(z)`` per group, in
    Python floats, on a 2 x 6 input in 2 groups (the kernel when it builds, else the PyTorch form)."""
    x, z, w, _ = _inputs((2,), 6, torch.float64, seed=3)
    y = gated_rms_norm(x, z, w, 1e-5, groups=2, gate_first=gate_first)

    def silu(t):
        return t / (1 + math.exp(-t))

    for r in range(2):
        for g in range(2):
            cols = range(3 * g, 3 * g + 3)
            a = {i: x[r, i].item() * (silu(z[r, i].item()) if gate_first else 1.0) for i in cols}
            rstd = 1 / math.sqrt(sum(v * v for v in a.values()) / 3 + 1e-5)
            for i in cols:
                want = a[i] * rstd * w[i].item() * (1.0 if gate_first else silu(z[r, i].item()))
                assert y[r, i].item() == pytest.approx(want, rel=1e-12, abs=1e-14)


@needs_native
@pytest.mark.parametrize("gate_first", [False, True])
def test_gradients_by_finite_differences_and_a_graph_of_the_gradient(gate_first):
    """``gradcheck`` of the kernel's backward, and ``gradgradcheck`` (the backward differentiated
    again: the PyTorch form's autograd on the saved inputs)."""
    x, z, w, _ = _inputs((2, 3), 8, torch.float64, seed=1)
    args = tuple(t.requires_grad_(True) for t in (x, z, w))

    def f(x, z, w):
        return gated_rms_norm(x, z, w, 1e-5, groups=2, gate_first=gate_first)

    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_fallbacks_compute_the_same(monkeypatch):
    """No kernel (``_native.usable`` false: ``MNEMO_NATIVE=0``, no compiler, CUDA, torch.compile)
    runs the PyTorch form; bfloat16 runs it too (normalising in float32) and stays bfloat16."""
    x, z, w, dy = _inputs((4,), 16, torch.float64)
    fused = _value_and_grads(gated_rms_norm, x, z, w, dy, groups=2, gate_first=True)
    monkeypatch.setattr(norm_mod._native, "usable", lambda *t: False)
    plain = _value_and_grads(gated_rms_norm, x, z, w, dy, groups=2, gate_first=True)
    for a, b in zip(fused, plain):
        assert_close(a, b, 1e-12)
    monkeypatch.undo()
    xb, zb, wb = x.bfloat16(), z.bfloat16(), w.bfloat16()
    y = gated_rms_norm(xb, zb, wb, groups=2, gate_first=True)
    assert y.dtype == torch.bfloat16
    assert_close(y, _reference(xb, zb, wb, 1e-5, groups=2, gate_first=True), 0.0)
    assert_close(y, fused[0], 2e-2)  # bfloat16 rounding of the inputs and the output


def test_errors_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="z: expected the shape of x"):
        gated_rms_norm(x, torch.randn(2, 7), torch.ones(8))
    with pytest.raises(ValueError, match=r"weight: expected shape \[8\]"):
        gated_rms_norm(x, x, torch.ones(4))
    with pytest.raises(ValueError, match="groups: expected a divisor of D = 8, got 3"):
        gated_rms_norm(x, x, torch.ones(8), groups=3)


def test_norm_module_gated_is_the_norm_times_the_gate():
    """``RMSNorm.gated`` (what the layers call) equals the module's own forward times ``silu(z)``,
    and an empty input passes through."""
    norm = RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z = torch.randn(3, 4, 12), torch.randn(3, 4, 12)
    assert_close(norm.gated(x, z), norm(x) * torch.nn.functional.silu(z), 1e-6)
    assert norm.gated(x[:0], z[:0]).shape == (0, 4, 12)


def _mamba2_norm_before_gate():
    from mnemo.models import build_config

    cfg = build_config("mamba2", vocab_size=32, d_model=32, n_layers=2)
    cfg.mixer_options.setdefault("mamba2", {})["norm_before_gate"] = True
    return cfg


@needs_native
@pytest.mark.parametrize(
    "name",
    [
        "mamba2",
        "mamba2_norm_before_gate",
        "gated_deltanet",
        "gla",
        "retnet",
        "titans_lmm",
        "hope",
        "hope_reconstruction",
    ],
)
def test_layers_with_the_kernel_equal_the_pytorch_form(name, monkeypatch):
    """A model's logits and gradients with the fused norm (its kernels seen running, every other
    kernel as it is) equal those with only the norm switched to its PyTorch form."""
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    if name == "mamba2_norm_before_gate":
        cfg = _mamba2_norm_before_gate()
    else:
        cfg = build_config(name, vocab_size=32, d_model=32, n_layers=2)
    model = LanguageModel(cfg)
    ids = torch.randint(0, 32, (2, 19))
    calls = spy_native_calls(monkeypatch)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(ids)[0]
        logits.square().mean().backward()
        return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused = run()
    if name == "hope":  # task-signal segments 8, 8, 3: each layer's norm runs once per segment, and
        # the two whole segments' signals back-propagate through layer 1's norm once more each
        assert calls.count("gn_fwd") == 6 and calls.count("gn_bwd") == 8, calls
    else:
        assert calls.count("gn_fwd") == calls.count("gn_bwd") == 2  # one norm per layer, each way
    monkeypatch.setattr(norm_mod, "gated_rms_norm", _reference)
    calls.clear()
    plain = run()
    assert "gn_fwd" not in calls and "gn_bwd" not in calls
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        assert_close(a, b, 1e-5, floor=1e-8)


@needs_native
def test_one_channel_no_grad_inference_mode_and_kept_outputs():
    """``D = 1`` from a transpose (its channel stride is not 1); under ``no_grad`` and
    ``inference_mode`` the kernel runs forward only, and an output kept across later calls (its
    buffer is the workspace cache's) is not overwritten."""
    x1 = torch.randn(1, 4, dtype=torch.float64).t()
    z1, w1 = torch.randn(4, 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    assert_close(gated_rms_norm(x1, z1, w1), _reference(x1, z1, w1, 1e-5, groups=1, gate_first=False), 1e-12)
    x, z, w, _ = _inputs((64, 16), 64, torch.float32)
    want = _reference(x, z, w, 1e-5, groups=1, gate_first=True)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            kept = gated_rms_norm(x, z, w, gate_first=True)
            copy = kept.clone()
            for seed in (1, 2):
                gated_rms_norm(*_inputs((64, 16), 64, torch.float32, seed)[:3], gate_first=True)
        assert torch.equal(kept, copy)
        assert_close(kept, want, 1e-6)


def test_forward_mode_ad_and_torch_func_use_the_pytorch_form():
    """Dual tensors (``torch.autograd.forward_ad``) and ``torch.func`` transforms see the PyTorch
    form (the kernel's Function has no ``jvp`` or batching rule): the JVP equals a central finite
    difference, and ``vmap`` equals a loop."""
    import torch.autograd.forward_ad as fwAD

    x, z, w, t = _inputs((3,), 8, torch.float64, seed=4)
    with fwAD.dual_level():
        y = gated_rms_norm(fwAD.make_dual(x, t), z, w, groups=2, gate_first=True)
        jvp = fwAD.unpack_dual(y).tangent
    h = 1e-6
    fd = (
        gated_rms_norm(x + h * t, z, w, groups=2, gate_first=True)
        - gated_rms_norm(x - h * t, z, w, groups=2, gate_first=True)
    ) / (2 * h)
    assert_close(jvp, fd, 1e-8)
    batched = torch.func.vmap(lambda a, b: gated_rms_norm(a, b, w, groups=2))(x, z)
    looped = torch.stack([gated_rms_norm(a, b, w, groups=2) for a, b in zip(x, z)])
    assert_close(batched, looped, 1e-12)


@needs_native
def test_strided_inputs_are_read_in_place_or_copied():
    """``z`` a slice of a wider projection (Mamba-2's ``z`` out of ``in_proj``: rows 24 apart, read
    in place) and ``x`` a transpose (no fixed row stride: copied) give the contiguous result."""
    x, z, w, dy = _inputs((3, 5), 16, torch.float64)
    wide = torch.cat([z, torch.randn(3, 5, 8, dtype=torch.float64)], -1)
    z_slice = wide[..., :16]
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert not z_slice.is_contiguous() and not x_t.is_contiguous()
    for gate_first in (False, True):
        want = _value_and_grads(gated_rms_norm, x, z, w, dy, groups=2, gate_first=gate_first)
        got = _value_and_grads(gated_rms_norm, x_t, z_slice, w, dy, groups=2, gate_first=gate_first)
        for a, b in zip(got, want):
            assert_close(a, b, 1e-14)
