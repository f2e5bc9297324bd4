"""The declared signatures of the native kernels (:data:`mnemo.ops._native.SIGNATURES`).

Every call of a C kernel goes through :func:`mnemo.ops._native.call`, which checks the arguments
against the kernel's declaration before any pointer reaches the kernel. Here:

* the declarations match the C prototypes (names, order, ints against pointers), read from the
  sources, so a kernel whose arguments change cannot keep a stale declaration;
* every kernel call the ops really make passes its check (recorded from small runs);
* every corruption of those calls (a missing argument, a wrong dtype, a non-contiguous or too
  small buffer, a missing tensor, a float for an int, wrong strides, a broken size condition)
  raises ``TypeError`` / ``ValueError`` naming the argument, and no kernel is reached.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.conv import ShortConvolution
from mnemo.layers.mlp import swiglu
from mnemo.layers.norm import gated_rms_norm
from mnemo.ops import _native, delta_rule, gated_delta_rule, gated_linear_attention, selective_scan
from mnemo.ops.small_mm import small_mm

needs_native = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)

FIXED = ["jobs", "nt", "slot0", "slot1"]  # the leading parameters of every kernel entry point


def _c_prototypes() -> dict[str, list[tuple[str, bool]]]:
    """``name -> [(parameter, is_pointer), ...]`` of the exported entry points in the C sources."""
    here = Path(_native.__file__).parent
    protos = {}
    pattern = re.compile(
        r"(?<!static )\b(?:void|int64_t)\s+(?:NAME\((\w+?)_,\s*SUF\)|(\w+?)_##SUF)\s*\(([^)]*)\)"
    )
    for path in sorted(here.glob("*.[ch]")):
        text = path.read_text().replace("\\\n", " ")
        for m in pattern.finditer(text):
            params = []
            for p in m.group(3).split(","):
                params.append((re.findall(r"\w+", p)[-1], "*" in p))
            protos[m.group(1) or m.group(2)] = params
    return protos


def test_declarations_match_the_c_prototypes():
    protos = _c_prototypes()
    kernels = {name.rsplit("_", 1)[0] for name in _native._ENTRY_POINTS}
    assert set(_native.SIGNATURES) == kernels  # (the integer-valued queries are not in that list)
    for name in _native.SIGNATURES:
        sig = _native._signature(name)
        declared = [(p, False) for p in FIXED] + [(p.name, p.kind != "int") for p in sig.params]
        assert protos[name] == declared, name
    for name, params in _native.QUERIES.items():
        assert protos[name] == [(p, False) for p in params.split()], name


# ----------------------------------------------------------------------------------------------
# the calls the ops make, recorded
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded():
    """One real call of every kernel (float32), with the arguments it was given."""
    if _native.library() is None:
        pytest.skip("native kernels unavailable")
    calls = {}
    real = _native.call

    def spy(name, dtype, jobs, nt, args):
        calls.setdefault(name, (dtype, jobs, nt, list(args)))
        return real(name, dtype, jobs, nt, args)

    mp = pytest.MonkeyPatch()
    mp.setenv("MNEMO_NATIVE", "1")
    mp.setattr(_native, "call", spy)
    mp.setattr("mnemo.layers.mlp._KERNEL_MIN_NUMEL", 0)  # SwiGLU's kernel at this small size too
    try:
        g = torch.Generator().manual_seed(0)
        B, T, H, K, V = 2, 21, 2, 8, 4

        def r(*shape):
            return torch.randn(shape, generator=g).requires_grad_()

        q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
        beta = torch.rand(B, T, H, generator=g).requires_grad_()
        gs = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2).requires_grad_()
        gc = F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 2).requires_grad_()
        loss = gated_linear_attention(q, k, v, gs, chunk_size=8, output_final_state=True)[0].sum()
        loss = loss + gated_linear_attention(q, k, v, gc, chunk_size=8)[0].sum()
        loss = loss + delta_rule(q, F.normalize(k, dim=-1), v, beta, chunk_size=8)[0].sum()
        loss = loss + gated_delta_rule(q, F.normalize(k, dim=-1), v, gs, beta, chunk_size=8)[0].sum()
        D, N = 20, 4
        u, dt, z = r(B, T, D), r(B, T, D), r(B, T, D)
        A = (-torch.rand(D, N, generator=g)).requires_grad_()
        y, _ = selective_scan(
            u, dt, A, r(B, T, N), r(B, T, N), r(D), z, r(D), delta_softplus=True, mode="chunk"
        )
        loss = loss + y.sum() + ShortConvolution(D, 4)(u)[0].sum()
        loss = loss + gated_rms_norm(u, z, r(D), groups=4, gate_first=True).sum()
        loss = loss + swiglu(r(B, T, 2 * D)).sum()
        loss = loss + small_mm(r(3, D), r(N, D), r(N)).sum()
        loss.backward()
    finally:
        mp.undo()
    return calls


@needs_native
def test_every_kernel_was_recorded_and_its_real_calls_pass(recorded):
    assert set(recorded) == set(_native.SIGNATURES)
    for name, (dtype, jobs, nt, args) in recorded.items():
        _native._check_args(name, dtype, jobs, nt, args)  # no error
        assert _native._signature(name).ok(dtype, jobs, nt, _native._lanes(), args), name  # the fast path


def _corruptions(name, dtype, jobs, nt, args):
    """``(what, args)`` pairs: each one corruption of a valid argument list."""
    sig = _native._signature(name)
    yield "a missing argument", args[:-1]
    yield "an extra argument", args + [0]
    for i, (p, a) in enumerate(zip(sig.params, args)):

        def with_(x, i=i):
            return args[:i] + [x] + args[i + 1 :]

        if p.kind == "int":
            yield f"{p.name} as a float", with_(float(a))
            yield f"{p.name} as a tensor", with_(torch.zeros(()))
            continue
        if a is None:
            continue
        t = a.tensor if isinstance(a, _native.Strided) else a
        wrap = _native.Strided if isinstance(a, _native.Strided) else (lambda x: x)
        other = torch.float64 if dtype == torch.float32 else torch.float32
        yield f"{p.name} in {other}", with_(wrap(t.to(other)))
        if not p.optional:
            yield f"{p.name} missing", with_(None)
        yield f"{p.name} as an int", with_(1)
        if p.kind == "tensor":
            yield f"{p.name} one element short", with_(t.flatten()[:-1].clone())
            yield f"{p.name} one element long", with_(torch.cat([t.flatten(), t.flatten()[:1]]))
            if t.numel() > 1:
                yield f"{p.name} not contiguous", with_(torch.empty(2 * t.numel(), dtype=t.dtype)[::2])
                yield f"{p.name} strided", with_(_native.Strided(t))
        else:
            yield f"{p.name} not Strided", with_(t.contiguous())
            yield f"{p.name} wider", with_(_native.Strided(torch.cat([t, t[..., :1]], -1)))
            k = p.size_text.count(",")
            for j in range(i + 1, i + 1 + k):  # the strides passed after it
                yield f"stride {sig.params[j].name} of {p.name} off", args[:j] + [args[j] + 1] + args[j + 1 :]


def _all_corruptions(recorded):
    for name, (dtype, jobs, nt, args) in sorted(recorded.items()):
        for what, bad in _corruptions(name, dtype, jobs, nt, args):
            yield name, dtype, jobs, nt, what, bad
        yield name, dtype, jobs, nt, "nt = 0", args


@needs_native
def test_corrupted_arguments_raise_before_any_kernel_runs(recorded, monkeypatch):
    _native._lanes()  # the SIMD width, read once before the library is taken away

    def no_kernel():
        raise AssertionError("a kernel was reached with a corrupted argument list")

    monkeypatch.setattr(_native, "_loaded", no_kernel)
    n = 0
    for name, dtype, jobs, nt, what, bad in _all_corruptions(recorded):
        with pytest.raises((TypeError, ValueError), match=f"native kernel {name}") as err:
            _native.call(name, dtype, jobs, 0 if what == "nt = 0" else nt, bad)
        assert "a kernel was reached" not in str(err.value), (name, what)
        n += 1
    assert n > 200


@needs_native
def test_messages_name_the_argument_and_the_declared_size(recorded):
    dtype, jobs, nt, args = recorded["scan_dec_fwd"]  # n K Vd Kl S0 dS lam Sf work
    bad = args[:8] + [args[8].flatten()[:-1].clone()]
    with pytest.raises(ValueError, match=r"work must have \[nt\*K\*Vd\] = \d+ elements .*got shape"):
        _native.call("scan_dec_fwd", dtype, jobs, nt, bad)
    with pytest.raises(ValueError, match="must be contiguous torch.float32 on the CPU, got torch.float64"):
        _native.call("scan_dec_fwd", dtype, jobs, nt, args[:4] + [args[4].double()] + args[5:])
    with pytest.raises(TypeError, match=r"takes 9 arguments after \(jobs, nt\), got 8; declared: n K Vd Kl"):
        _native.call("scan_dec_fwd", dtype, jobs, nt, args[:8])


@needs_native
def test_declared_conditions_between_sizes(recorded):
    # lam with one factor per row needs Kl = K; Kl = 2 (with lam sized for it) is neither 1 nor K
    dtype, jobs, nt, args = recorded["scan_dec_fwd"]
    n, K = args[0], args[1]
    lam2 = torch.ones(jobs * n * 2)
    with pytest.raises(ValueError, match=r"must satisfy Kl in \(1, K\)"):
        _native.call("scan_dec_fwd", dtype, jobs, nt, args[:3] + [2] + args[4:6] + [lam2] + args[7:])
    assert K != 2
    # the convolution's jobs are its channels
    dtype, jobs, nt, args = recorded["conv_fwd"]
    with pytest.raises(ValueError, match="must satisfy jobs == C"):
        _native.call("conv_fwd", dtype, jobs + 1, nt, args)
    # the selective scan's backward: too little scratch per slot, and a gate without its gradient
    dtype, jobs, nt, args = recorded["ss_bwd"]
    names = [p.name for p in _native._signature("ss_bwd").params]
    i_work, i_stride, i_dz = names.index("work"), names.index("work_stride"), names.index("dz")
    small = args[:i_work] + [args[i_work][:, :-1].clone(), args[i_stride] - 1]
    with pytest.raises(ValueError, match=r"must satisfy work_stride >= query\('ss_bwd_work'"):
        _native.call("ss_bwd", dtype, jobs, nt, small)
    assert args[names.index("z")] is not None
    with pytest.raises(ValueError, match="must satisfy z is None or dz is not None"):
        _native.call("ss_bwd", dtype, jobs, nt, args[:i_dz] + [None] + args[i_dz + 1 :])


def test_queries_take_their_declared_ints():
    with pytest.raises(TypeError, match=r"native query ss_bwd_work takes the ints \(jobs, nt, Dgp, N, L\)"):
        _native.query("ss_bwd_work", torch.float32, 1, 1, 16, 4)
    with pytest.raises(TypeError, match="native query nope takes the ints"):
        _native.query("nope", torch.float32, 1)


def test_undeclared_kernel_is_refused():
    with pytest.raises(ValueError, match="has no declared signature"):
        _native._check_args("nope", torch.float32, 1, 1, [])
