"""The equivalence contract as a public tool: check that an op implements the recurrence it claims.

Give :func:`verify` an op-like callable and the recurrence it claims to implement — a mnemo op name
such as ``"gated_delta_rule"``, whose ``mode="recurrent"`` token loop then serves as the reference —
and it runs every check that applies, returning a :class:`Report` of :class:`CheckResult` rows::

    from mnemo.testing import verify

    report = verify(my_gdr, claims="gated_delta_rule", modes=("chunk",))
    print(report.table())          # op, check, pass/FAIL, worst error, tolerance
    report.raise_if_failed()       # or: assert report.passed

The checks (DESIGN.md §4), each a ``check_*`` function returning a :class:`CheckResult`:

==========================  =======================================================================
``forms`` / ``forms+S0``    each mode equals the reference: outputs and final states, from a zero
                            and from a random initial state, at odd lengths ``1, c−1, c, c+1,
                            2c+5, 37`` (``c`` the chunk size); the output also with
                            ``output_final_state=False``; the inputs and the initial state
                            left unchanged
``split``                   ``x[:, :a]`` then ``x[:, a:]`` from the carried state == one run
``decode``                  prefill, then 1-token steps from the carried state == one run
``grad``                    gradients w.r.t. every input (per-op parameters such as ssd's ``A``
                            too: ``OpSpec.static``) and the initial state == the reference's
``gradcheck``               ``torch.autograd.gradcheck`` of the reference (when it is the op's own)
``varlen`` / ``varlen+S0``  sequences packed with ``cu_seqlens`` == each sequence alone
``float32``                 float32 at a realistic size vs the float64 reference
``empty``                   ``T = 0``: empty output, the initial state passed through exactly
==========================  =======================================================================

A check that needs a feature the op lacks (``OpSpec.supports``: ``initial_state``,
``final_state``, ``varlen``, ``grad``, ``empty``) is not run.

Shapes: time is dim 1. ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, scalar gates ``[B, T, H]``,
per-channel gates ``[B, T, H, K]``, matrix states ``[B, H, K, V]`` (``[N, H, K, V]`` with
``cu_seqlens``, ``B = 1``). Ops return ``(o, final_state)``. Selective scan and SSD map
``(B, H, K, V)`` onto their own shapes (see :mod:`mnemo.testing.specs`).

Dtypes: the float64 checks draw float64 inputs and states; an op may compute in another precision,
but is then held to the float64 tolerance unless its spec says otherwise (``f64_tol``). The
``float32`` check draws float32 inputs, requires float32 outputs, and compares with the reference
run on the same inputs upcast to float64.

Tolerances (relative RMS, ``rms(got − ref) / max(rms(ref), 1e-6)``): float64 ``1e-10``
(:data:`F64_TOL`), float32 ``2e-5`` (:data:`F32_TOL`) unless the spec says otherwise; ``empty``
is exact; ``gradcheck`` uses ``eps = atol = 1e-6``.

Errors: checks never raise for a wrong op — an exception raised by the op becomes a failed row
(``error = inf``, the exception kept in ``CheckResult.exception``). :func:`require` and
:meth:`Report.raise_if_failed` raise :class:`ContractError` (an ``AssertionError``) for tests.
:func:`claim` raises ``KeyError`` for an unknown ``claims`` name. Third-party references
(:mod:`mnemo.testing.third_party`) raise :class:`ThirdPartyUnavailable` (an ``ImportError``) with a
one-line message when the package is missing.
"""

from .claims import claim, verify
from .compare import F32_TOL, F64_TOL, FLOOR, assert_close, compare, rel_rms
from .contract import (
    FEATURES,
    CheckResult,
    ContractError,
    OpSpec,
    Report,
    check_empty,
    check_float32_realistic,
    check_forms_agree,
    check_gradcheck_reference,
    check_gradients_agree,
    check_split,
    check_token_steps_after_prefill,
    check_varlen,
    format_table,
    merge,
    plan,
    require,
    run_contract,
)
from .specs import SPECS, get_spec, spec_names
from .third_party import ThirdPartyUnavailable, third_party_specs

__all__ = [
    "F32_TOL",
    "F64_TOL",
    "FLOOR",
    "FEATURES",
    "assert_close",
    "compare",
    "rel_rms",
    "CheckResult",
    "ContractError",
    "OpSpec",
    "Report",
    "check_empty",
    "check_float32_realistic",
    "check_forms_agree",
    "check_gradcheck_reference",
    "check_gradients_agree",
    "check_split",
    "check_token_steps_after_prefill",
    "check_varlen",
    "claim",
    "format_table",
    "merge",
    "plan",
    "require",
    "run_contract",
    "verify",
    "SPECS",
    "get_spec",
    "spec_names",
    "ThirdPartyUnavailable",
    "third_party_specs",
]
