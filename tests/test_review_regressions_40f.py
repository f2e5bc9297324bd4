"""Regression review 40f of 09a7de1 (spectrum.json null + "nonfinite"; a sweep file's relative paths
read against its project folder) and a397dd2: each test fails on the code before its mend."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from mnemo.cli import main
from tests.helpers import sweep_project

ROOT = Path(__file__).resolve().parents[1]


def test_a_sweep_files_tokenizer_folder_named_without_a_slash_loads_from_any_working_directory(
    tmp_path, monkeypatch
):
    """``tokenizer: mytok`` (a folder of the project holding tokenizer.json) was made absolute for
    training, but the run's TrainConfig was validated as written, against the working directory:
    from another folder the sweep file was refused ("expected 'char', 'byte' or a path"). Now it
    loads from anywhere; a name that is no path of the project (``bpe``) is still refused."""
    from mnemo.data import build_tokenizer, save_tokenizer
    from mnemo.sweep import SweepSpec

    proj, away = sweep_project(tmp_path)
    (proj / "mytok").mkdir()
    save_tokenizer(build_tokenizer("char", "abc "), proj / "mytok")
    (proj / "corpus.txt").write_text("abc " * 100)
    f = proj / "sweeps" / "s.yaml"
    f.write_text(
        "name: t\nmetric: val_loss\nbase: {data: corpus.txt, tokenizer: mytok, steps: 1}\nmodels: [gla]\n"
    )
    for cwd in (proj, away):
        monkeypatch.chdir(cwd)
        (run,) = SweepSpec.load(f).runs()
        assert run.train_config["tokenizer"] == str(proj / "mytok")
        assert run.config["tokenizer"] == "mytok"  # stored (and hashed) as the file writes it
    f.write_text(f.read_text().replace("mytok", "bpe"))
    with pytest.raises(ValueError, match=r"TrainConfig.tokenizer: expected 'char', 'byte' or a path"):
        SweepSpec.load(f)


def test_a_sweep_whose_data_is_beside_the_working_directory_not_its_project_folder_is_refused_first(
    tmp_path, monkeypatch, capsys
):
    """A sweep file in a sub-folder of a folder without pyproject.toml or .git, its ``data`` written
    relative to the folder it is run from (as the repository's own sweep files are written): the
    sweep ran, read ``sweeps/corpus.txt``, and every run failed with "data file not found" for a
    path the file never wrote, after making ``sweeps/runs/``. Now refused before anything runs,
    naming the project folder it is read against and the file the working directory holds."""
    home = tmp_path / "home"
    (home / "sweeps").mkdir(parents=True)
    (home / "corpus.txt").write_text("abcdefgh " * 300)
    f = home / "sweeps" / "s.yaml"
    f.write_text(
        "name: rel\nmetric: val_loss\nbase: {data: corpus.txt, steps: 1, seq_len: 8, batch_size: 2, "
        "eval_batches: 1, sample_tokens: 0, model_overrides: {d_model: 16, n_layers: 1}}\nmodels: [gla]\n"
        "db: runs/rel.sqlite\nout: runs/rel\n"
    )
    monkeypatch.chdir(home)
    assert main(["sweep", "sweeps/s.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"data 'corpus.txt' is read against the sweep file's project folder {home / 'sweeps'}" in err
    assert f"{home / 'corpus.txt'}" in err
    assert not (home / "sweeps" / "runs").exists()


def _spectrum_page():
    spec = importlib.util.spec_from_file_location("spectrum_page_r40f", ROOT / "scripts" / "spectrum_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spectrum_page_rows_read_a_spectrum_json_as_json_loads_gives_it(tmp_path):
    """``rows`` takes "one model's spectrum.json"; the file now holds an infinite half-life as
    null (+ "nonfinite"), and ``rows`` of the file read with ``json.loads`` (as the result-script
    test reads it) raised ``TypeError: float() argument ... 'NoneType'``. Now the same row as
    from ``loads_record``."""
    from mnemo.train.sinks import dumps_record, loads_record

    mod = _spectrum_page()
    summary = {c: 0.25 for c in mod.CLASSES[:4]} | {"unresolved": 0.0}
    summary |= {"directions": 4, "computed": 4, "max_exponent": 0.0, "median_half_life": math.inf}
    text = dumps_record({"layers": {"0": {"kind": "linear", "heads": 1, "summary": summary}}})
    assert mod.rows("m", json.loads(text)) == mod.rows("m", loads_record(text))
    assert [c.strip() for c in mod.rows("m", json.loads(text))[0].split("|")][9] == "∞"
