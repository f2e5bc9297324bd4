"""Both sides of every native kernel, in one process, whatever the machine has.

Each entry point of :mod:`mnemo.ops._native` (the selective scan, the short causal convolution, the
gated RMSNorm, SwiGLU's gate,
the delta rule's and gated linear attention's chunk-state passes and the unit lower-triangular
inverse, forward and backward) has a PyTorch twin that runs when the kernels are off
(``MNEMO_NATIVE=0``), when no C compiler is found or when the build fails. On a machine with a
compiler the rest of the suite only ever runs the kernels, and without one only the twins, so a
wrong twin (or a wrong kernel) would ship unnoticed. Here every case runs twice, with the switch
set on and then off (``monkeypatch``), and both runs are compared with the token-loop reference
(``mode="recurrent"``, or an explicit loop for the convolution), outputs and the gradients of every
input. A spy on :func:`mnemo.ops._native.call` proves which side ran: the kernels the case names on
the native side, none at all on the fallback side (where spies on the twins see them run).

Without a compiler the native side is skipped with a reason; the fallback side always runs.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.conv import ShortConvolution
from mnemo.layers.mlp import swiglu
from mnemo.layers.norm import gated_rms_norm
from mnemo.ops import (
    _native,
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    linear_attention,
    selective_scan,
)
from tests.helpers import assert_close, spy_native_calls

ch = importlib.import_module("mnemo.ops._chunked")
ss = importlib.import_module("mnemo.ops.selective_scan")
nm = importlib.import_module("mnemo.layers.norm")
mlp = importlib.import_module("mnemo.layers.mlp")
smm = importlib.import_module("mnemo.ops.small_mm")

#: every kernel of the library, without its ``_f32`` / ``_f64`` suffix
KERNELS = sorted({name.rsplit("_", 1)[0] for name in _native._ENTRY_POINTS})

#: the PyTorch twin that replaces each kernel (``None``: written inline in ``_CausalConv``)
TWINS = {
    "scan_mat_fwd": (ch, "scan_matrix_torch"),
    "scan_mat_bwd": (ch, "scan_matrix_reverse_torch_"),
    "scan_dec_fwd": (ch, "scan_decay_torch_"),
    "scan_dec_bwd": (ch, "scan_decay_reverse_torch_"),
    "unit_lower_inv": (ch, "unit_lower_inverse_torch_"),
    "ss_fwd": (ss, "ss_chunk_torch"),
    "ss_bwd": (ss, "ss_chunk_torch"),
    "conv_fwd": None,
    "conv_bwd": None,
    "gn_fwd": (nm, "_gated_rms_norm_reference"),
    "gn_bwd": (nm, "_gated_rms_norm_reference"),
    "glu_fwd": (mlp, "_swiglu_reference"),
    "glu_bwd": (mlp, "_swiglu_reference"),
    "smm_fwd": (smm, "_linear"),
}


@pytest.fixture(params=["native", "fallback"])
def backend(request, monkeypatch):
    """Switch the kernels on (skip if they cannot be built here) or off, and record what runs."""
    if request.param == "native":
        monkeypatch.setenv("MNEMO_NATIVE", "1")  # also when the whole suite runs with MNEMO_NATIVE=0
        if _native.library() is None:
            pytest.skip("native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)")
    else:
        monkeypatch.setenv("MNEMO_NATIVE", "0")
    native_calls = spy_native_calls(monkeypatch)
    twin_calls: list[str] = []
    for mod, fname in {t for t in TWINS.values() if t is not None}:
        real = getattr(mod, fname)

        def spy(*args, _real=real, _name=fname, **kwargs):
            twin_calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, fname, spy)
    return SimpleNamespace(kind=request.param, native_calls=native_calls, twin_calls=twin_calls)


def _rand(gen, *shape, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------------
# the cases: inputs, the form under test and the reference; each returns (outputs, inputs) so the
# gradients of every input can be taken under one fixed random loss
# ----------------------------------------------------------------------------------------------

B, T, H, K, V, C = 2, 29, 2, 5, 4, 8  # T: three full chunks of 8 and a partial one


def _qkv(gen, dtype, gate=None):
    x = {
        "q": _rand(gen, B, T, H, K, dtype=dtype),
        "k": F.normalize(_rand(gen, B, T, H, K, dtype=dtype), dim=-1),
        "v": _rand(gen, B, T, H, V, dtype=dtype),
        "S0": _rand(gen, B, H, K, V, dtype=dtype),
    }
    if gate is not None:  # log decays in (-1.3, 0): the fast chunk forms (well inside 30 nats a chunk)
        shape = (B, T, H) if gate == "scalar" else (B, T, H, K)
        x["g"] = F.logsigmoid(_rand(gen, *shape, dtype=dtype) + 1.5)
    return x


def _delta_case(gated, chunk):
    """``chunk`` 6: the PyTorch inverse pads each 6 x 6 matrix to 8 x 8 (8: no padding)."""

    def inputs(gen, dtype):
        x = _qkv(gen, dtype, "scalar" if gated else None)
        x["beta"] = (torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.9 + 0.05).to(dtype)
        return x

    def run(x, mode):
        kw = dict(initial_state=x["S0"], output_final_state=True, mode=mode, chunk_size=chunk)
        if gated:
            return gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], **kw)
        return delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], **kw)

    return inputs, run


def _gla_case(gate):
    def inputs(gen, dtype):
        return _qkv(gen, dtype, gate)

    def run(x, mode):
        return gated_linear_attention(
            x["q"],
            x["k"],
            x["v"],
            x.get("g"),
            initial_state=x["S0"],
            output_final_state=True,
            mode=mode,
            chunk_size=C,
        )

    return inputs, run


def _linear_attention_case():
    def inputs(gen, dtype):
        x = _qkv(gen, dtype)
        x["S0"] = x["S0"].abs()  # with the normaliser column below: a positive denominator
        return x

    def run(x, mode):
        S0 = torch.cat([x["S0"], x["S0"][..., :1]], -1)  # the normaliser lives in an extra column
        return linear_attention(
            x["q"],
            x["k"],
            x["v"],
            feature_map="elu",
            normalize=True,
            initial_state=S0,
            output_final_state=True,
            mode=mode,
            chunk_size=C,
        )

    return inputs, run


Dm, N, G = 20, 3, 2  # two groups of 10 channels: each padded to the kernel's channel tile


def _ss_inputs(gen, dtype, Bsz=B, Tn=T):
    return {
        "u": _rand(gen, Bsz, Tn, Dm, dtype=dtype),
        "delta": (torch.rand(Bsz, Tn, Dm, generator=gen, dtype=torch.float64) * 3 - 2).to(dtype),
        "A": -(_rand(gen, Dm, N, dtype=torch.float64) * 0.5).exp().to(dtype),
        "B": _rand(gen, Bsz, Tn, G, N, dtype=dtype),
        "C": _rand(gen, Bsz, Tn, G, N, dtype=dtype),
        "h0": _rand(gen, Bsz, Dm, N, dtype=dtype),
    }


def _ss_fused_case():
    """The public op with the step's bias and softplus, the skip ``D`` and the gate ``z`` (fused
    into the kernel on the native side, applied in PyTorch around the blocked scan otherwise)."""

    def inputs(gen, dtype):
        x = _ss_inputs(gen, dtype)
        x["D"] = _rand(gen, Dm, dtype=dtype)
        x["z"] = _rand(gen, B, T, Dm, dtype=dtype)
        x["bias"] = _rand(gen, Dm, dtype=dtype) * 0.5
        return x

    def run(x, mode):
        if mode == "recurrent":  # the step, skip and gate written out here, around the token loop
            step = F.softplus(x["delta"] + x["bias"])
            y, h = ss.ss_recurrent(step, x["u"], x["A"], x["B"], x["C"], x["h0"])
            return (y + x["D"] * x["u"]) * F.silu(x["z"]), h
        return selective_scan(
            x["u"],
            x["delta"],
            x["A"],
            x["B"],
            x["C"],
            x["D"],
            x["z"],
            x["bias"],
            True,
            initial_state=x["h0"],
            output_final_state=True,
            mode=mode,
            chunk_size=6,
        )

    return inputs, run


def _ss_varlen_case():
    """Packed sequences: the per-sequence core (``run_ss_core``) picks the kernel or the blocked
    PyTorch scan; the default block length (each side picks its own) and one step so large that
    ``Δ A`` is clamped at -60 (a reset)."""
    cu = torch.tensor([0, 9, 10, 31])

    def inputs(gen, dtype):
        x = _ss_inputs(gen, dtype, Bsz=1, Tn=31)
        x["delta"] = x["delta"].abs()
        x["delta"][0, 14, :4] = 1e3
        x["h0"] = _rand(gen, 3, Dm, N, dtype=dtype)
        return x

    def run(x, mode):
        return selective_scan(
            x["u"],
            x["delta"],
            x["A"],
            x["B"],
            x["C"],
            initial_state=x["h0"],
            output_final_state=True,
            cu_seqlens=cu,
            mode=mode,
        )

    return inputs, run


CW = 4  # convolution taps


def _conv_case(bias):
    def inputs(gen, dtype):
        x = {
            "x": _rand(gen, B, 11, Dm, dtype=dtype),
            "state": _rand(gen, B, Dm, CW - 1, dtype=dtype),
            "w": _rand(gen, Dm, CW, dtype=dtype) * 0.5,
        }
        if bias:
            x["b"] = _rand(gen, Dm, dtype=dtype)
        return x

    def run(x, mode):
        if mode == "recurrent":  # the definition, token by token: y_t = silu(Σ_i w_i x_{t-W+1+i} + b)
            xp = torch.cat([x["state"].transpose(1, 2), x["x"]], 1)  # [B, W-1+T, C]
            ys = [(xp[:, t : t + CW] * x["w"].t()).sum(1) for t in range(x["x"].shape[1])]
            y = torch.stack(ys, 1) + (x["b"] if bias else 0)
            return F.silu(y), xp[:, -(CW - 1) :].transpose(1, 2)
        conv = ShortConvolution(Dm, CW, bias=bias).to(x["x"].dtype)
        del conv.weight  # the test's own tensors (so their gradients can be taken)
        conv.weight = x["w"][:, None, :]
        if bias:
            del conv.bias
            conv.bias = x["b"]
        return conv(x["x"], x["state"])

    return inputs, run


def _gated_norm_case(gate_first):
    G = 3  # groups of 4 channels

    def inputs(gen, dtype):
        return {
            "x": _rand(gen, B, 11, 12, dtype=dtype),
            "z": 2 * _rand(gen, B, 11, 12, dtype=dtype),
            "w": 1 + 0.3 * _rand(gen, 12, dtype=dtype),
        }

    def run(x, mode):
        if mode == "recurrent":  # the definition, row by row and group by group
            rows = []
            for r in x["x"].flatten(0, 1).unbind(0):
                zr = x["z"].flatten(0, 1)[len(rows)]
                a = r * F.silu(zr) if gate_first else r
                y = torch.cat([c / (c.square().mean() + 1e-5).sqrt() for c in a.split(4)]) * x["w"]
                rows.append(y if gate_first else y * F.silu(zr))
            return (torch.stack(rows).unflatten(0, x["x"].shape[:2]),)
        return (gated_rms_norm(x["x"], x["z"], x["w"], groups=G, gate_first=gate_first),)

    return inputs, run


def _swiglu_case():
    def inputs(gen, dtype):  # 2H = 26: a partial SIMD register at every width; 22 rows over the threads
        return {"h": 3 * _rand(gen, B, 11, 26, dtype=dtype)}  # both tails of the sigmoid

    def run(x, mode):
        if mode == "recurrent":  # the definition, channel by channel: a / (1 + e^-a) * b
            a, b = x["h"][..., :13].unbind(-1), x["h"][..., 13:].unbind(-1)
            return (torch.stack([ai / (1 + torch.exp(-ai)) * bi for ai, bi in zip(a, b)], -1),)
        small, mlp._KERNEL_MIN_NUMEL = mlp._KERNEL_MIN_NUMEL, 0  # this case is below the kernel's size
        try:
            return (swiglu(x["h"]),)
        finally:
            mlp._KERNEL_MIN_NUMEL = small

    return inputs, run


def _small_mm_case():
    def inputs(gen, dtype):  # K = 45: a partial SIMD register at every width; N = 37: rows after the blocks
        return {
            "x": _rand(gen, 6, 45, dtype=dtype),
            "w": _rand(gen, 37, 45, dtype=dtype),
            "b": _rand(gen, 37, dtype=dtype),
        }

    def run(x, mode):
        if mode == "recurrent":  # the definition: one dot product per output, plus the bias
            rows = [[(xi * wn).sum() + bn for wn, bn in zip(x["w"], x["b"])] for xi in x["x"]]
            return (torch.stack([torch.stack(r) for r in rows]),)
        threaded, smm._THREADED_MIN_WEIGHT = smm._THREADED_MIN_WEIGHT, 0  # both threads at this size
        try:
            return (smm.small_mm(x["x"], x["w"], x["b"]),)
        finally:
            smm._THREADED_MIN_WEIGHT = threaded

    return inputs, run


#: case -> (inputs, run, the kernels it must reach on the native side)
CASES = {
    "delta_rule": (*_delta_case(False, 8), {"unit_lower_inv", "scan_mat_fwd", "scan_mat_bwd"}),
    "gated_delta_rule": (*_delta_case(True, 6), {"unit_lower_inv", "scan_mat_fwd", "scan_mat_bwd"}),
    "gla_scalar_gate": (*_gla_case("scalar"), {"scan_dec_fwd", "scan_dec_bwd"}),
    "gla_channel_gate": (*_gla_case("channel"), {"scan_dec_fwd", "scan_dec_bwd"}),
    "gla_no_gate": (*_gla_case(None), {"scan_dec_fwd", "scan_dec_bwd"}),
    "linear_attention": (*_linear_attention_case(), {"scan_dec_fwd", "scan_dec_bwd"}),
    "selective_scan_fused": (*_ss_fused_case(), {"ss_fwd", "ss_bwd"}),
    "selective_scan_varlen": (*_ss_varlen_case(), {"ss_fwd", "ss_bwd"}),
    "short_conv": (*_conv_case(True), {"conv_fwd", "conv_bwd"}),
    "short_conv_no_bias": (*_conv_case(False), {"conv_fwd", "conv_bwd"}),
    "gated_norm_gate_first": (*_gated_norm_case(True), {"gn_fwd", "gn_bwd"}),
    "gated_norm_gate_after": (*_gated_norm_case(False), {"gn_fwd", "gn_bwd"}),
    "swiglu": (*_swiglu_case(), {"glu_fwd", "glu_bwd"}),
    "small_mm": (*_small_mm_case(), {"smm_fwd"}),
}

#: relative RMS error against the float64 token loop, outputs and gradients: float64 agrees to
#: rounding (measured at most 7e-16, both sides), float32 to its precision (measured at most 3.3e-7)
TOL = {torch.float64: 1e-13, torch.float32: 2e-6}


def _outputs_and_grads(run, x, mode):
    xs = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    outs = run(xs, mode)
    gen = torch.Generator().manual_seed(123)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(loss, list(xs.values()))
    return list(outs), dict(zip(xs, grads))


def test_every_kernel_has_a_case():
    """A kernel added to the library without a case here fails this test."""
    covered = set().union(*(kernels for *_, kernels in CASES.values()))
    assert covered == set(KERNELS)
    assert set(TWINS) == set(KERNELS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_both_backends_match_the_token_loop(case, dtype, backend):
    inputs, run, kernels = CASES[case]
    x = inputs(torch.Generator().manual_seed(7), dtype)
    ref_outs, ref_grads = _outputs_and_grads(run, {n: t.double() for n, t in x.items()}, "recurrent")
    assert not backend.native_calls  # the reference never touches a kernel
    outs, grads = _outputs_and_grads(run, x, "chunk")
    if backend.kind == "native":
        assert kernels <= set(backend.native_calls), (
            f"kernels not reached: {kernels - set(backend.native_calls)}"
        )
    else:
        assert backend.native_calls == [], "a kernel ran although MNEMO_NATIVE=0"
        twins = {TWINS[k][1] for k in kernels if TWINS[k] is not None}
        assert twins <= set(backend.twin_calls), f"twins not reached: {twins - set(backend.twin_calls)}"
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert a.dtype == dtype
        assert_close(a, b, TOL[dtype], what=f"{case} [{backend.kind}] output {i}")
    for n, gr in ref_grads.items():
        assert_close(grads[n], gr, TOL[dtype], what=f"{case} [{backend.kind}] d/d{n}")
