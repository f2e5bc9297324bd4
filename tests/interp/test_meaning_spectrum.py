"""The memory spectrum's documented defaults on a tiny model whose answer is known by count."""

from __future__ import annotations

import torch

from mnemo.interp.spectrum import memory_spectrum
from mnemo.models import LanguageModel, build_config


def test_a_test_time_memory_gets_32_exponents_per_head_by_default():
    """``directions`` defaults to 32 (docstring): a test-time-trained memory whose state has more
    than 32 dimensions per head (d_model 16 over 4 heads: a 4 → 16 → 4 MLP memory, 4·16 + 16·4 =
    128 weights per head, plus its momentum: 256) gets its leading 32 exponents per head."""
    torch.manual_seed(0)
    model = LanguageModel(build_config("titans_lmm", vocab_size=20, d_model=16, n_layers=1)).double().eval()
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(0))
    e = memory_spectrum(model, ids)["0"]
    assert e["kind"] == "test-time (JVP)" and e["heads"] == 4 and e["dim"] == 2 * (4 * 16 + 16 * 4)
    assert [len(row) for row in e["exponents"]] == [32] * 4
    assert e["summary"]["computed"] == 4 * 32 and e["summary"]["directions"] == 4 * e["dim"]
