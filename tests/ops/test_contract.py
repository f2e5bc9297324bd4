"""DESIGN.md §4 for every recurrent op variant in ``mnemo.testing.SPECS`` (see ``mnemo/testing``).

Each check returns a result; ``require`` raises with the worst comparison when it failed."""

from __future__ import annotations

import pytest

from mnemo.testing import SPECS, require
from mnemo.testing import contract as C

ids = [s.name for s in SPECS]
# (spec, mode) pairs for the forms each op has: fast forms only, or all forms including the reference
FAST = [pytest.param(s, m, id=f"{s.name}-{m}") for s in SPECS for m in s.modes if m != "recurrent"]
ALL = [pytest.param(s, m, id=f"{s.name}-{m}") for s in SPECS for m in s.modes]


@pytest.mark.parametrize("spec", SPECS, ids=ids)
@pytest.mark.parametrize("with_state", [False, True])
def test_forms_agree(spec, with_state):
    c = spec.chunk_size
    for T in (1, c - 1, c, c + 1, 2 * c + 5, 37):
        require(C.check_forms_agree(spec, T, with_state))


@pytest.mark.parametrize("spec, mode", FAST)
def test_split_with_carried_state(spec, mode):
    c = spec.chunk_size
    T = 2 * c + 7
    for a in (1, c - 1, c, c + 1, T - 1):
        require(C.check_split(spec, T, a, mode))


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_token_steps_after_prefill(spec):
    c = spec.chunk_size
    for prefill in (1, c - 1, c + 2):
        require(C.check_token_steps_after_prefill(spec, c + 6, prefill, "chunk"))


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_gradients_agree(spec):
    require(C.check_gradients_agree(spec, 2 * spec.chunk_size + 3))


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_gradcheck_reference(spec):
    require(C.check_gradcheck_reference(spec))


@pytest.mark.parametrize("spec, mode", ALL)
@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_separate(spec, mode, with_state):
    c = spec.chunk_size
    require(C.check_varlen(spec, [c + 3, 0, 1, 2 * c - 1], mode, with_state))


@pytest.mark.parametrize("spec, mode", FAST)
def test_float32_realistic(spec, mode):
    require(C.check_float32_realistic(spec, mode))


@pytest.mark.parametrize("spec, mode", ALL)
def test_empty_sequence_passes_state(spec, mode):
    require(C.check_empty(spec, mode))
