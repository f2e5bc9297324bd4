"""The decode benchmark's memory reading (the timings themselves are never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

# run in a fresh interpreter: this process's own peak depends on the tests that ran before
CHILD = """
import json, subprocess, sys
import torch
from mnemo.bench.decode import peak_rss_mb
before = peak_rss_mb()
big = torch.ones(128, 2**20)  # 512 MiB, touched
assert big.sum().item() > 0
after = peak_rss_mb()
code = "from mnemo.bench.decode import peak_rss_mb; print(peak_rss_mb())"
child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
print(json.dumps({"before": before, "after": after, "child": child}))
"""


def test_peak_rss_grows_with_an_allocation_and_starts_fresh_in_a_child():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["after"] >= r["before"] + 400
    # the grandchild reports its own peak, not the 512 MiB larger one of the process that started it
    assert 0 < r["child"] < r["after"] - 300


def test_fill_state_gives_every_attention_cache_the_context_length():
    import torch

    from mnemo.bench.decode import _fill_state
    from mnemo.models import LanguageModel, build_config

    model = LanguageModel(build_config("gla_hybrid", vocab_size=256, d_model=32)).eval()
    with torch.no_grad():
        _, state = model(torch.randint(0, 256, (1, 4)))
        state = _fill_state(model, state, 50)
        assert [s.mixer.offset for s in state] == [50] * len(state)
        kv = [s.mixer.kv for s in state if hasattr(s.mixer, "kv")]
        assert kv and all(c.k.shape[1] == 50 and c.v.shape[1] == 50 for c in kv)
        logits, state = model(torch.randint(0, 256, (1, 1)), state)
    assert logits.shape == (1, 1, 256) and all(
        c.k.shape[1] == 51 for c in (s.mixer.kv for s in state if hasattr(s.mixer, "kv"))
    )
