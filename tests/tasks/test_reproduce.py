"""``mnemo reproduce PAGE``: a results page rebuilt from the sweep files it names. Runs are fake
(``run_one`` replaced by known accuracies) so the generated table can be checked number by number."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import mnemo.sweep.runner as runner_mod
from mnemo.cli import main
from mnemo.sweep.reproduce import page_sweeps, reproduce_page
from mnemo.sweep.stats import mean_interval
from tests.tasks.test_sweep_seeds import BASE, _fake_run_one

#: seed 0 picks lr 1e-3 (0.9 > 0.5); seeds 1-3 are reported there
ACC = {(1e-3, 0): 0.9, (1e-3, 1): 0.6, (1e-3, 2): 0.7, (1e-3, 3): 0.8, (1e-2, 0): 0.5}


def _fake(calls):
    return _fake_run_one(ACC, calls)  # known accuracies, wall time 0.5 s a run


def _setup(tmp_path, monkeypatch, calls):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner_mod, "run_one", _fake(calls))
    (tmp_path / "pyproject.toml").write_text("")  # the checkout: its sweeps are stored in its runs/
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "tiny",
                "base": BASE,
                "models": ["gla"],
                "grid": {"lr": [1e-3, 1e-2]},
                "seeds": 4,
                "select_lr_on_seed": 0,
            }
        )
    )
    page = tmp_path / "docs" / "results" / "tiny.md"
    page.parent.mkdir(parents=True)
    page.write_text(
        "# Tiny\n\nThe claim, in words.\n\n<!-- mnemo:reproduce configs/tiny.yaml -->\n\nThe verdict.\n"
    )
    return page


def test_a_page_is_rebuilt_from_its_sweep_and_keeps_its_prose(tmp_path, monkeypatch):
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    res = reproduce_page(page, progress=False, log=lambda s: None)
    assert calls == [(1e-3, 0), (1e-2, 0), (1e-3, 1), (1e-3, 2), (1e-3, 3)], "staged: 2 + 3 runs"
    text = page.read_text()
    assert text.startswith("# Tiny\n\nThe claim, in words.\n") and "The verdict.\n" in text
    assert text.count("<!-- mnemo:begin tiny -->") == 1 and text.count("<!-- mnemo:end tiny -->") == 1
    # the table's numbers are the reported seeds' (1-3 at lr 1e-3), computed independently here
    ci = mean_interval([0.6, 0.7, 0.8])
    assert f"{ci['mean']:.4f}" in text and f"{ci['low']:.4f}" in text and f"{ci['high']:.4f}" in text
    assert "mnemo sweep configs/tiny.yaml" in text and "mnemo report runs/sweeps/tiny.sqlite" in text
    assert "![tiny](tiny/tiny_acc_vs_state.png)" in text
    assert (tmp_path / "docs/results/tiny/tiny_acc_vs_state.png").is_file()
    assert (tmp_path / "docs/results/tiny/tiny.json").is_file()
    assert res["tiny"]["counts"]["ran"] == 5

    # a second call trains nothing and replaces the block (no second copy); prose edits survive
    page.write_text(page.read_text().replace("The verdict.", "The verdict, revised."))
    calls.clear()
    reproduce_page(page, run=False, progress=False, log=lambda s: None)
    assert calls == [] and page.read_text().count("<!-- mnemo:begin tiny -->") == 1
    assert "The verdict, revised." in page.read_text()


def test_reproduce_errors_name_the_page_and_what_to_do(tmp_path, monkeypatch, capsys):
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    bare = tmp_path / "bare.md"
    bare.write_text("# nothing to rebuild\n")
    with pytest.raises(ValueError, match=r"bare.md names no sweep: add one line `<!-- mnemo:reproduce"):
        page_sweeps(bare)
    missing = tmp_path / "missing.md"
    missing.write_text("x\n<!-- mnemo:reproduce configs/nope.yaml -->\n")
    with pytest.raises(FileNotFoundError, match=r"missing.md:2: the sweep file configs/nope.yaml does not"):
        page_sweeps(missing)
    with pytest.raises(FileNotFoundError, match=r"its database runs/sweeps/tiny.sqlite does not exist"):
        reproduce_page(page, run=False, progress=False, log=lambda s: None)
    broken = page.read_text() + "<!-- mnemo:end tiny -->\n<!-- mnemo:begin tiny -->\n"
    page.write_text(broken)
    with pytest.raises(ValueError, match=r"the markers of sweep 'tiny' are broken"):
        reproduce_page(page, progress=False, log=lambda s: None)
    assert page.read_text() == broken, "a page with broken markers is left as it was"
    # through the command line: one line, exit 2, nothing trained
    calls.clear()
    assert main(["reproduce", str(bare)]) == 2
    assert "names no sweep" in capsys.readouterr().err and calls == []
    # a database given for the page (hostile trial 14: a bare "'utf-8' codec can't decode" line)
    db = tmp_path / "s.sqlite"
    db.write_bytes(b"SQLite format 3\x00\xf8\xff")
    assert main(["reproduce", str(db)]) == 2
    err = capsys.readouterr().err
    assert f"page: {db} is not a UTF-8 text file (byte 16: invalid start byte)" in err
    assert "a sweep database is read by `mnemo report`" in err and calls == []


def test_the_cli_rebuilds_the_page(tmp_path, monkeypatch, capsys):
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    assert main(["reproduce", str(page), "--no-progress"]) == 0
    assert len(calls) == 5 and "<!-- mnemo:begin tiny -->" in page.read_text()
    assert "rewrote" in capsys.readouterr().out


def _seed0_only(tmp_path, monkeypatch, calls):
    """The page's sweep with only its held-out seed run: the other seeds' runs fail."""
    from tests.tasks.test_sweep_seeds import _fake_run_one_status

    page = _setup(tmp_path, monkeypatch, calls)
    fails = {(1e-3, s): "failed" for s in (1, 2, 3)}
    monkeypatch.setattr(runner_mod, "run_one", _fake_run_one_status(ACC, calls, fails))
    return page


def test_a_partial_sweep_is_never_reported_as_finished(tmp_path, monkeypatch, capsys):
    """Hostile trial 9, finding 1: `--no-run` rewrote a page from a half-run database (the value
    cell read `done`, n 0) with exit 0 and no word. Now it refuses, unless asked to write a page
    that says it is partial; a call that trains and has failures marks its block the same way."""
    calls, logs = [], []
    page = _seed0_only(tmp_path, monkeypatch, calls)
    res = reproduce_page(page, progress=False, log=logs.append)
    assert calls == [(1e-3, 0), (1e-2, 0), (1e-3, 1), (1e-3, 2), (1e-3, 3)]
    assert res["tiny"]["pending"] == {"failed": 3}
    text = page.read_text()
    assert "**Partial:** 3 run(s) of the sweep have not finished (3 failed)" in text
    # the table says why the value is missing instead of `done` (and n is 0)
    assert "| no other seed finished at lr=0.001 | – | 0 |" in text
    assert any("partial: 3 run(s)" in line for line in logs)
    # `mnemo report` (which knows the database, not the file) says it from the stored seeds
    assert (
        "**Partial:** gla: fewer than the 3 seed(s) the sweep file reports per cell"
        in (res["tiny"]["report"]["markdown"])
    )

    # --no-run on that database: refused, the page as it was
    before = page.read_text()
    with pytest.raises(
        ValueError, match=r"tiny.yaml: 3 run\(s\) of the sweep have not finished \(3 failed\)"
    ):
        reproduce_page(page, run=False, progress=False, log=lambda s: None)
    assert page.read_text() == before
    assert main(["reproduce", str(page), "--no-run"]) == 2
    err = capsys.readouterr().err
    assert "add --partial" in err and "left as it is" in err and "Traceback" not in err
    assert main(["reproduce", str(page), "--partial"]) == 2, "--partial only means something with --no-run"
    assert "--partial: goes with --no-run" in capsys.readouterr().err
    # asked for: written, and marked
    page.write_text(before.replace("**Partial:**", "(was partial)"))
    assert main(["reproduce", str(page), "--no-run", "--partial", "--no-progress"]) == 0
    assert "**Partial:** 3 run(s)" in page.read_text()

    # running again finishes the sweep; the mark goes away
    monkeypatch.setattr(runner_mod, "run_one", _fake(calls))
    res = reproduce_page(page, progress=False, log=lambda s: None)
    assert res["tiny"]["pending"] == {} and "**Partial:**" not in page.read_text()
    assert reproduce_page(page, run=False, progress=False, log=lambda s: None)["tiny"]["pending"] == {}


def test_the_page_reports_only_the_runs_its_sweep_file_defines(tmp_path, monkeypatch):
    """Hostile trial 9, finding 1: runs under the same sweep name from another file (or an earlier
    version of this one) were pooled into the page. They are left out, and the log says so."""
    calls, logs = [], []
    page = _setup(tmp_path, monkeypatch, calls)
    reproduce_page(page, progress=False, log=lambda s: None)
    clean = page.read_text()
    # another file, same name, another model and budget, into the same database
    other = yaml.safe_load((tmp_path / "configs" / "tiny.yaml").read_text())
    other.update(models=["deltanet"], base={**BASE, "steps": 6})
    (tmp_path / "configs" / "other.yaml").write_text(yaml.safe_dump(other))
    assert main(["sweep", str(tmp_path / "configs" / "other.yaml"), "--no-progress"]) == 0
    reproduce_page(page, run=False, progress=False, log=logs.append)
    text = page.read_text()
    assert "deltanet" not in text and text == clean
    assert any("holds 5 run(s) of sweep 'tiny' that configs/tiny.yaml does not define" in s for s in logs)


def test_sweep_list_says_which_runs_staged_selection_will_not_train(tmp_path, monkeypatch, capsys):
    """Hostile trial 9, finding 3: `sweep --list` showed the runs at values the held-out seed did not
    choose as `todo` forever. States: done, waiting (held-out seed not finished), not-chosen, todo."""
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    cfg = tmp_path / "configs" / "tiny.yaml"

    def states():
        assert main(["sweep", str(cfg), "--list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        return [tuple(line.split("  ")[1:2] + [line.split("seed=")[1]]) for line in lines[:-1]], lines[-1]

    listed, summary = states()
    assert [s for s, _ in listed] == ["todo"] + ["waiting"] * 3 + ["todo"] + ["waiting"] * 3
    assert summary == "tiny: 2 todo, 6 waiting" and calls == []
    reproduce_page(page, progress=False, log=lambda s: None)
    listed, summary = states()
    # seed 0 chose lr 1e-3: its other seeds are done, lr 1e-2's are never trained
    assert [s for s, _ in listed] == ["done"] * 4 + ["done"] + ["not-chosen"] * 3
    # (the faked training makes no run folders, and the listing says so)
    assert summary == "tiny: 5 done, 3 not-chosen (5 finished run folder(s) gone)"


def test_a_second_block_of_the_same_sweep_is_an_error_not_a_stale_copy(tmp_path, monkeypatch):
    """Hostile trial 9, finding 4: a page with two begin/end blocks of one sweep had the first
    rewritten and the second left stale. Now: an error naming the line; the page as it was."""
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    reproduce_page(page, progress=False, log=lambda s: None)
    doubled = page.read_text() + "\n<!-- mnemo:begin tiny -->\nold table\n<!-- mnemo:end tiny -->\n"
    page.write_text(doubled)
    line = doubled[: doubled.rindex("<!-- mnemo:begin tiny -->")].count("\n") + 1
    with pytest.raises(ValueError, match=rf"tiny.md:{line}: a second `<!-- mnemo:begin tiny -->`"):
        reproduce_page(page, run=False, progress=False, log=lambda s: None)
    assert page.read_text() == doubled


def test_sweep_and_report_refuse_a_training_runs_folder_as_out(tmp_path, monkeypatch, capsys):
    """Hostile trial 9, finding 5: `sweep --out` and `report --out` wrote into a training run's
    folder. Now exit 2 before any work, one line naming the flag."""
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    reproduce_page(page, progress=False, log=lambda s: None)
    run = tmp_path / "myrun"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.name for p in run.iterdir())
    for argv in (
        ["sweep", "configs/tiny.yaml", "--out", str(run), "--no-progress"],
        ["report", "runs/sweeps/tiny.sqlite", "--out", str(run), "--no-plots"],
    ):
        calls.clear()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "--out" in err and "a training run's folder" in err and "Traceback" not in err, err
        assert calls == [] and sorted(p.name for p in run.iterdir()) == before


def test_a_page_names_its_own_checkouts_sweep_files_from_any_working_directory(tmp_path, monkeypatch):
    """Hostile trial 10, finding 9: run from another checkout's folder, `mnemo reproduce PAGE`
    took that folder's configs/ file of the same path, not the page's own. The page's folder and
    its parents come first now; the working directory is the fallback."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    for root in (mine, other):
        (root / "configs").mkdir(parents=True)
        (root / "configs" / "s.yaml").write_text(f"# {root.name}\n")
    page = mine / "docs" / "results" / "p.md"
    page.parent.mkdir(parents=True)
    page.write_text("<!-- mnemo:reproduce configs/s.yaml -->\n")
    monkeypatch.chdir(other)
    (found,) = page_sweeps(page)
    assert Path(found).resolve() == (mine / "configs" / "s.yaml").resolve()
    (other / "only-here.yaml").write_text("# other\n")
    page.write_text("<!-- mnemo:reproduce only-here.yaml -->\n")
    (found,) = page_sweeps(page)  # not above the page: the working directory's
    assert Path(found).resolve() == (other / "only-here.yaml").resolve()


def test_only_the_named_sweep_of_a_page_is_run_and_rewritten(tmp_path, monkeypatch, capsys):
    """``reproduce --sweep NAME``: a page naming two sweeps, one of whose databases is absent here
    (made on another machine), rebuilds the other alone and leaves the first block as it was."""
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    other = yaml.safe_load((tmp_path / "configs" / "tiny.yaml").read_text()) | {"name": "elsewhere"}
    (tmp_path / "configs" / "elsewhere.yaml").write_text(yaml.safe_dump(other))
    kept = "<!-- mnemo:begin elsewhere -->\nmade elsewhere\n<!-- mnemo:end elsewhere -->\n"
    page.write_text("<!-- mnemo:reproduce configs/elsewhere.yaml -->\n\n" + kept + page.read_text())
    with pytest.raises(FileNotFoundError, match="elsewhere.sqlite does not exist"):
        reproduce_page(page, run=False, progress=False, log=lambda s: None)
    reproduce_page(page, only=["tiny"], progress=False, log=lambda s: None)
    text = page.read_text()
    assert kept in text and text.count("<!-- mnemo:begin tiny -->") == 1 and len(calls) == 5
    assert not (tmp_path / "runs" / "sweeps" / "elsewhere.sqlite").exists()
    before = page.read_text()
    assert main(["reproduce", str(page), "--no-run", "--sweep", "tiny"]) == 0
    assert main(["reproduce", str(page), "--no-run", "--sweep", "tiny,nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--sweep: 'nosuch'; " in err and "names the sweeps 'elsewhere', 'tiny'" in err, err
    assert page.read_text() == before


def test_reproduce_never_writes_into_a_run_or_over_files_it_did_not_write(tmp_path, monkeypatch, capsys):
    """Hostile trial 11, finding 3: a page's first `reproduce` replaced a user's files named like its
    outputs (PAGE/NAME.md, NAME.json), and a page named like a training run (r1.md) wrote into the
    run's folder r1/. Both are refused before anything runs; the page's own earlier outputs are still
    replaced."""
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    mine = page.with_suffix("")
    mine.mkdir()
    (mine / "tiny.json").write_text("precious")
    with pytest.raises(ValueError, match="reproduce would replace files it did not write"):
        reproduce_page(page, progress=False, log=lambda s: None)
    assert (mine / "tiny.json").read_text() == "precious" and calls == []
    (mine / "tiny.json").unlink()
    reproduce_page(page, progress=False, log=lambda s: None)  # now the page has its block:
    assert main(["reproduce", str(page), "--no-run"]) == 0  # its own outputs are replaced
    run = page.parent / "r1"
    (run / "ckpt-000002").mkdir(parents=True)
    (run / "latest").write_text("ckpt-000002\n")
    other = page.parent / "r1.md"
    other.write_text(page.read_text())
    assert main(["reproduce", str(other), "--no-run"]) == 2
    assert f"its figures and JSON go to {run}, which is a training run's folder" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-000002", "latest"]
    # (hostile trial 12) a file where the folder goes: refused up front, not "File exists" at the end
    (page.parent / "T").write_text("mine")
    (page.parent / "T.md").write_text(page.read_text())
    assert main(["reproduce", str(page.parent / "T.md"), "--no-run"]) == 2
    err = capsys.readouterr().err
    assert f"its figures and JSON go to the folder {page.parent / 'T'}, which is a file" in err, err
    assert (page.parent / "T").read_text() == "mine"


def test_a_sweep_refuses_a_database_holding_its_runs_under_another_name(tmp_path, monkeypatch, capsys):
    """Hostile trial 11: `mnemo sweep s2.yaml --db s1.sqlite` (s2 = s1 renamed) exited 0 saying
    "2 already finished" and recorded nothing under s2, so `report --sweep s2` found no sweep. A
    run's id hashes its configuration and has one row: the sweep now refuses, naming the database
    and the other sweep, before anything is trained or recorded."""
    calls = []
    _setup(tmp_path, monkeypatch, calls)
    assert main(["sweep", "configs/tiny.yaml", "--no-progress"]) == 0
    trained = len(calls)
    spec = yaml.safe_load((tmp_path / "configs" / "tiny.yaml").read_text()) | {"name": "tiny2"}
    (tmp_path / "configs" / "tiny2.yaml").write_text(yaml.safe_dump(spec))
    argv = ["sweep", "configs/tiny2.yaml", "--db", "runs/sweeps/tiny.sqlite", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "runs/sweeps/tiny.sqlite already holds runs of the same configurations under sweep 'tiny'" in err
    assert len(calls) == trained
    from mnemo.sweep.db import SweepDB

    with SweepDB(tmp_path / "runs" / "sweeps" / "tiny.sqlite", create=False) as db:
        assert db.sweeps() == ["tiny"]
    assert main(["sweep", "configs/tiny2.yaml", "--no-progress"]) == 0  # its own database: fine


def _fake_retention(calls):
    """``train_one`` for the retention task with known numbers: recall of the oldest pairs 0.5 (cms-1)
    or 0.8 (cms-3) + 0.01·seed, of the newest 0.9 for both."""

    def train(experiment, task, levels, s, seed, bar=None):
        calls.append((len(levels), s.lr, seed))
        oldest = (0.5 if len(levels) == 1 else 0.8) + 0.01 * (seed % 100) - (s.lr != 1e-2) * 0.1
        by_age = [0.9, 0.8, 0.7, oldest]
        return {
            "seed": seed, "oldest": oldest, "newest": 0.9, "recall": sum(by_age) / 4,
            "age_drop": 0.9 - oldest,
            "accuracy_by_tag": {f"age_{j}": v for j, v in enumerate(by_age)}, "final_train_loss": 1.0,
            "loss_curve": [{"step": i, "loss": x} for i, x in enumerate([3.0, 2.9, 2.0, 1.0, 0.5, 0.4])],
            "loss_fall_last_fifth": 0.0, "diverged_at_step": None, "wall_s": 30.0, "lr": s.lr,
        }  # fmt: skip

    return train


def test_a_page_rebuilds_its_continual_experiment_from_the_kept_runs(tmp_path, monkeypatch):
    import mnemo.commands.continual as cont

    calls = []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")  # the page's checkout: its --out is resolved there
    monkeypatch.setattr(cont, "train_one", _fake_retention(calls))
    line = (
        "--experiment retention --seeds 3 --steps 2 --eval-streams 4 --lr-grid 3e-3,1e-2,3e-2 "
        "--models cms-1,cms-3 --periods 1,4,16 --workers 1 --no-progress --out docs/results/continual_ret"
    )
    page = tmp_path / "docs" / "results" / "cont.md"
    page.parent.mkdir(parents=True)
    page.write_text(f"# Continual\n\nThe claim.\n\n<!-- mnemo:continual {line} -->\n\nThe verdict.\n")
    res = reproduce_page(page, progress=False, log=lambda s: None, continual=cont)
    assert len(calls) == 2 * (3 + 3)  # held-out seed at 3 rates + 3 reported seeds, per model
    assert set(res) == {"continual_ret"} and res["continual_ret"]["report"] is None
    text = page.read_text()
    assert text.startswith("# Continual\n\nThe claim.\n") and "The verdict.\n" in text
    assert text.count("<!-- mnemo:begin continual_ret -->") == 1
    # the first block goes right below its line, not at the page's end
    assert text.index(line) < text.index("<!-- mnemo:begin continual_ret -->") < text.index("The verdict.")
    assert f"OMP_NUM_THREADS=1 mnemo continual {line}" in text
    # the numbers: both at lr 1e-2 (the held-out seed's best), seeds 0-2: oldest 0.50/0.51/0.52 and
    # 0.80/0.81/0.82, so each paired difference is exactly +0.3, on oldest and on the age drop
    assert "| cms-1 | 1×1 (lr 1) |" in text and "| 0.01 | 0.510 ± 0.025 |" in text
    assert "| cms-3 > cms-1 | oldest | 3 | +0.300 [+0.300, +0.300] | reproduced" in text
    # the share kept with age, (oldest − 1/16) / (0.9 − 1/16), per seed, paired
    share = [
        ((0.8 + 0.01 * s) - 1 / 16) / (0.9 - 1 / 16) - ((0.5 + 0.01 * s) - 1 / 16) / (0.9 - 1 / 16)
        for s in range(3)
    ]
    assert (
        "| cms-3 forgets less by age than cms-1 | retained share (oldest − chance) / (newest − chance) "
        f"| 3 | +{sum(share) / 3:.3f} [+{min(share):.3f}, +{max(share):.3f}] | reproduced" in text
    )
    assert "the runs' own 6.0 min summed" in text  # 12 runs × 30 s
    assert "![retention](continual_ret/retention.png)" in text
    assert (tmp_path / "docs/results/continual_ret/retention.png").is_file()

    # again: every run is read from --out/runs/, nothing trains; then without running at all
    calls.clear()
    page.write_text(page.read_text().replace("The verdict.", "The verdict, revised."))
    reproduce_page(page, progress=False, log=lambda s: None, continual=cont)
    reproduce_page(page, run=False, progress=False, log=lambda s: None, continual=cont)
    text = page.read_text()
    assert calls == [] and text.count("<!-- mnemo:begin continual_ret -->") == 1
    assert "The verdict, revised." in text and "+0.300 [+0.300, +0.300] | reproduced" in text
    # from another working directory the line's --out is still the checkout's
    monkeypatch.chdir(page.parent)
    reproduce_page(page.name, run=False, progress=False, log=lambda s: None, continual=cont)
    assert calls == [] and "| cms-3 > cms-1 | oldest | 3 | +0.300" in page.read_text()
    monkeypatch.chdir(tmp_path)
    # a second line whose results are missing does not stop a rebuild of the first alone
    page.write_text(
        text + "\n<!-- mnemo:continual --experiment retention --out docs/results/continual_other -->\n"
    )
    with pytest.raises(FileNotFoundError, match=r"continual_other/continual.json holds no results"):
        reproduce_page(page, run=False, progress=False, log=lambda s: None, continual=cont)
    reproduce_page(
        page, run=False, only=["continual_ret"], progress=False, log=lambda s: None, continual=cont
    )
    # a line that no longer says what the kept results ran is refused without --no-run's rebuild
    for edit, says in [
        (("--steps 2", "--steps 3"), "steps 2 against 3"),
        (("--models cms-1,cms-3", "--models cms-3"), "models ['cms-1', 'cms-3'] against ['cms-3']"),
        # a flag dropped from the line counts as much as one changed (its default differs)
        ((" --periods 1,4,16", ""), "periods [1, 4, 16] against (1, 4, 16, 64)"),
        ((" --eval-streams 4", ""), "eval_streams 4 against 2048"),
        ((" --models cms-1,cms-3", ""), "against ['cms-1', 'cms-2', 'cms-3', 'flat-3', 'flat-3-rates'"),
        (("--lr-grid 3e-3,1e-2,3e-2", "--lr-grid 3e-3,1e-2,1e-1"), "lr_grid [0.003, 0.01, 0.03] against"),
        (("--periods 1,4,16", "--periods 1,4"), "periods [1, 4, 16] against (1, 4)"),
        (("--seeds 3", "--seeds 2"), "seeds [0, 1, 2] against --seeds 2"),
    ]:
        page.write_text(text.replace(*edit))
        with pytest.raises(ValueError, match=r"cont.md:5: .*holds results of another command"):
            try:
                reproduce_page(page, run=False, progress=False, log=lambda s: None, continual=cont)
            except ValueError as e:
                assert says in str(e)
                raise


def test_a_continual_line_is_checked_before_anything_runs(tmp_path, monkeypatch):
    import mnemo.commands.continual as cont

    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cont, "train_one", _fake_retention(calls))
    page = tmp_path / "p.md"
    for bad, match in [
        ("--experiment retention --lr 1e-2 --lr-grid 1e-3,1e-2,3e-2 --out o", r"p.md:3: .*--lr: each model"),
        ("--experiment retention --models cms-1 --out o --force", r"p.md:3: .*--force: it retrains"),
        ("--experiment nope --out o", r"p.md:3: .*invalid choice: 'nope'"),
        ("--experiment retention --out 'o", r"p.md:3: the mnemo:continual line does not parse"),
        ("--experiment retention --out o -h", r"p.md:3: .*-h/--help: a command line to run"),
    ]:
        page.write_text(f"# p\n\n<!-- mnemo:continual {bad} -->\n")
        with pytest.raises(ValueError, match=match):
            reproduce_page(page, progress=False, log=lambda s: None, continual=cont)
    page.write_text("# p\n\n<!-- mnemo:continual --experiment retention --models cms-1 --out o -->\n")
    with pytest.raises(ValueError, match=r"has mnemo:continual lines: rebuild it with the `mnemo reproduce`"):
        reproduce_page(page, run=False, progress=False, log=lambda s: None)  # the sweep layer alone
    with pytest.raises(FileNotFoundError, match=r"o/continual.json holds no results of retention"):
        reproduce_page(page, run=False, progress=False, log=lambda s: None, continual=cont)
    assert calls == [] and "mnemo:begin" not in page.read_text()


def _training_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "latest").write_text("ckpt-000001\n")
    (folder / "metrics.jsonl").write_text("")


def test_a_continual_lines_out_is_checked_in_the_pages_checkout_and_expands_home(tmp_path, monkeypatch):
    """A relative ``--out`` is the checkout's wherever ``mnemo reproduce`` runs: a training run's
    folder at that path in the working directory does not refuse the line, one in the checkout
    does; ``~/...`` is the home folder, not a folder named ``~`` in the checkout."""
    import mnemo.commands.continual as cont

    root, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (root / "docs").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    _training_run(elsewhere / "runs" / "r1")
    monkeypatch.chdir(elsewhere)
    page = root / "docs" / "p.md"
    page.write_text("# p\n\n<!-- mnemo:continual --experiment retention --models cms-1 --out runs/r1 -->\n")
    (job,) = cont.page_jobs(page)  # runs/r1 is a training run here, not in the checkout
    assert job["out"] == root / "runs" / "r1" and job["kwargs"]["out"] == root / "runs" / "r1"
    _training_run(root / "runs" / "r1")
    (elsewhere / "runs" / "r1" / "latest").unlink()
    (elsewhere / "runs" / "r1" / "metrics.jsonl").unlink()
    with pytest.raises(ValueError, match=r"p.md:3: .*training run's folder"):
        cont.page_jobs(page)
    assert Path.cwd() == elsewhere  # the working directory is given back, refused or not
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    page.write_text("# p\n\n<!-- mnemo:continual --experiment retention --models cms-1 --out ~/cont -->\n")
    (job,) = cont.page_jobs(page)
    assert job["out"] == home / "cont" and job["name"] == "continual_cont"


def test_a_continual_line_does_not_replace_results_it_did_not_write(tmp_path, monkeypatch):
    """``continual.json`` holding an experiment the line does not run, results of another command,
    or a broken file, with no block made for the folder on the page: refused before anything
    trains, the file untouched. Results of the same command, made by the CLI, are adopted."""
    import json

    import mnemo.commands.continual as cont

    calls = []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.setattr(cont, "train_one", _fake_retention(calls))
    line = (
        "--experiment retention --seeds 3 --steps 2 --eval-streams 4 --models cms-1 --workers 1 --no-progress"
    )
    out = tmp_path / "res" / "c"
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text(f"# p\n\n<!-- mnemo:continual {line} --out res/c -->\n")
    out.mkdir(parents=True)
    path = out / "continual.json"
    for held, says in [
        ({"experiments": {"abab": {}}}, "holds results of abab, which the line does not run"),
        ([], "is not a result of mnemo continual"),
        ({"experiments": []}, "is not a result of mnemo continual"),
    ]:
        path.write_text(json.dumps(held))
        with pytest.raises(ValueError, match="no generated block made for") as e:
            reproduce_page(page, progress=False, log=lambda s: None, continual=cont)
        assert says in str(e.value) and json.loads(path.read_text()) == held and calls == []
        if says.startswith("is not"):  # --no-run names it too, without a traceback
            with pytest.raises(ValueError, match="is not a result of mnemo continual"):
                reproduce_page(page, run=False, progress=False, log=lambda s: None, continual=cont)
    path.unlink()
    assert main(["continual", *line.split(), "--out", str(out)]) == 0  # the CLI, then the page
    n = len(calls)
    reproduce_page(page, progress=False, log=lambda s: None, continual=cont)
    assert len(calls) == n and "<!-- mnemo:begin continual_c -->" in page.read_text()  # adopted, resumed
    held = json.loads(path.read_text())
    page.write_text(page.read_text().replace("--seeds 3", "--seeds 4", 1))  # the line's own block: replaced
    reproduce_page(page, progress=False, log=lambda s: None, continual=cont)
    assert json.loads(path.read_text())["experiments"]["retention"]["seeds"] == [0, 1, 2, 3]
    assert held["experiments"]["retention"]["seeds"] == [0, 1, 2]
