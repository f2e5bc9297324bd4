"""The selective scan's clamp of ``Δ·A`` at −60 in the gradient (zero where the clamp is active,
for any ``A``), and what a failed native build tells the user (the compiler's own words)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mnemo.ops import selective_scan
from tests.helpers import assert_close


@pytest.mark.parametrize("native", ["1", "0"])
def test_clamped_steps_pass_no_gradient_for_any_decay_rate(native, monkeypatch):
    """Δ = 400 at one token: Δ·A ≤ −2 · 60 is clamped at −60 for every channel there, and that
    token's decay passes no gradient; every other token (Δ up to 2, some |A| as small as 0.005, so
    Δ / |A| is large but Δ·A is not) passes its full gradient. Against the token-loop reference."""
    monkeypatch.setenv("MNEMO_NATIVE", native)
    g_ = torch.Generator().manual_seed(0)
    Bt, T, Dm, N = 2, 12, 3, 4
    u = torch.randn(Bt, T, Dm, generator=g_, dtype=torch.float64)
    delta = torch.rand(Bt, T, Dm, generator=g_, dtype=torch.float64) * 2.0
    delta[:, 5] = 400.0
    A = -torch.logspace(-2.3, 1.3, Dm * N, dtype=torch.float64).reshape(Dm, N)  # |A| from 0.005 to 20
    Bm, Cm = (torch.randn(Bt, T, N, generator=g_, dtype=torch.float64) for _ in range(2))
    grads = {}
    for mode in ("recurrent", "chunk"):
        leaves = [t.clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm)]
        y, _ = selective_scan(*leaves, mode=mode, chunk_size=4)
        grads[mode] = torch.autograd.grad((y * torch.cos(y)).sum(), leaves)
    for name, got, ref in zip(("u", "delta", "A", "B", "C"), grads["chunk"], grads["recurrent"]):
        assert_close(got, ref, 1e-10, what=f"d/d{name}")


def test_a_failed_native_build_warns_with_the_compilers_message(tmp_path):
    cc = tmp_path / "fake-cc"
    cc.write_text("#!/bin/sh\necho 'fatal: this compiler refuses' >&2\nexit 3\n")
    cc.chmod(0o755)
    code = textwrap.dedent(
        """
        import warnings
        from mnemo.ops import _native
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            assert _native.library() is None
        print("\\n".join(str(w.message) for w in rec))
        """
    )
    env = dict(os.environ, CC=str(cc), MNEMO_NATIVE="1", MNEMO_NATIVE_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "native CPU kernels unavailable" in out.stdout
    assert "exited with 3: fatal: this compiler refuses" in out.stdout  # text, not a bytes repr


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_clamp_applies_when_only_the_largest_step_times_a_crosses_the_floor(native, monkeypatch):
    """One channel, one state, A = −10: Δ_0 = 0.5 (Δ_0·A = −5) and Δ_1 = 10 (Δ_1·A = −100 < −60,
    clamped), while Δ_max / A = −1 and Δ_min·A = −5 stay above the floor. With B = C = 1, u = (1, 0):
    h_0 = Δ_0 u_0 = 0.5, y_0 = 0.5, y_1 = h_1 = e^{−60} · 0.5 (unclamped it would be e^{−100} · 0.5)."""
    monkeypatch.setenv("MNEMO_NATIVE", native)
    u = torch.tensor([[[1.0], [0.0]]], dtype=torch.float64)
    delta = torch.tensor([[[0.5], [10.0]]], dtype=torch.float64)
    A = torch.tensor([[-10.0]], dtype=torch.float64)
    Bm = Cm = torch.ones(1, 2, 1, dtype=torch.float64)
    expected = torch.tensor([0.5, 0.5 * math.exp(-60.0)], dtype=torch.float64)
    for mode in ("chunk", "recurrent"):
        y, hT = selective_scan(u, delta, A, Bm, Cm, mode=mode, output_final_state=True)
        assert y[0, :, 0].tolist() == pytest.approx(expected.tolist(), rel=1e-12, abs=0), mode
        assert hT.item() == pytest.approx(0.5 * math.exp(-60.0), rel=1e-12, abs=0), mode


def test_a_valid_strided_view_passes_the_check_and_the_bad_argument_after_it_is_named(monkeypatch):
    """``M~[jobs//H, H, n, K, K] mb mh mn mr``: a view of that shape whose strides are the four
    ints after it and whose *last* stride is 1 is valid, whatever its head stride ``mh`` (here 18).
    With M and D valid and ``states`` one element short, the error names ``states``."""
    from mnemo.ops import _native

    monkeypatch.setattr(_native, "_simd_width", 8)  # the lanes are not in this declaration
    H, n, K, Vd, jobs = 2, 3, 2, 2, 4
    Mbase = torch.zeros(jobs // H, H, n, K, K + 1)  # strides (36, 18, 6, 3, 1)
    M = Mbase[..., :K]
    Dbase = torch.zeros(jobs // H, H, n, K, Vd + 1)
    D = Dbase[..., :Vd]
    assert M.stride() == (36, 18, 6, 3, 1) and D.stride() == (36, 18, 6, 3, 1)
    S0, Sf = torch.zeros(jobs * K * Vd), torch.zeros(jobs * K * Vd)
    states = torch.zeros(jobs * n * K * Vd)
    args = [H, n, K, Vd, S0, _native.Strided(M), *M.stride()[:-1], _native.Strided(D), *D.stride()[:-1]]
    _native._check_args("scan_mat_fwd", torch.float32, jobs, 1, args + [states, Sf])  # valid: no error
    with pytest.raises(ValueError, match=r"scan_mat_fwd: states must have \[jobs\*n\*K\*Vd\] = 48 elements"):
        _native._check_args("scan_mat_fwd", torch.float32, jobs, 1, args + [states[:-1], Sf])
    # and a last stride of 2 (every other float) is refused, naming M
    M2 = torch.zeros(jobs // H, H, n, K, 2 * K)[..., ::2]
    bad = [H, n, K, Vd, S0, _native.Strided(M2), *M2.stride()[:-1], *args[10:]]
    with pytest.raises(ValueError, match="scan_mat_fwd: M must be a view of shape"):
        _native._check_args("scan_mat_fwd", torch.float32, jobs, 1, bad + [states, Sf])
