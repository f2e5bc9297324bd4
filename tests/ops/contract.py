"""Moved to :mod:`mnemo.testing` (the equivalence contract as a public tool).

Kept for old imports: the same names, with the ``check_*`` functions raising ``AssertionError``
(:class:`mnemo.testing.ContractError`) on failure as they used to, instead of returning a result.
"""

from __future__ import annotations

import functools

from mnemo.testing import F64_TOL, OpSpec, require  # noqa: F401
from mnemo.testing import contract as _contract


def _raising(check):
    @functools.wraps(check)
    def checked(*args, **kwargs):
        return require(check(*args, **kwargs))

    return checked


check_forms_agree = _raising(_contract.check_forms_agree)
check_split = _raising(_contract.check_split)
check_token_steps_after_prefill = _raising(_contract.check_token_steps_after_prefill)
check_gradients_agree = _raising(_contract.check_gradients_agree)
check_gradcheck_reference = _raising(_contract.check_gradcheck_reference)
check_varlen = _raising(_contract.check_varlen)
check_float32_realistic = _raising(_contract.check_float32_realistic)
check_empty = _raising(_contract.check_empty)
