"""Every registered mixer passes the generic checks of :mod:`mnemo.testing.mixers` (streaming in
any split, token steps, state size, hooks, implicit attention where it exists, gradients, cached
decoding in a model)."""

from __future__ import annotations

import pytest

from mnemo.layers import MIXERS
from mnemo.testing.mixers import check_mixer


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_registered_mixer_passes_the_generic_checks(name):
    results = check_mixer(name)
    failed = [(r.check, r.error, r.message) for r in results if not r.passed]
    assert not failed, failed
    assert {"split", "token_steps", "state_size", "hooks", "gradients", "cached_decoding"} <= {
        r.check for r in results
    }
