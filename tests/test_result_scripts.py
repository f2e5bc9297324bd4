"""The scripts that rebuild results pages (issue 39): attention sinks, context extension and the
memory spectrum, at a tiny size (the numbers on the pages come from the full-size commands)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def _cli_in_process(argv: list[str]) -> int:
    """``mnemo ARGV`` run by this interpreter: what the scripts start as ``python -m mnemo.cli ARGV``
    processes (each of which re-imported torch and mnemo: ~4 s apiece, most of these tests' time);
    the global RNG and thread count are restored after it. The launchers themselves are tested on
    real processes (``test_train_runs_logs_each_command_and_names_every_failure``)."""
    import torch

    from mnemo.cli import main

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            return main(list(argv))
    finally:
        torch.set_num_threads(threads)


def _train_runs_in_process(calls: list):
    """A stand-in for scripts/train_runs.py's ``train_runs``: each job's ``python -m mnemo.cli``
    command run in this process, one after the other (a failure fails the test); returns the wall
    time per run folder as the real one does. ``calls`` records each argv."""
    import time

    def train_runs(jobs, parallel, label="train"):
        walls = {}
        for run, argv in jobs:
            assert argv[:3] == [sys.executable, "-m", "mnemo.cli"], argv
            calls.append(argv[3:])
            run.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            assert _cli_in_process(argv[3:]) == 0, argv
            walls[str(run)] = time.time() - t0
        return walls

    return train_runs


def test_attention_sinks_trains_measures_and_writes_its_block(tmp_path, monkeypatch):
    """Four tiny runs (BOS and plain, 2 seeds), the sink ratios, the stream table and the paired
    claims; the page's block is rewritten between its markers and the prose kept. A second call
    trains nothing (the runs resume as finished) and writes the same numbers. (The ``mnemo train``
    commands run in this process: see :func:`_cli_in_process`.)"""
    mod = _load("attention_sinks")
    calls: list = []
    monkeypatch.setattr(mod, "train_runs", _train_runs_in_process(calls))
    page = tmp_path / "page.md"
    page.write_text("# Sinks\n\nprose stays\n")
    argv = ["--steps", "4", "--seq-len", "32", "--batch-size", "2", "--d-model", "32", "--n-layers", "1"]
    argv += ["--window", "8", "--stream", "40", "--streams", "2", "--out", str(tmp_path / "runs")]
    argv += ["--page", str(page), "--seeds", "0,1"]
    assert mod.main(argv) == 0
    text = page.read_text()
    assert text.startswith("# Sinks\n\nprose stays\n")
    assert "<!-- mnemo:begin attention_sinks -->" in text and "<!-- mnemo:end attention_sinks -->" in text
    assert "| trained with BOS |" in text and "4 sinks beat the window-only cache" in text
    assert "not testable here**: 2 paired seed(s)" in text  # 2 seeds: no verdict
    report = json.loads((tmp_path / "runs" / "report.json").read_text())
    bos = report["bos"]["0"]
    # the BOS run's windows begin with the unknown id 0; the ratio is weight / uniform weight
    assert bos["sink_ratio_per_layer"][0] == bos["first_token_weight_per_layer"][0] / bos["uniform_weight"]
    assert bos["max_cache_len"] <= 8 - 1  # 4 sinks + 4 window − 1 keys at most
    heads = [w for layer in bos["first_token_weight_per_head"] for w in layer]
    assert bos["sink_share_0.3"] == sum(w > 0.3 for w in heads) / len(heads)
    assert bos["first_token_weight_per_layer"] == [max(h) for h in bos["first_token_weight_per_head"]]
    assert bos["decode_vs_parallel_max_abs_logit_diff"] < 1e-4
    saved = json.loads(next((tmp_path / "runs" / "bos-seed0").glob("ckpt-*/train_config.json")).read_text())
    assert saved["bos"] == mod.BOS and saved["model_overrides"] == {"d_model": 32, "n_layers": 1}
    mtimes = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/latest")}
    assert len(calls) == 4 and not any("--resume" in c for c in calls)
    assert mod.main(argv) == 0
    assert len(calls) == 8 and all("--resume" in c for c in calls[4:])
    assert {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/latest")} == mtimes
    assert page.read_text().count("<!-- mnemo:begin attention_sinks -->") == 1


def test_context_extension_stage_one_names_each_seeds_run_and_resumes(tmp_path, monkeypatch):
    mod = _load("context_extension")
    from mnemo.sweep import SweepSpec

    spec = SweepSpec.load(SCRIPTS.parent / mod.SWEEP)
    monkeypatch.chdir(tmp_path)
    cmds = mod.pretrain_commands(spec, mod.PRETRAIN, threads=1)
    assert [str(run) for run, _ in cmds] == [f"runs/context_extension/pretrain-seed{s}" for s in range(4)]
    assert all("--resume" not in argv for _, argv in cmds)
    assert cmds[2][1][cmds[2][1].index("--seed") + 1] == "2"
    (tmp_path / "runs/context_extension/pretrain-seed1").mkdir(parents=True)
    (tmp_path / "runs/context_extension/pretrain-seed1/latest").write_text("ckpt-000010\n")
    cmds = mod.pretrain_commands(spec, mod.PRETRAIN, threads=1)
    assert ["--resume" in argv for _, argv in cmds] == [False, True, False, False]
    # every fine-tuning run starts from its own seed's pretrained model
    assert {r.seed: r.config["init_from"] for r in spec.runs()} == {
        s: f"runs/context_extension/pretrain-seed{s}" for s in range(4)
    }


def test_context_extension_zero_shot_block_from_known_numbers():
    """The zero-shot table and claims from hand-made exact-match numbers: yarn beats pi by 0.2,
    0.3, 0.25, 0.25 at 512 tokens (mean 0.25, s = 0.0408); the first length (2×) is shown but not
    judged; claim names say "without fine-tuning"."""
    import statistics

    from mnemo.sweep.stats import t_quantile

    mod = _load("context_extension")
    seeds = [0, 1, 2, 3]
    res = {
        "yarn": {256: dict.fromkeys(seeds, 1.0), 512: {0: 0.9, 1: 1.0, 2: 0.95, 3: 0.95}},
        "pi": {256: dict.fromkeys(seeds, 1.0), 512: {0: 0.7, 1: 0.7, 2: 0.7, 3: 0.7}},
    }
    block = mod.zero_shot_block(res, [{"name": "x", "better": "yarn", "than": "pi"}], 64, 60.0)
    assert "| yarn | 1.000 [1.000, 1.000] | 0.950 [" in block

    s = statistics.stdev([0.2, 0.3, 0.25, 0.25])
    half = t_quantile(0.975, 3) * s / 2
    assert f"+0.2500 [{0.25 - half:+.4f}, {0.25 + half:+.4f}]" in block
    assert "yarn extends the context better than pi without fine-tuning (at 512 tokens)" in block
    assert "(at 256 tokens)" not in block and "**reproduced**" in block
    assert "Wall time: 1.0 min" in block


def test_train_runs_logs_each_command_and_names_every_failure(tmp_path):
    """The results scripts' runner: each command's output in RUN.log beside its folder; a failing
    command does not stop the others, and the exit names its log and status."""
    import pytest

    mod = _load("train_runs")
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    jobs = [
        (bad, [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]),
        (ok, [sys.executable, "-c", "import time; time.sleep(1.5); print('fine')"]),
    ]
    with pytest.raises(SystemExit, match=rf"failed: {bad} \(exit 3\): see {tmp_path / 'bad.log'}"):
        mod.train_runs(jobs, parallel=1, label="t")
    assert (tmp_path / "bad.log").read_text() == "boom\n" and (tmp_path / "ok.log").read_text() == "fine\n"
    walls = mod.train_runs(jobs[1:], parallel=2)
    assert list(walls) == [str(ok)] and walls[str(ok)] >= 1.5


def test_spectrum_page_trains_probes_and_writes_its_block(tmp_path, monkeypatch):
    """Two tiny runs (a diagonal memory and HOPE's test-time-trained ones), their spectra read into
    the table (each row's numbers are the probe's own summary), the figures copied, the block
    appended below the prose; a second call trains and probes nothing and writes the same table.
    (The ``mnemo`` commands run in this process, from the repository root as the script's
    subprocesses do: see :func:`_cli_in_process`.)"""
    mod = _load("spectrum_page")
    calls = []

    def run_in_process(cli_argv):  # scripts/spectrum_page.py's ``_run``: check=True, stdout discarded
        import contextlib
        import io
        import time

        calls.append(cli_argv)
        t0 = time.perf_counter()
        with monkeypatch.context() as m, contextlib.redirect_stdout(io.StringIO()):
            m.chdir(mod.ROOT)
            assert _cli_in_process(cli_argv) == 0, cli_argv
        return time.perf_counter() - t0

    monkeypatch.setattr(mod, "_run", run_in_process)
    page = tmp_path / "spectrum.md"
    page.write_text("# Spectrum\n\nprose stays\n")
    argv = ["--models", "gla,hope_reconstruction", "--steps", "2", "--d-model", "32", "--n-layers", "1"]
    argv += ["--batch-size", "2", "--seq-len", "32", "--tokens", "64", "--directions", "3"]
    argv += ["--runs", str(tmp_path / "runs"), "--figures", str(tmp_path / "fig"), "--page", str(page)]
    assert mod.main(argv) == 0
    text = page.read_text()
    assert text.startswith("# Spectrum\n\nprose stays\n")
    assert text.count("<!-- mnemo:begin spectrum -->") == 1 and "<!-- mnemo:end spectrum -->" in text
    assert {p.name for p in (tmp_path / "fig").iterdir()} == {
        "spectrum_gla.png",
        "spectrum_hope_reconstruction.png",
    }
    for model in ("gla", "hope_reconstruction"):
        spec = json.loads((tmp_path / "runs" / f"spec-{model}" / "spectrum" / "spectrum.json").read_text())
        for key, entry in spec["layers"].items():
            s = entry.get("summary")
            if s is None:
                continue
            row = next(
                r
                for r in mod.rows(model, spec)
                if r.startswith(f"| {model} | {mod._layer_label(key, entry)} |")
            )
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert row in text
            for cell, c in zip(
                cells[3:8], ("irrelevant", "intermediate", "marginal", "relevant", "unresolved")
            ):
                assert float(cell) == pytest.approx(s[c], abs=0.005)
                assert (float(cell) == 0) == (s[c] == 0)  # a share that is not 0 never reads 0
            assert float(cells[9].replace("−", "-")) == round(s["max_exponent"], 4)
            if s["computed"] < s["directions"]:  # hope's memories: 3 leading exponents per head
                assert cells[2] == f"{s['directions']} (3)"
    labels = [r.split("|")[2].strip() for r in mod.rows("hope_reconstruction", spec)]
    assert labels[0] == "0 (self-modifying Titans)" and labels[1].startswith("0, CMS level 0 (period ")
    assert [c[0] for c in calls] == ["train", "probe", "train", "probe"]
    before = {p: p.stat().st_mtime for p in (tmp_path / "runs").rglob("spectrum.json")}
    assert mod.main(argv) == 0
    assert len(calls) == 4  # nothing run again
    assert {p: p.stat().st_mtime for p in (tmp_path / "runs").rglob("spectrum.json")} == before
    assert "every run and spectrum reused" in page.read_text()
    assert page.read_text().count("<!-- mnemo:begin spectrum -->") == 1
