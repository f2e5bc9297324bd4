"""Regressions of review 38-O/38-P's fixes (bed1bbf, 7522bc4).

* ``mean_interval``'s mean became ``xs[0] + mean offset``: each offset ``x − xs[0]`` rounds, so the
  mean now depends on the order of the seeds (about a third of random triples of accuracies) and
  cancels to nothing for values of mixed magnitude; ``fsum`` gave the one correctly rounded mean.
* The HF wrapper reads ``states[0].offset`` before ``LanguageModel.forward`` can name a state entry
  that is not a ``BlockState`` (the check bed1bbf added): an ``AttributeError`` naming neither.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mnemo.sweep.stats import mean_interval


@pytest.mark.parametrize(
    "xs",
    [
        [3.4847353326257746, 0.6900654917962139, 4.888293935398851],
        [0.26373841528710407, 0.5110492269412363, 0.40683545470140603],
        [0.701699365882657, 0.8907396631083301, 0.329032072267762],
    ],
)
def test_mean_interval_does_not_depend_on_the_order_of_the_seeds(xs):
    means = {mean_interval(list(p))["mean"] for p in itertools.permutations(xs)}
    assert means == {math.fsum(xs) / len(xs)}


def test_mean_interval_mean_is_the_sum_over_n_under_cancellation():
    # the docstring's mean = Σx / n: 1/3 here (fsum is exact); the offsets from 1e16 lost the 1
    assert mean_interval([1e16, 1.0, -1e16])["mean"] == pytest.approx(1 / 3, rel=1e-15)
    assert mean_interval([1.0, 1e16, -1e16])["mean"] == pytest.approx(1 / 3, rel=1e-15)


@pytest.mark.parametrize("xs", [[1e308] * 3, [1.7e308] * 4, [0.99] * 3, [1 / 3] * 7])
def test_mean_interval_equal_values_still_give_themselves(xs):
    # what 7522bc4 gained, kept: n equal values give that value and zero spread, also where their
    # sum is past the float range (fsum raises OverflowError there)
    st = mean_interval(xs)
    assert st["mean"] == xs[0] and st["std"] == 0.0 and st["low"] == st["high"] == xs[0]


@pytest.mark.parametrize("entry", [None, (1, 2)])
def test_hf_forward_names_a_state_entry_that_is_not_a_block_state(entry):
    from mnemo.hf.modeling import MnemoConfig, MnemoForCausalLM
    from mnemo.models import build_config

    torch.manual_seed(0)
    cfg = MnemoConfig.from_model_config(build_config("gla", vocab_size=32, d_model=16, n_layers=2))
    m = MnemoForCausalLM(cfg).eval()
    ids = torch.randint(0, 32, (1, 4))
    for key in ("past_key_values", "cache"):
        with pytest.raises(ValueError, match=r"state\[0\]: expected the BlockState"):
            m(ids, **{key: [entry, entry]})
    out = m(ids)  # the returned cache is still taken
    m(ids[:, :1], cache=out.cache)
    m(ids[:, :1], past_key_values=list(out.cache.states))
