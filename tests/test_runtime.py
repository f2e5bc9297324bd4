"""``mnemo.runtime.tune_malloc``: freed tensor memory stays in the process (no fresh pages, so no
page faults, for the next tensors), the switch, and the CLI applying it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mnemo import runtime

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

# Two rounds of 50 live 4 MiB tensors; the page faults of the second round are printed. By default
# glibc gives the freed 200 MiB back to the kernel, so the second round faults on every page again.
_ROUNDS = """
import resource, sys, torch
from mnemo.runtime import tune_malloc
applied = tune_malloc() if sys.argv[1] == "tune" else False
def round_():
    xs = [torch.empty(1 << 20).fill_(1.0) for _ in range(50)]
    del xs
round_()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _second_round_faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@glibc_only
def test_tuned_malloc_reuses_freed_memory_instead_of_faulting_in_fresh_pages():
    applied, tuned = _second_round_faults("tune")
    assert applied
    _, default = _second_round_faults("default")
    # 200 MiB are 51,200 pages: the default faults on about all of them again (measured 51,198),
    # the tuned process on a small part (measured 2,049)
    assert default > 40_000
    assert tuned < default / 3


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("MNEMO_MALLOC_TUNE", "0")
    monkeypatch.setattr(runtime, "_tuned", False)
    assert runtime.tune_malloc() is False
    assert runtime.malloc_tuned() is False


@glibc_only
def test_malloc_tuned_reports_success(monkeypatch):
    monkeypatch.setattr(runtime, "_tuned", False)  # restored afterwards (the settings stay: harmless)
    assert runtime.tune_malloc() is True
    assert runtime.malloc_tuned() is True


def test_the_cli_applies_it(monkeypatch, capsys):
    from mnemo import cli

    calls = []
    monkeypatch.setattr(runtime, "tune_malloc", lambda *a, **k: calls.append(1) or True)
    assert cli.main(["models"]) == 0
    assert calls == [1]
