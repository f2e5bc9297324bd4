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
