"""Session 37's small leftovers from the reviews: counts that meant nothing refused by name, and the
benchmark scripts' JSON strict."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mnemo.bench import write_json
from mnemo.data.stream import TokenStream
from mnemo.layers.ssm import Mamba2


def _stream() -> TokenStream:
    return TokenStream(torch.arange(41) % 7, seq_len=4)


def test_eval_batches_yields_every_window_once_in_order():
    s = _stream()
    xs = [x for x, _ in s.eval_batches(3)]  # 40 // 4 = 10 windows: batches of 3, 3, 3, 1
    assert [x.shape[0] for x in xs] == [3, 3, 3, 1]
    torch.testing.assert_close(torch.cat(xs).flatten(), (torch.arange(40) % 7))
    assert [x.shape[0] for x, _ in s.eval_batches(3, 2)] == [3, 3]


@pytest.mark.parametrize(
    "batch_size,max_batches,name",
    [(0, None, "batch_size"), (True, None, "batch_size"), (2, 0, "max_batches"), (2, -1, "max_batches"),
     (2, 1.5, "max_batches")],
)  # fmt: skip
def test_eval_batches_refuses_counts_that_mean_nothing(batch_size, max_batches, name):
    """``0`` yielded nothing (a mean over no data), ``-1`` dropped the last batch silently."""
    with pytest.raises(ValueError, match=rf"{name}: expected an int >= 1"):
        list(_stream().eval_batches(batch_size, max_batches))


def test_mamba2_refuses_a_bool_norm_groups():
    """``norm_groups=True`` built a one-group norm (as 1) instead of being refused as other int
    options that are bools are."""
    with pytest.raises(ValueError, match="norm_groups: expected an int >= 1 or None, got True"):
        Mamba2(d_model=16, norm_groups=True)
    assert Mamba2(d_model=16, norm_groups=2).norm_groups == 2


def test_write_json_is_strict_json(tmp_path):
    out = tmp_path / "b.json"
    write_json(out, {"rows": [{"ms": math.nan, "ratio": math.inf, "n": 3}]})
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "rows": [{"ms": None, "ratio": None, "n": 3}],
        "nonfinite": {"rows/0/ms": "NaN", "rows/0/ratio": "Infinity"},  # (review 7: named, as probe/train)
    }
