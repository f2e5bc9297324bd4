"""Third break-it review of the command line (mnemo.cli, mnemo.argtypes, mnemo.commands): each test
is a defect found by the review, failing before its fix."""

from __future__ import annotations

import json

import pytest

import mnemo.commands.continual as continual
from mnemo.cli import main

#: the smallest continual command: one experiment, two models, one seed, two steps
CONTINUAL = ["continual", "--experiment", "abab", "--models", "cms-1,cms-2", "--periods", "1,4"]
CONTINUAL += ["--seeds", "1", "--steps", "2", "--eval-streams", "4", "--workers", "1", "--no-progress"]


def test_an_interrupted_continual_force_resumes_without_training_its_finished_runs_again(
    tmp_path, capsys, monkeypatch
):
    """``mnemo continual --force`` interrupted says "run the same mnemo continual command again to
    continue", but the same command (with --force) trained every run again, the ones the interrupted
    command had finished included (and without --force it is refused: the old results are there)."""
    argv = [*CONTINUAL, "--out", str(tmp_path / "c")]
    assert main(argv) == 0  # earlier results, which --force replaces
    real, trained = continual.train_one, []

    def counting(*a, **k):
        trained.append((len(a[2]), a[4]))  # (the levels, the seed)
        if interrupt_at and len(trained) == interrupt_at:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(continual, "train_one", counting)
    interrupt_at = 2  # the first run finishes, the second is interrupted
    assert main([*argv, "--force"]) == 130
    assert "run the same mnemo continual command again to continue" in capsys.readouterr().err
    trained.clear()
    interrupt_at = 0
    assert main([*argv, "--force"]) == 0
    assert len(trained) == 1, trained  # only the run the interrupted command did not finish
    assert not (tmp_path / "c" / "runs" / ".fresh.json").exists()
    trained.clear()
    assert main([*argv, "--force"]) == 0  # a new --force call (the last one ended): both again
    assert len(trained) == 2, trained


#: the smallest task run's flags (no --task: the test gives it or its config file does)
TASK_SMALL = ["--seq-len", "32", "--steps", "1", "--batch-size", "2", "--eval-batches", "1"]
TASK_SMALL += ["--d-model", "16", "--n-layers", "1", "--no-progress"]


@pytest.mark.parametrize(
    "text, flags, named",
    [
        ("data: CORPUS\ntokenizer: byte\n", ["--task", "mqar"], "data, c.yaml: tokenizer"),
        ("task: mqar\ndata: CORPUS\n", [], "c.yaml: data"),
        ("task: mqar\nsample_prompt: 'KING:'\n", [], "c.yaml: sample_prompt"),
    ],
)
def test_a_config_files_text_settings_on_a_task_run_are_refused_as_the_flags_are(
    text, flags, named, tmp_path, capsys, monkeypatch
):
    """``--task mqar --data corpus.txt`` is refused (a task run reads no corpus), but the same
    settings from a ``--config`` file trained the task and ignored the corpus and tokenizer without
    a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("ab cd\n" * 200)
    (tmp_path / "c.yaml").write_text(text.replace("CORPUS", "corpus.txt"))
    argv = ["train", "--config", "c.yaml", *flags, *TASK_SMALL, "--out", "run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "text options" in err, err
    assert not (tmp_path / "run").exists()


def test_a_task_runs_saved_config_is_still_a_config_file(tmp_path, capsys, monkeypatch):
    """(what the check above leaves alone) a task run's train_config.json holds the text settings'
    defaults: given as --config, it trains."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--task", "mqar", *TASK_SMALL, "--out", "a"]) == 0
    saved = next((tmp_path / "a").glob("ckpt-*")) / "train_config.json"
    assert main(["train", "--config", str(saved), "--out", "b", "--no-progress"]) == 0


def test_the_printed_final_record_is_the_saved_one_to_six_digits(tmp_path, capsys):
    """``mnemo train`` ends by printing its final record rounded to 5 decimals: a warm-up's first
    learning rate (``--lr 1e-4`` over 50 warm-up steps: 2e-6, as metrics.jsonl holds) was printed as
    ``"lr": 0.0``."""
    out = tmp_path / "run"
    assert main(["train", "--task", "mqar", *TASK_SMALL, "--lr", "1e-4", "--out", str(out)]) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    saved = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(printed) == 1 and printed[0].keys() == saved.keys()
    assert saved["lr"] == pytest.approx(2e-6, rel=1e-9)
    for k, v in saved.items():
        if isinstance(v, float):
            assert printed[0][k] == pytest.approx(v, rel=1e-5, abs=0), k
        else:
            assert printed[0][k] == v, k
