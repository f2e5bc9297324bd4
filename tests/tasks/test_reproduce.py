"""``mnemo reproduce PAGE``: a results page rebuilt from the sweep files it names. Runs are fake
(``run_one`` replaced by known accuracies) so the generated table can be checked number by number."""

from __future__ import annotations

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


def test_the_cli_rebuilds_the_page(tmp_path, monkeypatch, capsys):
    calls = []
    page = _setup(tmp_path, monkeypatch, calls)
    assert main(["reproduce", str(page), "--no-progress"]) == 0
    assert len(calls) == 5 and "<!-- mnemo:begin tiny -->" in page.read_text()
    assert "rewrote" in capsys.readouterr().out
