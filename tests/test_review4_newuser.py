"""Fourth break-it review as a new user following the README, the guides and ``--help``: each test is a
defect found by the review, failing before its fix."""

from __future__ import annotations

import json

from mnemo.cli import main
from mnemo.models import LanguageModel
from mnemo.train.checkpoint import MANIFEST_NAME, _sha256

FAST = ["--seq-len", "16", "--steps", "2", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1"]
FAST += ["--warmup-steps", "1", "--sample-tokens", "0", "--no-progress"]


def _drop_expand_v(o):
    if isinstance(o, dict):
        o.pop("expand_v", None)
        for v in o.values():
            _drop_expand_v(v)
    return o


def test_an_old_width_retnet_run_that_cannot_resume_says_what_to_do(tmp_path, capsys):
    """A ``retnet`` run saved before the preset's value width became the paper's 2·d_model loads
    for ``eval``/``generate`` (``from_pretrained`` reads the width from the weights), but
    ``--resume`` (which keeps the saved model) and ``--init-from`` into today's preset ended with
    torch's size mismatch and "written by another version?", not what to do. Both now name the old
    width and the ``model_overrides`` that builds it."""
    opts = {"d_model": 16, "n_layers": 1, "mixer_options": {"retnet": {"n_heads": 2, "expand_v": 1.0}}}
    config = tmp_path / "old.json"
    config.write_text(json.dumps({"model": "retnet", "model_overrides": opts}))
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(out), *FAST]) == 0
    # the saved configs as an older mnemo wrote them: no expand_v (the manifest made to match)
    ckpt = next(out.glob("ckpt-*"))
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    for name in ("config.json", "train_config.json"):
        p = ckpt / name
        p.write_text(json.dumps(_drop_expand_v(json.loads(p.read_text())), indent=2))
        manifest["files"][name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    assert LanguageModel.from_pretrained(ckpt).config.mixer_options["retnet"]["expand_v"] == 1.0
    capsys.readouterr()

    resume = ["train", "--out", str(out), "--resume", "--steps", "4", "--reschedule", "stretch"]
    assert main([*resume, "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "old value width (expand_v 1.0;" in err
    assert "model_overrides: {mixer_options: {retnet: {expand_v: 1.0}}}" in err
    assert "--init-from" in err

    new = ["train", "--model", "retnet", "--d-model", "16", "--n-layers", "1", "--init-from", str(out)]
    assert main([*new, "--out", str(tmp_path / "new"), *FAST]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "old value width (expand_v 1.0;" in err
    assert "model_overrides: {mixer_options: {retnet: {expand_v: 1.0}}}" in err


def test_eval_yarn_help_names_every_value_the_flag_takes(capsys):
    """``mnemo eval --yarn 0.5`` is refused with "expected a finite number >= 1 or 'auto'", but the
    help named neither the lower bound nor ``auto`` (the value a bare ``--yarn`` stands for)."""
    assert main(["eval", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "factor FACTOR (>= 1) or (no FACTOR, or 'auto') length / training seq_len per --length" in text


def test_a_capacity_partial_file_of_other_settings_is_not_dropped_silently(tmp_path, capsys):
    """An interrupted ``mnemo probe capacity`` keeps its cells in ``capacity.partial.json``; run again
    with one setting changed (``--seeds 4`` after ``--seeds 3``), every cell was measured anew and the
    kept cells replaced without a word. It now says which settings differ before any work."""
    from mnemo.commands.capacity import _partial_cells

    partial = tmp_path / "capacity.partial.json"
    expected = {"seeds": [0, 1, 2, 3], "streams": 64, "sources": "abc"}
    held = {"seeds": [0, 1, 2], "streams": 64, "sources": "abc"}
    cell = {"variant": "mlp", "n_pairs": 4, "passes": 1}
    partial.write_text(json.dumps({"expected": held, "cells": [cell, {**cell, "n_pairs": 8}]}))
    assert _partial_cells(partial, expected) == {}
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "its 2 measured cell(s) are of other settings or code (seeds [0, 1, 2] there, [0, 1, 2, 3] now)"
        in err
    )
    partial.write_text(json.dumps({"expected": {**expected, "sources": "old"}, "cells": [cell]}))
    assert _partial_cells(partial, expected) == {}
    assert "(mnemo's code or torch changed)" in capsys.readouterr().err
    # the same settings: its cells, without a word here (the caller says how many it keeps)
    partial.write_text(json.dumps({"expected": expected, "cells": [cell]}))
    assert _partial_cells(partial, expected) == {("mlp", 4, 1): cell}
    assert capsys.readouterr().err == ""
