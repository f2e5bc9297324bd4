"""The fla and mamba_ssm backends, run on this CPU under Triton's interpreter.

Triton decides between compiled and interpreted kernels when a kernel module is imported
(``@triton.jit`` reads ``TRITON_INTERPRET`` then), and other tests of this process may already have
imported fla-core without it; so the cases run in one child process with ``TRITON_INTERPRET=1``
(:mod:`tests.ops.interpret_worker`, ~35 s), and the tests below assert on its results: for every
op and option the ``auto`` table claims a peer serves, float32 outputs, final states and the
gradients of every input against the ``torch`` backend and against the float64 token loop
(``mode="recurrent"``, the independent reference); the refusals of a forced peer; the shims;
``torch.library.opcheck``; ``torch.compile(fullgraph=True)`` through a custom op.

Tolerances (relative RMS), measured: ≤ 1e-6 for plain inputs; ≤ 1.2e-5 with hard resets and
log-gates of ``-1e4`` (fla's in-chunk cumulative sums of gates clamped at ``-60`` lose float32
digits, as mnemo's own float32 forms do: ``torch`` against the float64 loop differs as much).

Skipped (with the reason) when triton, fla-core or mamba-ssm are not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.ops import interpret_worker as worker

MISSING = [m for m in ("triton", "fla") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (pip install -e '.[dev]' brings them)"
)
#: mamba-ssm is not in [dev] (it builds CUDA code; see docs/guides/training.md): its cases skip alone
MAMBA = importlib.util.find_spec("mamba_ssm") is not None
needs_mamba = pytest.mark.skipif(
    not MAMBA,
    reason="mamba-ssm not installed (MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "
    "pip install --no-build-isolation --no-deps mamba-ssm)",
)

ROOT = Path(__file__).resolve().parents[2]

#: largest relative RMS error per case (see the module docstring)
TOL = {
    "gdn_state_scale": 3e-6,
    "gdn_hard_reset": 3e-5,
    "gdn_varlen": 3e-6,
    "gdn_no_state": 3e-6,
    "delta_rule_state": 3e-6,
    "gla_scalar_reset": 3e-5,
    "gla_channel_reset": 2e-5,
    "gla_no_gate_varlen": 1e-6,
    "linear_attention_identity": 1e-6,
    "linear_attention_elu_normalize": 3e-6,
    "ssd_fla": 2e-5,
    "ssd_mamba": 2e-5,
    "ssd_mamba_clamped": 2e-5,
}
#: the gradients each case must report (every float input)
GRADS = {
    "gdn_state_scale": {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"},
    "gdn_varlen": {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"},
    "delta_rule_state": {"dq", "dk", "dv", "dbeta", "dinitial_state"},
    "gla_channel_reset": {"dq", "dk", "dv", "dg", "dinitial_state"},
    "linear_attention_elu_normalize": {"dq", "dk", "dv", "dinitial_state"},
    "ssd_mamba": {"dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias", "dinitial_state"},
    "ssd_fla": {"dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias", "dinitial_state"},
}


#: the child's cases (:func:`tests.ops.interpret_worker.shared_child`)
INTERPRETED = ("tests.ops.interpret_worker", tuple(c for c in worker.CASES if MAMBA or "mamba" not in c))


@pytest.fixture(scope="module")
def results(request):
    return worker.shared_child(request, *INTERPRETED)


def _ok(res: dict, name: str) -> dict:
    assert "error" not in res[name], f"{name} raised in the worker:\n{res[name]['error']}"
    return res[name]


@pytest.mark.parametrize(
    "name", [n if "mamba" not in n else pytest.param(n, marks=needs_mamba) for n in sorted(TOL)]
)
def test_parity(results, name):
    r = _ok(results, name)
    assert r["finite"], f"{name}: NaN/inf in the peer's output or gradients"
    backend = "mamba_ssm" if "mamba" in name else "fla"
    assert r["log"] and r["log"][0][1] == backend, (
        f"{name}: the forced call did not run on {backend}: {r['log']}"
    )
    for against in ("vs_torch", "vs_reference"):
        errs = r[against]
        bad = {k: v for k, v in errs.items() if not v <= TOL[name]}
        assert not bad, f"{name}: relative error {against} above {TOL[name]:.0e}: {bad}"
    if name in GRADS:
        got = {k for k in r["vs_torch"] if k.startswith("d")}
        assert got == GRADS[name], f"{name}: gradients reported {sorted(got)}, expected {sorted(GRADS[name])}"
    assert "state" in r["vs_torch"] or name == "gdn_no_state"


def test_refusals(results):
    """A forced peer refuses what it cannot serve, naming the op, the backend and the reason;
    ``auto`` on a CPU picks native/torch even under the interpreter."""
    r = _ok(results, "refusals")
    expect = {
        "recurrent": ("gated_delta_rule", "'fla'", "mode='recurrent'"),
        "parallel": ("gated_linear_attention", "'fla'", "mode='parallel'"),
        "float64": ("gated_delta_rule", "'fla'", "float64"),
        "bfloat16": ("gated_delta_rule", "'fla'", "bfloat16"),
        "mamba_gdn": ("gated_delta_rule", "'mamba_ssm'", "no kernel"),
        "mamba_varlen": ("ssd", "'mamba_ssm'", "cu_seqlens" if MAMBA else "mamba-ssm not installed"),
    }
    for key, words in expect.items():
        assert r[key].startswith("BackendError"), f"{key}: expected a BackendError, got {r[key]!r}"
        for w in words:
            assert w in r[key], f"{key}: {w!r} missing from {r[key]!r}"
    assert r["selective_scan_untouched"] == "", "an op without a peer kernel must ignore use_backend"
    assert [row[1] for row in r["auto_on_cpu"]] == ["native", "torch"], r["auto_on_cpu"]
    assert r["create_graph"].startswith("RuntimeError") and "create_graph" in r["create_graph"]


def test_shims(results):
    r = _ok(results, "shims")
    assert r["installed"] == ["autotune", "range", "cuda_query"]
    assert r["sum_ok"], "the autotuned range-loop kernel computed a wrong sum under the shims"


def test_opcheck(results):
    r = _ok(results, "opcheck")
    for op, checks in r.items():
        if op == "case_seconds":
            continue
        assert checks and all(v == "SUCCESS" for v in checks.values()), f"opcheck {op}: {checks}"


def test_compiled_fullgraph(results):
    r = _ok(results, "compiled")
    assert r["o"] == 0.0 and r["state"] == 0.0, r


def test_worker_cases_all_asserted():
    """Every case of the worker is asserted on above (a new case without a test fails here)."""
    asserted = set(TOL) | {"refusals", "shims", "opcheck", "compiled"}
    assert set(worker.CASES) == asserted
