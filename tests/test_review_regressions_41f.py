"""Regressions of review 41f (commits 903dd83: mnemo train's --out inside its --data glob; d9d922c:
evaluate_task's cache, the continual tasks' sizes, t_quantile at df 2, icl_score's skip; 506e639:
--overwrite of a dangling linked checkpoint): each test failed on the code of those commits."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from mnemo.data.tasks.continual import make_task


@pytest.mark.parametrize(
    "experiment, sizes",
    [
        ("forgetting_mqar", {"n": 4, "m": 2, "n_keys": 8, "n_values": 4}),
        ("retention", {"n": 8, "bins": 2, "per_bin": 2, "n_keys": 8, "n_values": 3, "offset": 2}),
        ("class_incremental", {"phases": 2, "classes_per_phase": 1, "n_labels": 2}),
    ],
)
def test_continual_sizes_given_as_numpy_integers_still_build(experiment, sizes):
    """d9d922c checked the sizes of ``forgetting_mqar``, ``retention`` (and ``class_incremental``'s
    ``phases``) with ``isinstance(v, int)``: a NumPy integer (``np.arange`` of sizes swept in a
    script), which built the same streams before, was refused "n: expected an int >= 1, got
    np.int64(4)". It builds them again, and the task holds plain ints (its sizes go to JSON)."""
    as_numpy = {k: np.int64(v) for k, v in sizes.items()}
    task = make_task(experiment, **as_numpy)
    want = make_task(experiment, **sizes).batch(3, torch.Generator().manual_seed(0))
    got = task.batch(3, torch.Generator().manual_seed(0))
    assert torch.equal(got.ids, want.ids) and torch.equal(got.targets, want.targets)
    options = dataclasses.asdict(task)
    assert all(type(options[k]) is int for k in sizes), options
    json.dumps(options)


def test_a_sweep_refuses_run_folders_its_data_glob_reads(tmp_path, monkeypatch):
    """903dd83 refused ``mnemo train --out`` inside its own ``--data`` glob, but a sweep whose
    ``data`` glob reads its run folders (``out: corpus/sweep`` with ``corpus/**/*.jsonl``) still
    trained: its first run passed, and every later run read the first's ``metrics.jsonl`` as corpus
    and failed ("records ... have no field 'text'"). The sweep is refused before anything is made."""
    from mnemo.sweep import SweepSpec, run_sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "hello world, this is text."}\n' * 300)
    base = {"data": "corpus/**/*.jsonl", "tokenizer": "byte", "seq_len": 16, "batch_size": 2, "steps": 2}
    base |= {"eval_interval": 2, "eval_batches": 1, "warmup_steps": 1, "sample_tokens": 0}
    base |= {"model_overrides": {"d_model": 16, "n_layers": 1}}
    spec = SweepSpec.from_dict(
        {"name": "g", "metric": "val_loss", "base": base, "models": ["gla"], "grid": {"lr": [1e-3, 1e-2]}}
    )
    out = tmp_path / "corpus" / "sweep"
    with pytest.raises(ValueError, match="corpus/sweep"):
        run_sweep(spec, tmp_path / "s.sqlite", out, progress=False, log=lambda s: None)
    assert not out.exists() and not (tmp_path / "s.sqlite").exists()
    # a sweep beside the corpus runs
    counts = run_sweep(spec, tmp_path / "s.sqlite", tmp_path / "sweep", progress=False, log=lambda s: None)
    assert counts["done"] == 2, counts


def test_a_dangling_linked_checkpoint_is_a_leftover_a_new_run_is_told_of(tmp_path, monkeypatch, capsys):
    """506e639 made ``--overwrite`` set aside a linked ``ckpt-*`` whose target is gone, but the
    check before it (a folder holding a run without ``latest``: pass --resume or --overwrite)
    counted ``ckpt-*`` folders by ``is_dir()``, which a dangling link is not: ``mnemo train --out``
    there trained and then failed "Not a directory while writing the checkpoint" with a stray
    ``.tmp-ckpt-*``. It is refused up front, naming the link and --overwrite, which then works."""
    from mnemo.cli import main
    from tests.helpers import fast_train_flags

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt-000002").symlink_to(tmp_path / "gone", target_is_directory=True)
    argv = ["train", "--model", "gla", *fast_train_flags(16, 2), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ckpt-000002" in err and "--overwrite" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-000002"], "nothing trained or written"
    assert main([*argv, "--overwrite"]) == 0, capsys.readouterr().err
    assert (out / "ckpt-000002").is_dir() and not (out / "ckpt-000002").is_symlink()
