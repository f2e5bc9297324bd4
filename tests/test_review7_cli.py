"""Seventh break-it review of the command line (mnemo.cli, mnemo.argtypes, mnemo.commands, the sweep
files and the data-folder reading): each test is a defect found by the review, failing before its
fix."""

from __future__ import annotations

import json
import math

import pytest

from mnemo.cli import main

# ------------------------------------------------------------------------------------------------
# part 1: known leftovers
# ------------------------------------------------------------------------------------------------

#: the non-finite values each writer must keep: written as null, named in a "nonfinite" map
_BAD = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 1.5}


def _strict(text: str):
    """``text`` read as strict JSON (a bare NaN/Infinity token raises)."""

    def refuse(token):
        raise AssertionError(f"bare {token} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def _same(a, b) -> bool:
    """``a == b`` with NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_verify_json_names_its_non_finite_values_as_probe_and_train_do(tmp_path):
    """``verify --json`` wrote a NaN error as a bare null (``mnemo.bench.json_safe``): whether it
    was NaN or inf was lost, unlike probe/train JSON (null + a "nonfinite" map)."""
    from mnemo.bench import loads_json
    from mnemo.commands.verify import _write_json

    rows = [
        {"spec": "a", "max_err": math.nan},
        {"spec": "b", "max_err": math.inf},
        {"spec": "c", "max_err": 0.0},
    ]
    path = tmp_path / "v.json"
    _write_json(str(path), rows)
    strict = _strict(path.read_text())
    assert strict[0] == {"spec": "a", "max_err": None, "nonfinite": {"max_err": "NaN"}}
    assert strict[1]["nonfinite"] == {"max_err": "Infinity"} and "nonfinite" not in strict[2]
    assert _same(loads_json(path.read_text()), rows)


def test_bench_suite_json_names_its_non_finite_values(tmp_path):
    """A bench suite's rows (``mnemo.bench.write_json``) wrote nan/inf as bare null."""
    from mnemo.bench import loads_json, write_json

    result = {"rows": [dict(_BAD)], "summary": {"ratio": math.inf}}
    path = tmp_path / "b.json"
    write_json(path, result)
    strict = _strict(path.read_text())
    assert strict["nonfinite"] == {
        "rows/0/nan": "NaN",
        "rows/0/inf": "Infinity",
        "rows/0/ninf": "-Infinity",
        "summary/ratio": "Infinity",
    }
    assert _same(loads_json(path.read_text()), result)
    # a file written before (bare null) reads as it is
    assert loads_json('{"rows": [{"x": null}]}') == {"rows": [{"x": None}]}


def test_bench_all_keeps_each_suites_non_finite_values_in_strict_json(tmp_path, monkeypatch):
    """``bench --suite all`` combined the suites' files with a plain ``json.dumps``: a suite's
    nonfinite map stayed nested (where ``loads_record`` does not look), and nothing made the
    combined file strict."""
    import mnemo.commands.bench as bench_cmd
    from mnemo.bench import loads_json, write_json

    def fake_suite(a):
        write_json(a.json, [{"suite": a.suite, "t": math.nan}] if a.suite == "decode" else {"t": math.inf})
        return 0

    monkeypatch.setattr(bench_cmd, "_run_suite", fake_suite)
    out = tmp_path / "all.json"
    assert main(["bench", "--suite", "all", "--json", str(out)]) == 0
    strict = _strict(out.read_text())
    assert strict["nonfinite"]["decode/0/t"] == "NaN" and strict["nonfinite"]["ops/t"] == "Infinity"
    back = loads_json(out.read_text())
    assert math.isnan(back["decode"][0]["t"]) and back["models"]["t"] == math.inf
    assert "nonfinite" not in back["decode"][0]


def test_continual_json_names_its_non_finite_values(tmp_path, monkeypatch):
    """``continual.json`` wrote a diverged seed's NaN as a bare null; the page's table read from it
    (``reproduce --no-run``) now gets the NaN back, as a run's in-memory results hold it."""
    import mnemo.commands.continual as cont

    monkeypatch.setattr(cont, "run_experiment", lambda *a, **k: {"per_seed": [dict(_BAD)]})
    monkeypatch.setattr(cont, "table", lambda r: "table")
    monkeypatch.setattr(cont, "plot", lambda r, path: None)
    cont.run(("abab",), 1, out=tmp_path, progress=False)
    text = (tmp_path / "continual.json").read_text()
    strict = _strict(text)
    assert strict["nonfinite"] == {
        "experiments/abab/per_seed/0/nan": "NaN",
        "experiments/abab/per_seed/0/inf": "Infinity",
        "experiments/abab/per_seed/0/ninf": "-Infinity",
    }
    held = cont._stored_experiments(tmp_path / "continual.json")
    assert _same(held["abab"]["per_seed"][0], _BAD)


def test_harness_json_names_its_non_finite_values(tmp_path, monkeypatch):
    """``mnemo harness`` wrote lm-eval's NaN (a stderr of one sample) as a bare null."""
    pytest.importorskip("lm_eval")
    import lm_eval
    import lm_eval.utils

    import mnemo.commands.evaluate as evaluate_cmd
    import mnemo.commands.harness as harness_cmd
    import mnemo.train

    results = {"results": {"t": {"acc,none": 0.5, "acc_stderr,none": math.nan, "x": -math.inf}}}
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **k: results)
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda r, *a: "table")
    monkeypatch.setattr(mnemo.train, "resolve_checkpoint", lambda c, warn=None: tmp_path)
    monkeypatch.setattr(evaluate_cmd, "refuse_task_checkpoint", lambda c, why: None)
    monkeypatch.setattr(harness_cmd, "_task_manager", lambda tasks, include: None)
    out = tmp_path / "h.json"
    assert main(["harness", "--checkpoint", str(tmp_path), "--tasks", "t", "--out", str(out)]) == 0
    from mnemo.bench import loads_json

    strict = _strict(out.read_text())
    assert strict["nonfinite"] == {"results/t/acc_stderr,none": "NaN", "results/t/x": "-Infinity"}
    assert _same(loads_json(out.read_text()), results)


def _project_with_an_old_run(tmp_path):
    """A project folder: a corpus file and, beside it, a finished run's folder (metrics.jsonl)."""
    from tests.helpers import sweep_project

    proj, away = sweep_project(tmp_path)
    (proj / "corpus").mkdir()
    (proj / "corpus" / "a.jsonl").write_text('{"text": "hello world, hello world"}\n' * 20)
    (proj / "runs" / "old").mkdir(parents=True)
    (proj / "runs" / "old" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return proj, away


def test_a_data_glob_that_matches_another_runs_files_is_refused_naming_them(tmp_path, monkeypatch):
    """``data: "**/*.jsonl"`` over a project read the metrics.jsonl of runs beside the corpus as
    text (the check looked at the run's own folder only)."""
    from mnemo.data.corpus import load_corpus

    proj, _ = _project_with_an_old_run(tmp_path)
    monkeypatch.chdir(proj)
    with pytest.raises(
        ValueError, match=r"data '\*\*/\*\.jsonl' matches 1 file\(s\) of training run folders"
    ) as e:
        load_corpus("**/*.jsonl")
    assert "runs/old/metrics.jsonl" in str(e.value)
    assert len(load_corpus("corpus/**/*.jsonl").documents) == 20  # the corpus alone is read


def test_a_sweep_whose_data_glob_matches_another_runs_files_is_refused_before_any_run(
    tmp_path, monkeypatch, capsys
):
    import yaml

    import mnemo.sweep.runner as runner_mod

    proj, away = _project_with_an_old_run(tmp_path)
    f = proj / "sweeps" / "s.yaml"
    base = {"data": "**/*.jsonl", "seq_len": 8, "batch_size": 2, "steps": 1}
    f.write_text(yaml.safe_dump({"name": "s", "base": base, "models": ["gla"], "grid": {"lr": [1e-3]}}))
    f.write_text(f.read_text() + "metric: val_loss\n")
    calls = []
    monkeypatch.setattr(runner_mod, "run_one", lambda *a, **k: calls.append(a) or {})
    monkeypatch.chdir(away)
    assert main(["sweep", str(f), "--no-progress", "--out", str(tmp_path / "elsewhere")]) == 2
    err = capsys.readouterr().err
    assert calls == [] and "sweep 's': data" in err and str(proj / "runs/old/metrics.jsonl") in err, err


def test_glob_reads_run_reads_a_trailing_slash_and_refuses_dot_dot_after_a_wildcard(tmp_path, monkeypatch):
    """``corpus/**/`` matches folders only (glob never gives a file: nothing a run writes is read),
    but was taken for ``corpus/**``; ``corpus/*/../x`` was normalised as if ``*`` were a folder
    name of its own (``abspath`` collapsed ``*/..``)."""
    from mnemo.data.corpus import glob_reads_run

    monkeypatch.chdir(tmp_path)
    assert glob_reads_run("corpus/**/", "corpus/run") is False
    assert glob_reads_run("corpus/**", "corpus/run") is True
    with pytest.raises(ValueError, match=r"data 'corpus/\*\*/\.\./x/\*': '\.\.' after a wildcard is not"):
        glob_reads_run("corpus/**/../x/*", "x/run")
    assert glob_reads_run("../x/**", "../x/run") is True  # (before any wildcard: a folder it names)


def test_the_sweep_warning_about_an_old_database_names_the_out_given(tmp_path, monkeypatch):
    """With ``--out X`` the warning still said the run folders were in ``runs/sweeps/NAME``."""
    import yaml

    import mnemo.sweep.runner as runner_mod
    from tests.helpers import sweep_project
    from tests.tasks.test_sweep_seeds import BASE, _fake_run_one

    proj, away = sweep_project(tmp_path)
    f = proj / "sweeps" / "w.yaml"
    f.write_text(yaml.safe_dump({"name": "w", "base": BASE, "models": ["gla"], "grid": {"lr": [1e-3]}}))
    monkeypatch.setattr(runner_mod, "run_one", _fake_run_one({(1e-3, 0): 0.9}, []))
    monkeypatch.chdir(away)
    assert main(["sweep", str(f), "--no-progress", "--db", "runs/sweeps/w.sqlite", "--out", "there"]) == 0
    with pytest.warns(UserWarning) as said:
        assert main(["sweep", str(f), "--no-progress", "--out", "there"]) == 0
    (note,) = [str(w.message) for w in said]
    assert "(its run folders in there)" in note and "runs/sweeps/w)" not in note, note


def test_reproduces_message_for_two_databases_names_no_flag_it_lacks(tmp_path, monkeypatch):
    """``mnemo reproduce`` has no ``--db``; its message for two databases said to give one with it."""
    import yaml

    from mnemo.sweep.runner import default_paths
    from mnemo.sweep.spec import SweepSpec
    from tests.helpers import sweep_project
    from tests.tasks.test_sweep_seeds import BASE

    proj, away = sweep_project(tmp_path)
    f = proj / "sweeps" / "w.yaml"
    f.write_text(yaml.safe_dump({"name": "w", "base": BASE, "models": ["gla"], "grid": {"lr": [1e-3]}}))
    for db in (proj / "runs/sweeps/w.sqlite", away / "runs/sweeps/w.sqlite"):
        db.parent.mkdir(parents=True)
        db.write_bytes(b"")
    monkeypatch.chdir(away)
    spec = SweepSpec.load(f)
    with pytest.raises(ValueError) as e:
        default_paths(spec, f)  # as mnemo reproduce calls it
    assert "--db" not in str(e.value) and f"set the one to continue as db in {f}" in str(e.value)
    with pytest.raises(ValueError, match="give the one to continue with --db"):
        default_paths(spec)  # as mnemo sweep calls it


def test_generate_help_states_the_prompts_default():
    import argparse

    from mnemo.cli import build_parser
    from mnemo.commands.evaluate import _cmd_generate  # noqa: F401

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    (prompt,) = [a for a in sub.choices["generate"]._actions if a.dest == "prompt"]
    assert prompt.default == "" and 'default ""' in prompt.help


def test_the_train_banner_shows_a_tiny_models_parameter_count():
    """``0.00M parameters`` for a model of 3,000 parameters."""
    from mnemo.commands.train import parameter_count

    assert [parameter_count(n) for n in (3_000, 999_999, 1_234_567, 124_000_000, 7_500_000_000)] == [
        "3,000",
        "999,999",
        "1.23M",
        "124M",
        "7.5B",
    ]


# ------------------------------------------------------------------------------------------------
# part 2: break-it review
# ------------------------------------------------------------------------------------------------


def test_a_saved_data_glob_keeps_what_it_matches(tmp_path, monkeypatch):
    """``mnemo train`` saved a relative ``--data`` glob through ``os.path.abspath``, which also
    normalises it: ``corpus/*/../x/*.txt`` (x beside each subfolder of corpus: none here) became
    ``corpus/x/*.txt``, and ``corpus/**/`` (folders only: no file) became ``corpus/**`` (every file
    below): the run read other files than the glob as written."""
    import os

    from mnemo.commands.train import _absolute_data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus" / "x").mkdir(parents=True)
    (tmp_path / "corpus" / "x" / "a.txt").write_text("text")
    here = str(tmp_path)
    assert _absolute_data("corpus/*/../x/*.txt") == os.path.join(here, "corpus", "*", "..", "x", "*.txt")
    assert _absolute_data("corpus/**/") == os.path.join(here, "corpus", "**") + os.sep
    assert _absolute_data("./corpus/../corpus/**/*.txt") == os.path.join(here, "corpus", "**", "*.txt")
    assert _absolute_data("corpus/x/a.txt") == os.path.join(here, "corpus", "x", "a.txt")
