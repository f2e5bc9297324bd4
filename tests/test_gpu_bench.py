"""``scripts/gpu_bench.py`` (the benchmark of ``scripts/gpu_check.sh``) runs at its ``--tiny`` size
on the CPU and writes the JSON its readers expect: every case has every field, mnemo's cases ran
(a train step and a generation with positive times and throughputs matching ``batch · T``), the
``auto`` case records which backend ran its ops, a peer that is not installed is ``unavailable``
with the import error, and a case that cannot start in the time budget is ``skipped`` with the
reason. (No timing is asserted.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.filterwarnings("ignore")
def test_tiny_run_on_cpu_writes_the_json_schema(tmp_path):
    bench = _load()
    out = tmp_path / "gpu_check.json"
    log = tmp_path / "pytest.log"
    log.write_text("...\n3 passed in 1.00s\n")
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--models", "gated_deltanet", "--steps", "1"]
    argv += ["--case-s", "0", "--max-step-s", "1e9"]  # one timed step; no length skipped for time
    assert bench.main([*argv, "--tests-log", str(log), "--tests-rc", "0"]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == bench.SCHEMA and result["device"] == "cpu" and result["complete"] is True
    assert result["config"]["size"] == "tiny" and result["config"]["lengths"] == [16, 32]
    assert result["tests"] == {"rc": 0, "summary": "3 passed in 1.00s", "log": str(log)}
    assert {"torch", "triton", "fla", "mamba_ssm", "gpu"} <= set(result["versions"])
    cases = result["cases"]
    # two lengths x (mnemo auto, mnemo torch, the fla peer), the shorter length first
    assert [(c["impl"], c["backend"], c["T"]) for c in cases] == [
        (impl, backend, T)
        for T in (16, 32)
        for impl, backend in (("mnemo", "auto"), ("mnemo", "torch"), ("fla", "-"))
    ]
    for c in cases:
        assert set(c) == set(bench.CASE_FIELDS), c
    for c in (c for c in cases if c["impl"] == "mnemo"):
        assert c["status"] == "ok", c
        assert c["batch"] == 64 // c["T"] and c["params"] > 0
        assert c["train_step_s"] > 0 and c["train_steps_timed"] == 1
        assert c["train_tokens_per_s"] == pytest.approx(c["batch"] * c["T"] / c["train_step_s"])
        assert c["decode_tokens_per_s"] == pytest.approx(4 / c["generate_s"])
        ran = {key.split(":")[1] for key in c["dispatch"]}
        assert ran and (ran == {"torch"} if c["backend"] == "torch" else ran <= {"native", "torch"}), c
    peer = cases[2]
    if importlib.util.find_spec("fla.models") is None:
        assert peer["status"] == "unavailable" and "fla.models" in peer["reason"]
        assert cases[5]["status"] == "skipped" and "failed at T=16: unavailable" in cases[5]["reason"]


def test_a_case_that_cannot_start_in_the_budget_is_skipped_with_the_reason(tmp_path):
    bench = _load()
    out = tmp_path / "b.json"
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--models", "transformer", "--no-peers"]
    assert bench.main([*argv, "--budget-s", "0", "--min-case-s", "1"]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4 and all(c["status"] == "skipped" for c in cases)
    assert all(c["reason"].startswith("time budget") and c["train_step_s"] is None for c in cases)
