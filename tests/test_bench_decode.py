"""The decode benchmark's memory reading (the timings themselves are never asserted)."""

from __future__ import annotations

import subprocess
import sys

import torch

from mnemo.bench.decode import peak_rss_mb


def test_peak_rss_grows_with_an_allocation_and_starts_fresh_in_a_child():
    before = peak_rss_mb()
    big = torch.ones(64, 2**20)  # 256 MiB, touched
    assert big.sum().item() > 0
    after = peak_rss_mb()
    assert after >= before + 200
    # a fresh child process reports its own peak, not this (now larger) process's
    code = "from mnemo.bench.decode import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    assert 0 < child < after
