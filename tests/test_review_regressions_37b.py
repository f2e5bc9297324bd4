"""Regression review of fb287ab (backend table), 3d348a1 (interp refusals and precision) and
aa0e129 (bench JSON, FLOP formulas): what those fixes broke or left out."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------- 3d348a1: 0-d tensors still taken


def _decays():
    return torch.diag(torch.tensor([0.9, 0.5], dtype=torch.float64)).expand(5, 2, 2)


@pytest.mark.parametrize("k", [np.int64(1), torch.tensor(1)])
def test_the_qr_iteration_still_takes_a_numpy_or_0d_tensor_k(k):
    """``k`` went through ``int(k)``: a 0-d tensor count was taken; the new check refused it."""
    from mnemo.interp.lyapunov import matrix_spectrum

    got = matrix_spectrum(_decays(), k=k)
    torch.testing.assert_close(got, matrix_spectrum(_decays(), k=1), rtol=0, atol=0)


def test_the_qr_iteration_still_takes_a_0d_tensor_token_count():
    """``tokens`` was the sums' divisor: a 0-d tensor divided as well as a number."""
    from mnemo.interp.lyapunov import matrix_spectrum

    got = matrix_spectrum(_decays(), tokens=torch.tensor(20.0))
    torch.testing.assert_close(got, matrix_spectrum(_decays(), tokens=20), rtol=0, atol=0)
    with pytest.raises(ValueError, match="^tokens: expected"):
        matrix_spectrum(_decays(), tokens=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="^k: expected"):
        matrix_spectrum(_decays(), k=torch.tensor(True))


# ------------------------------------------- 3d348a1: a Python-float metric of a float64 model


@torch.no_grad()
def test_activation_patching_keeps_a_python_float_metric_unrounded():
    """The fix kept a float64 *tensor* metric in float64, but a metric that returns a Python float
    (a double, e.g. ``float(...)`` of a float64 model's logits) was still stored in float32."""
    from mnemo.interp.interventions import activation_patching, logit_difference, patch
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("gla", vocab_size=17, d_model=32, n_layers=2)).double().eval()
    clean = torch.randint(0, 17, (2, 7), generator=torch.Generator().manual_seed(1))
    corrupted = torch.randint(0, 17, (2, 7), generator=torch.Generator().manual_seed(2))
    diff = logit_difference(3, 4)

    def metric(logits):
        return float(diff(logits))

    res = activation_patching(m, clean, corrupted, metric, "hook_o", per="layer")
    assert res.values.dtype == torch.float64
    _, cache = m.run_with_cache(clean, names="hook_o")
    for i, name in enumerate(res.names):
        assert float(res.values[i]) == metric(m.run_with_hooks(corrupted, patch(m, cache, name))[0])


# ------------------------------------------------- aa0e129: a published number the fix made stale


def _row_percent(text: str, op: str) -> float:
    (line,) = [ln for ln in text.splitlines() if re.match(rf"{op}\s+chunk\s+fp32\s+4096\s", ln)]
    return float(line.split()[-2])  # the %peak column (decode us last)


def test_the_benchmarks_guide_quotes_the_corrected_delta_rule_percent_of_peak():
    """The guide quoted the gated delta rule's 31% of peak from all_cpu_2core.txt, whose header now
    says the delta rows' GFLOP/s and % peak are 10/9 too low (the product with the inverse)."""
    rec = (ROOT / "docs/benchmarks/all_cpu_2core.txt").read_text()
    gdr = _row_percent(rec, "gated_delta_rule") * 10 / 9
    gla = _row_percent(rec, "gla_scalar")
    guide = " ".join((ROOT / "docs/guides/benchmarks.md").read_text().split())
    m = re.search(r"at (\d+)% and (\d+)% of the fp32 matmul peak", guide)
    assert m is not None
    assert (int(m[1]), int(m[2])) == (round(gdr), round(gla)), (m[0], gdr, gla)
    assert math.isclose(gdr, 34.67, abs_tol=0.01)
