"""Hostile input for every command, by construction (issue 35).

The suite walks the ``mnemo`` parser: every option of every sub-command that takes a value must
declare its kind (:mod:`mnemo.argtypes`), and each kind's hostile values (zero, negative, huge,
NaN/inf, an empty string, a file for a folder and a folder for a file, a read-only place, a path
into a run's checkpoint) are tried on it. A value the kind refuses must end the command with exit
status 2 and one line naming the flag, before any work and without a traceback; a value it
accepts is legal, and the end-to-end cases below run the commands with the legal extremes that
could allocate or lose something. The named findings of the issue each have a test here too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from mnemo import argtypes as kinds
from mnemo.cli import build_parser, main

#: options that take any text, on purpose (checked where they are used, or free by nature)
FREE_TEXT = {
    ("generate", "--prompt"),  # any text, the empty prompt included
    ("harness", "--model-args"),  # key=value,... parsed by lm-eval; empty = none
    ("train", "--task-option"),  # KEY=VALUE, checked by mnemo.commands.train._parse_task_options
}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def _before(path: tuple[str, ...], action: argparse.Action, places) -> list[str]:
    """Valid values for the positionals that come before ``action`` (``convert SRC OUT``: a
    folder for SRC when OUT is tried)."""
    if action.option_strings:
        return []
    earlier = []
    for p, a in _walk(build_parser()):
        if p == path and not a.option_strings:
            if a is action or a.dest == action.dest:
                break
            earlier.append(str(places["folder"]))
    return earlier


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and not isinstance(
        action, (argparse._StoreConstAction, argparse._StoreTrueAction, argparse._CountAction)
    )


def _flag(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


ACTIONS = [(path, a) for path, a in _walk(build_parser()) if _takes_value(a)]


def test_every_option_that_takes_a_value_declares_its_kind():
    undeclared = [
        f"mnemo {' '.join(path)} {_flag(a)}"
        for path, a in ACTIONS
        if a.choices is None and kinds.kind_of(a) is None and (path[0], _flag(a)) not in FREE_TEXT
    ]
    assert not undeclared, f"options without a declared kind (mnemo.argtypes): {undeclared}"
    plain = [f"{' '.join(p)} {_flag(a)}" for p, a in ACTIONS if a.type in (int, float)]
    assert not plain, f"plain int/float options (no range): {plain}"


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A file, a folder, a missing path, a place under a file, a read-only place (when this
    machine has one) and a tiny run whose checkpoint nothing may be written into."""
    root = tmp_path_factory.mktemp("hostile")
    f = root / "a-file.txt"
    f.write_text("not a folder\n")
    d = root / "a-folder"
    d.mkdir()
    run = root / "run"
    ckpt = run / "ckpt-000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text('{"format": 1, "files": {}}\n')
    (run / "latest").write_text("ckpt-000002\n")
    read_only = next(
        (Path(p) for p in ("/proc/sys",) if Path(p).is_dir() and not os.access(p, os.W_OK)), None
    )
    return {"file": f, "folder": d, "missing": root / "no" / "such", "ckpt": ckpt, "read_only": read_only}


def _hostile(kind: kinds.Kind, places) -> list[str]:
    """The values tried on an option of ``kind``: its own list plus the places of its kind."""
    values = list(kind.hostile)
    f, d, missing, ckpt, ro = (places[k] for k in ("file", "folder", "missing", "ckpt", "read_only"))
    if isinstance(kind, kinds.ExistingFile):
        values += [str(d), str(missing)]
    elif isinstance(kind, kinds.ExistingDir):
        values += [str(f), str(missing)]
    elif isinstance(kind, kinds.OutDir):
        values += [str(f), str(f / "sub"), str(ckpt), str(ckpt / "sub")] + ([str(ro / "x")] if ro else [])
    elif isinstance(kind, (kinds.OutFile, kinds.OutPath)):
        suffix = (
            getattr(kind, "suffix", None) or getattr(getattr(kind, "file", None), "suffix", "") or ".json"
        )
        values += [str(f / f"sub{suffix}"), str(ckpt / f"x{suffix}")] + (
            [str(ro / f"x{suffix}")] if ro else []
        )
        if isinstance(kind, kinds.OutFile):
            values += [str(d)]
    return values


def _parse(argv: list[str], parser: argparse.ArgumentParser | None = None) -> tuple[int | None, str]:
    """Parse ``argv`` with ``parser`` (a fresh one when None): (exit status or None when it parsed,
    stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            (parser or build_parser()).parse_args(argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    return None, err.getvalue()


def _accepts(kind, value) -> bool:
    try:
        kind(value)
    except argparse.ArgumentTypeError:
        return False
    return True


def test_every_hostile_value_is_refused_in_one_line_naming_the_flag(places):
    """Sub-commands × options × hostile values: each value the kind refuses gives status 2 and
    one line ``mnemo CMD: error: argument FLAG: expected ..., got 'VALUE' ...``; each value it
    accepts parses. The counts are printed (pytest -s)."""
    tried, refused, problems = 0, 0, []
    commands = set()
    # one parser for every value (building one takes ~8 ms, parsing ~0.1 ms): parse_args leaves an
    # argparse parser as it was (mnemo's has no stateful action), so each value meets the parser a
    # fresh ``mnemo`` process builds
    parser = build_parser()
    for path, action in ACTIONS:
        kind = kinds.kind_of(action)
        if kind is None:
            continue
        commands.add(path)
        flag = _flag(action)
        earlier = _before(path, action, places)
        for value in _hostile(kind, places):
            tried += 1
            argv = [*path, f"{flag}={value}"] if action.option_strings else [*path, *earlier, value]
            code, err = _parse(argv, parser)
            if not _accepts(kind, value):
                refused += 1
                lines = err.strip().splitlines()
                ok = code == 2 and len(lines) == 1 and f"argument {flag}: expected" in lines[0]
                ok = ok and "Traceback" not in err and repr(value)[1:-1] in lines[0]
                if not ok:
                    problems.append(f"mnemo {' '.join(path)} {flag} {value!r}: status {code}, {err!r}")
            elif code == 2 and f"argument {flag}:" in err:  # accepted by the kind, refused by argparse
                problems.append(f"mnemo {' '.join(path)} {flag} {value!r}: {err.strip()}")
    n_cmd, n_opt = len(commands), len(ACTIONS)
    print(f"\nhostile suite: {n_cmd} commands, {n_opt} options, {tried} values tried, {refused} refused")
    assert not problems, "\n".join(problems[:20])
    assert tried > 500 and refused > 400


def test_a_mistyped_space_separated_value_is_refused_too():
    """``--steps -5`` (a space, not ``=``) is read as the flag's value, and refused."""
    code, err = _parse(["train", "--steps", "-5"])
    assert code == 2 and err.strip() == (
        "mnemo train: error: argument --steps: expected an int in [1, 1000000000], got '-5' "
        "(see: mnemo train --help)"
    )


def test_main_returns_2_with_one_line(capsys):
    assert main(["generate", "--checkpoint", ".", "--top-k", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --top-k: expected an int >= 1, got '0'" in err


# ------------------------------------------------------------------------------------------------
# the findings of the hostile trial, each reproduced first


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained run (2 checkpoints)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", *TINY, "--steps", "4", "--eval-interval", "2", "--out", str(out)]) == 0
    return out


#: the smallest text run: one layer of width 16, 2-step evaluations, no sample
TINY = ["--d-model", "16", "--n-layers", "1", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1"]
TINY += ["--sample-tokens", "0", "--no-progress"]


def _resume(run: Path, steps: int) -> int:
    """``mnemo train --out RUN --resume --steps N --reschedule hold``: its exit status."""
    return main(
        [
            "train",
            "--out",
            str(run),
            "--resume",
            "--steps",
            str(steps),
            "--reschedule",
            "hold",
            "--no-progress",
        ]
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_latest_pointing_outside_the_run_is_never_followed(run, tmp_path, capsys):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(run, other)
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / "latest").write_text("../other/ckpt-000002\n")
    before = _tree(mine)
    for argv in (
        ["train", "--out", str(mine), "--resume", "--steps", "8", "--no-progress"],
        ["eval", "--checkpoint", str(mine)],
        ["generate", "--checkpoint", str(mine), "--max-new-tokens", "2"],
        ["probe", "circuits", "--checkpoint", str(mine), "--length", "4", "--batch", "1"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{mine / 'latest'} points to '../other/ckpt-000002', which is not one of this run's" in err
        assert "Traceback" not in err
    assert _tree(mine) == before  # nothing rotated, nothing rewritten
    for bad in ("/abs/ckpt-000002", "ckpt-000002/../ckpt-000004", "tmp"):
        (mine / "latest").write_text(bad + "\n")
        from mnemo.train import ForeignCheckpointError, resolve_checkpoint

        with pytest.raises(ForeignCheckpointError, match="not one of this run's checkpoints"):
            resolve_checkpoint(mine)


def test_a_checkpoint_link_out_of_the_run_is_not_followed(run, tmp_path):
    import shutil

    from mnemo.train import ForeignCheckpointError, resolve_checkpoint

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    shutil.copytree(run / "ckpt-000004", tmp_path / "elsewhere")
    shutil.rmtree(mine / "ckpt-000004")
    (mine / "ckpt-000004").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ForeignCheckpointError):
        resolve_checkpoint(mine)


def test_a_latest_made_as_a_link_is_followed_inside_the_run_only(run, tmp_path):
    """Hostile trial 9, finding 6: ``ln -s ckpt-000002 latest`` was reported as "latest is missing"
    (and the newest checkpoint used). A link to one of the run's own checkpoints is now followed
    like the pointer file, silently; a link anywhere else is refused as a foreign pointer."""
    import shutil
    import warnings

    from mnemo.train import ForeignCheckpointError, resolve_checkpoint

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / "latest").unlink()
    (mine / "latest").symlink_to("ckpt-000002")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "missing" warning, no other
        assert resolve_checkpoint(mine) == mine / "ckpt-000002"
    shutil.copytree(run, tmp_path / "other")
    for dest in (tmp_path / "other" / "ckpt-000002", tmp_path / "other" / "latest", mine / "metrics.jsonl"):
        (mine / "latest").unlink()
        (mine / "latest").symlink_to(dest)
        with pytest.raises(ForeignCheckpointError, match=rf"latest is a link to '{dest}', which is not one"):
            resolve_checkpoint(mine)


def test_probe_results_default_beside_the_checkpoint_and_survive_training(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    assert main(["probe", "circuits", "--checkpoint", str(mine), "--length", "4", "--batch", "2"]) == 0
    assert main(["probe", "ablate", "--checkpoint", str(mine), "--top-induction", "1", "--draws", "1"]) == 0
    capsys.readouterr()
    probes = mine / "probes" / "ckpt-000004"
    assert (probes / "circuits.png").is_file() and (probes / "ablate-top1.json").is_file()
    assert not list((mine / "ckpt-000004").glob("circuits*"))
    # a file a user put inside a checkpoint is kept when rotation removes that checkpoint
    (mine / "ckpt-000004" / "notes.txt").write_text("mine\n")
    with pytest.warns(UserWarning, match="not part of the checkpoint were kept"):
        assert _resume(mine, 8) == 0
    capsys.readouterr()
    assert not (mine / "ckpt-000004").exists()
    assert (mine / "kept" / "ckpt-000004" / "notes.txt").read_text() == "mine\n"
    assert (probes / "circuits.png").is_file() and (probes / "ablate-top1.json").is_file()


def test_probe_out_inside_a_checkpoint_is_refused(run, capsys):
    code = main(["probe", "circuits", "--checkpoint", str(run), "--out", str(run / "ckpt-000004")])
    assert code == 2
    assert "inside the checkpoint" in capsys.readouterr().err


def test_export_refuses_its_source_even_with_force(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    before = _tree(mine)
    for src, out in ((mine, mine), (mine / "ckpt-000004", mine / "ckpt-000004"), (mine, mine / "x")):
        assert main(["export", str(src), str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert "writing there would overwrite what is read" in err or "inside the checkpoint" in err
    assert _tree(mine) == before


def test_verify_fails_on_a_pattern_that_matches_nothing(capsys):
    assert main(["verify", "--quick", "--ops", "linear_identity", "--checks", "nosuch*"]) == 2
    err = capsys.readouterr().err
    assert "--checks: 'nosuch*' matches no check of the selected ops; known: " in err and "forms" in err
    assert main(["verify", "--quick", "--ops", "linear_identity,nosuch", "--list"]) == 2
    assert "--ops: 'nosuch' matches no spec" in capsys.readouterr().err


def test_divergence_found_by_an_op_ends_in_the_trainers_message(tmp_path, capsys):
    """Mamba at a huge lr: the weights overflow in the first step and the evaluation's selective
    scan finds ``A`` infinite. The run ends with the trainer's message (the step, the last good
    checkpoint), not the op's hint to turn its check off."""
    argv = ["train", "--model", "mamba", "--lr", "1e8", "--warmup-steps", "0", "--d-model", "16"]
    argv += ["--n-layers", "1", "--seq-len", "16", "--batch-size", "2", "--steps", "5"]
    argv += ["--eval-interval", "1", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert re.search(
        r"training stopped at step \d+: the (validation loss|loss|gradient norm|weights) became nan", err
    )
    assert "MNEMO_CHECK_FINITE" not in err and "Traceback" not in err


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    import torch

    from mnemo.train import TrainConfig, Trainer, TrainingDiverged

    cfg = TrainConfig(
        model="gla",
        steps=4,
        seq_len=16,
        batch_size=2,
        eval_interval=1,
        eval_batches=1,
        sample_tokens=0,
        model_overrides={"d_model": 16, "n_layers": 1},
    )
    t = Trainer(cfg, tmp_path / "r", progress=False)
    t.fit(until=2)
    step = t.train_step
    first = next(t.model.parameters())

    def poisoned():
        loss = step()
        with torch.no_grad():
            first.view(-1)[0] = float("inf")
        return loss

    t.train_step = poisoned
    with pytest.raises(
        TrainingDiverged, match=r"step 3: the weights became nan \(NaN/inf after the optimizer step in"
    ):
        t.fit()
    assert (tmp_path / "r" / "latest").read_text().strip() == "ckpt-000002"


def test_parallel_flags_without_torchrun_are_refused(tmp_path, capsys):
    for flag in ("--fsdp", "--context-parallel"):
        assert main(["train", flag, "--steps", "1", "--out", str(tmp_path / "r")]) == 2
        assert f"{flag}: needs several processes" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_memory_is_checked_before_a_probe_allocates(run, capsys):
    code = main(["probe", "circuits", "--checkpoint", str(run), "--length", "100000000"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--length / --batch: 8 sequence(s) of 200,000,000 tokens need at least" in err and "GiB" in err


HUGE = "99999999999999999999"
TASK = ["--task", "mqar", "--task-option", "num_pairs=2", "--task-option", "vocab_size=16", "--seq-len", "16"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["train", "--batch-size", HUGE], "TrainConfig.batch_size"),
        (["train", "--d-model", str(2**20), "--n-layers", "64"], "TrainConfig.model: the model's parameters"),
        (["train", "--seq-len", HUGE], "--seq-len"),
        (["train", "--circuit-length", HUGE, "--track-circuits"], "--circuit-length"),
        (["eval", "--checkpoint", "RUN", "--seq-len", HUGE], "--seq-len"),
        (["probe", "circuits", "--checkpoint", "RUN", "--batch", HUGE], "--length / --batch"),
        (["probe", "ablate", "--checkpoint", "RUN", "--top-induction", "1", "--length", HUGE], "--length"),
        (["probe", "timescales", "--checkpoint", "RUN", "--tokens", HUGE], "--tokens"),
        (["probe", "spectrum", "--checkpoint", "RUN", "--tokens", HUGE], "--tokens"),
        (["probe", "capacity", "--pairs", HUGE, "--out", "OUT"], "--streams / --pairs"),
        (["probe", "capacity", "--streams", "1000000", "--key-dim", "4096", "--out", "OUT"], "--key-dim"),
        (["train", *TASK, "--eval-lengths", HUGE], "--eval-lengths"),
        (["bench", "--ops", "linear_attention", "--repeats", "1", "--lengths", HUGE], "--lengths"),
        (["bench", "--ops", "linear_attention", "--repeats", "1", "--batch", HUGE], "--batch"),
    ],
)
def test_legal_but_huge_values_are_refused_before_allocating(argv, flag, run, tmp_path, capsys):
    """Values in their declared range that no machine could hold: refused up front (a memory
    check or the data's length), one line, nothing written."""
    argv = [str(run) if a == "RUN" else str(tmp_path / "r") if a == "OUT" else a for a in argv]
    if argv[0] == "train":
        argv += ["--steps", "1", "--sample-tokens", "0", "--no-progress", "--out", str(tmp_path / "r")]
    before = _tree(run)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").glob("ckpt-*"))
    assert _tree(run) == before


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A tiny run trained on MQAR (a task checkpoint)."""
    run = tmp_path_factory.mktemp("task") / "task"
    argv = ["train", *TASK, "--d-model", "16", "--n-layers", "1", "--batch-size", "2", "--steps", "2"]
    assert (
        main([*argv, "--eval-interval", "2", "--eval-batches", "1", "--no-progress", "--out", str(run)]) == 0
    )
    return run


def test_a_task_checkpoint_refuses_huge_test_sets(task_run, capsys):
    run = task_run
    capsys.readouterr()
    for extra, flag in (
        (["--length", HUGE], "--num-samples / --length"),
        (["--num-samples", HUGE], "--num-samples"),
    ):
        assert main(["eval", "--checkpoint", str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err and "GiB" in err


def test_a_sweep_files_places_are_checked_like_flags(tmp_path, capsys):
    for db, why in (("/proc/sys/x.sqlite", "/proc/sys is not writable"), (str(tmp_path), "a folder")):
        if why.endswith("not writable") and os.access("/proc/sys", os.W_OK):
            continue
        cfg = tmp_path / "s.yaml"
        cfg.write_text(f"name: s\nmodels: [transformer]\nbase: {{steps: 1}}\nmetric: val_loss\ndb: {db}\n")
        assert main(["sweep", str(cfg), "--out", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert f"{cfg}: db: expected a database file, got '{db}' ({why}" in err
    assert not (tmp_path / "runs").exists()


def test_a_damaged_metrics_log_is_named(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    with open(mine / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n")
    assert main(["probe", "plot-training", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl, line 3: expected a JSON object with an int 'step', got '[1, 2]'" in err


def test_second_trial_findings_lose_nothing(run, tmp_path, capsys):
    """The second hostile trial's data-loss cases: a non-database file is never turned into one;
    continual results are not replaced without --force; nothing is exported into a run folder;
    a run is not started over an export; a run's own files are not outputs; a user's ckpt-abc
    folder is not rotated."""
    import shutil

    from mnemo.hf.convert import _prepare_out

    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    assert main(["report", str(empty)]) == 2 and empty.read_bytes() == b""
    assert "is not an SQLite database" in capsys.readouterr().err
    cont = tmp_path / "cont"
    cont.mkdir()
    (cont / "continual.json").write_text("{}")
    assert main(["continual", "--out", str(cont), "--steps", "1", "--seeds", "1"]) == 2
    assert "already holds results (continual.json)" in capsys.readouterr().err
    assert (cont / "continual.json").read_text() == "{}"
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    with pytest.raises(ValueError, match="is a training run folder; --force does not write into one"):
        _prepare_out(mine, force=True)
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    assert main(["train", "--steps", "1", "--out", str(export)]) == 2
    assert "holds a checkpoint (config.json / model.safetensors" in capsys.readouterr().err
    before = _tree(mine)
    for name in ("metrics.jsonl", "latest"):
        assert main(["verify", "--quick", "--ops", "linear_identity", "--json", str(mine / name)]) == 2
        assert f"(a file of the training run {mine})" in capsys.readouterr().err
    assert _tree(mine) == before
    (mine / "ckpt-abc").mkdir()
    (mine / "ckpt-abc" / "mine.txt").write_text("x")
    assert _resume(mine, 6) == 0
    capsys.readouterr()
    assert (mine / "ckpt-abc" / "mine.txt").read_text() == "x"


def test_outputs_are_checked_before_the_work(tmp_path, capsys):
    """harness and verify used to fail only after the work, losing the results."""
    assert main(["verify", "--quick", "--ops", "linear_identity", "--json", str(tmp_path)]) == 2
    assert "argument --json: expected a file to write" in capsys.readouterr().err
    assert main(["harness", "--checkpoint", str(tmp_path), "--tasks", "x", "--out", str(tmp_path)]) == 2
    assert "argument --out: expected a file to write" in capsys.readouterr().err


def test_train_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    assert main(["train", "--out", str(f)]) == 2
    assert "argument --out: expected a run folder to write, got" in capsys.readouterr().err


def test_stale_temporaries_are_cleaned_at_the_next_start(run, tmp_path):
    import shutil

    from mnemo.train.checkpoint import clean_stale_temporaries

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / ".tmp-ckpt-000006-123").mkdir()
    (mine / ".tmp-ckpt-000006-123" / "model.safetensors").write_bytes(b"half")
    (mine / ".tmp-ckpt-000006-sharded").mkdir()
    (mine / ".latest.tmp-99").write_text("ckpt-000006")
    shutil.copytree(mine / "ckpt-000002", mine / ".old-ckpt-000002-77")
    (mine / ".old-ckpt-000002-77" / "mine.png").write_bytes(b"png")
    with pytest.warns(UserWarning):
        removed = clean_stale_temporaries(mine)
    assert sorted(removed) == sorted(
        [".tmp-ckpt-000006-123", ".tmp-ckpt-000006-sharded", ".old-ckpt-000002-77", ".latest.tmp-99"]
    )
    assert (
        not list(mine.glob(".tmp-*"))
        and not list(mine.glob(".old-*"))
        and not list(mine.glob(".latest.tmp-*"))
    )
    assert (mine / "kept" / "ckpt-000002" / "mine.png").read_bytes() == b"png"
    # and a resumed run does it by itself
    (mine / ".tmp-ckpt-000006-123").mkdir()
    with pytest.warns(UserWarning, match=r"removed what a stopped run left .*\.tmp-ckpt-000006-123"):
        assert _resume(mine, 6) == 0
    assert not (mine / ".tmp-ckpt-000006-123").exists()


# ------------------------------------------------------------------------------------------------
# config files


def test_the_yaml_number_trap_is_explained(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 3e-3\n")
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert (
        "TrainConfig.lr: expected a finite number, got '3e-3' (a string: YAML 1.1 reads 3e-3 as text" in err
    )
    assert "0.003" in err


def test_a_key_written_twice_in_a_config_file_is_refused(tmp_path, capsys):
    """Hostile trial 12: `steps: 2` then `steps: 3` trained 3 steps without a word (PyYAML keeps
    the last); the same in JSON. Refused, naming the key (and in YAML its lines). A quoted number
    in a JSON file was explained as YAML 1.1's trap alone: the hint now says what to write in JSON."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 2\nlr: 0.001\nsteps: 3\n")
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "the key 'steps' is written twice (lines 1 and 3); keep one" in err, err
    js = tmp_path / "c.json"
    js.write_text('{"steps": 2, "steps": 3}')
    assert main(["train", "--config", str(js), "--out", str(tmp_path / "r")]) == 2
    assert "the key(s) ['steps'] are written twice in one object" in capsys.readouterr().err
    js.write_text('{"lr": "3e-3"}')
    assert main(["train", "--config", str(js), "--out", str(tmp_path / "r")]) == 2
    assert "or as 0.003; in a JSON file, without quotes)" in capsys.readouterr().err
    js.write_text('{"lr": "NaN"}')  # (trial 13: the hint suggested writing it "as nan")
    assert main(["train", "--config", str(js), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.lr: expected a finite number, got 'NaN'" in err and "write it" not in err, err
    flow = tmp_path / "f.yaml"  # two on one line
    flow.write_text("model_overrides: {d_model: 16, d_model: 32}\n")
    assert main(["train", "--config", str(flow), "--out", str(tmp_path / "r")]) == 2
    assert "the key 'd_model' is written twice (lines 1 and 1); keep one" in capsys.readouterr().err
    nested = tmp_path / "n.yaml"  # the same key in two different mappings is fine
    nested.write_text("model_overrides: {d_model: 16}\nsteps: 1\nd_model_note: {d_model: 8}\n")
    from mnemo.train.config import load_config_file

    assert load_config_file(nested)["model_overrides"] == {"d_model": 16}
    assert not (tmp_path / "r").exists()


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_FIELDS = [
    "lr",
    "steps",
    "seq_len",
    "batch_size",
    "warmup_steps",
    "grad_clip",
    "seed",
    "model",
    "data",
    "tokenizer",
    "precision",
    "optimizer",
    "device",
    "eval_lengths",
    "task",
    "task_options",
    "model_overrides",
    "beta1",
    "early_stop_acc",
    "fsdp",
    "sample_tokens",
    "nosuch_field",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(_FIELDS), _scalars, min_size=1, max_size=4))
def test_any_config_mapping_is_accepted_or_refused_with_a_named_field(mapping):
    """Whatever a YAML file holds: ``TrainConfig.from_dict`` either builds a config or raises
    ``ValueError`` naming a TrainConfig field (never another exception)."""
    from mnemo.train import TrainConfig

    try:
        TrainConfig.from_dict(dict(mapping))
    except ValueError as e:
        assert str(e).startswith(("TrainConfig.", "unknown TrainConfig field")) or "TrainConfig." in str(e), e


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_any_config_file_text_is_read_or_refused_naming_the_file(text):
    """Arbitrary file contents: a mapping, or a one-line ``ValueError`` naming the file."""
    import tempfile

    from mnemo.train import load_config_file

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(text)
        try:
            out = load_config_file(p)
        except ValueError as e:
            assert str(p) in str(e) and "\n" not in str(e)  # one line on the terminal
        else:
            assert isinstance(out, dict)


# ------------------------------------------------------------------------------------------------
# the third trial's findings: no false success, and messages that say what is true


def test_bench_suites_select_their_rows_or_say_there_is_nothing(capsys):
    """``bench --suite decode`` reads --models (it used to time its defaults whatever was given);
    the models suite with neither training shapes nor generation batches has nothing to time."""
    assert main(["bench", "--suite", "decode", "--models", "nosuch", "--contexts", "8"]) == 2
    assert "--models: unknown model(s) ['nosuch']; registered:" in capsys.readouterr().err
    argv = ["bench", "--suite", "models", "--models", "gla", "--peers", "none"]
    assert main([*argv, "--model-shapes", "none", "--gen-batches", "none"]) == 2
    assert "nothing to time" in capsys.readouterr().err


def test_a_bench_row_that_fails_fails_the_command(capsys, monkeypatch):
    import subprocess

    import mnemo.bench.decode as decode

    def fails(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback ...\nMemoryError: boom\n")

    monkeypatch.setattr(decode.subprocess, "run", fails)
    argv = ["bench", "--suite", "decode", "--models", "gla", "--contexts", "8", "--decode-processes", "1"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "failed: MemoryError: boom" in captured.out and "1 row(s) failed: gla L=8" in captured.err


def test_plot_training_of_an_empty_log_fails(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / "metrics.jsonl").write_text("")
    assert main(["probe", "plot-training", str(mine)]) == 2
    assert "metrics.jsonl has no rows yet: nothing to plot" in capsys.readouterr().err
    assert not (mine / "training.png").exists()


def test_a_task_checkpoint_refuses_text_options(task_run, capsys):
    """``eval --data`` used to be ignored on a task checkpoint, and ``generate`` said its
    tokenizer was "missing"."""
    for extra in (["--data", "tinyshakespeare"], ["--full"], ["--precision", "bf16"]):
        assert main(["eval", "--checkpoint", str(task_run), *extra]) == 2
        err = capsys.readouterr().err
        assert f"{extra[0]}: text checkpoints only;" in err and "trained on the task 'mqar'" in err
    assert main(["generate", "--checkpoint", str(task_run)]) == 2
    err = capsys.readouterr().err
    assert "trained on the task 'mqar', whose tokens are ids, not text" in err and "missing" not in err


def test_resume_and_overwrite_together_are_refused(run, capsys):
    before = _tree(run)
    assert main(["train", "--out", str(run), "--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite: give one of them" in capsys.readouterr().err
    assert _tree(run) == before


def test_a_training_checkpoint_without_its_manifest_is_named(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    ckpt = mine / (mine / "latest").read_text().strip()
    (ckpt / "manifest.json").unlink()
    assert main(["eval", "--checkpoint", str(mine)]) == 0
    assert f"{ckpt} has no manifest.json: its files could not be checked" in capsys.readouterr().err


def test_a_warm_up_longer_than_the_schedule_is_said_and_a_held_schedule_holds(tmp_path, capsys):
    from mnemo.train.optim import lr_factor

    # warm-up 50 over a 4-step schedule: still warming at the end; held past it: min_lr_ratio
    assert lr_factor(3, 50, 4, 0.1) == pytest.approx(4 / 50)
    assert [lr_factor(s, 50, 4, 0.1) for s in (4, 5, 40)] == [0.1, 0.1, 0.1]
    assert lr_factor(10, 5, 20, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 15)))
    argv = ["train", *TINY, "--steps", "2", "--eval-interval", "2", "--out", str(tmp_path / "w")]
    with pytest.warns(UserWarning, match=r"warmup_steps 50 >= the 2-step learning-rate schedule"):
        assert main(argv) == 0


def test_config_values_out_of_range_are_refused_as_the_flags_are(tmp_path, capsys):
    for text, msg in (
        ("seed: -3\n", "TrainConfig.seed: expected an int in 0 … 2**63 − 1"),
        (
            "steps: 1e3\n",
            "got '1e3' (a string: YAML 1.1 reads 1e3 as text, not a number; write the int as 1000; in a JSON "
            "file, without quotes)",
        ),
        ("sample_tokens: 1000000000\n", "TrainConfig.sample_tokens: expected an int in 0 … 100,000"),
    ):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "never")]) == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_sweep_file_messages_say_what_is_wrong(tmp_path, capsys):
    for text, msg in (
        ("", "the sweep file is empty (it needs at least 'name' and 'models')"),
        ("- 1\n", "must hold a mapping of sweep keys (name, models, grid, ...), got a list"),
        (
            "name: s\nmodels: [gla]\nseeds: [0, 1]\nselect_lr_on_seed: 5\ngrid: {lr: [0.001]}\n",
            "'select_lr_on_seed' must be one of the sweep's seeds [0, 1], got 5",
        ),
        (
            "name: s\nmodels: [gla]\nselect_lr_on_seed: 5\ngrid: {lr: [0.001]}\n",
            "'select_lr_on_seed' 5 needs a 'seeds' list (or count) that holds it",
        ),
        (
            "name: s\nmodels: [gla]\nseeds: 2\nselect_lr_on_seed: 0\nselection: some\ngrid: {lr: [0.001]}\n",
            "'selection' must be 'staged' or 'all', got 'some'",
        ),
        (
            "name: s\nmodels: [gla]\nseeds: 2\nselection: all\ngrid: {lr: [0.001]}\n",
            "'selection: all' needs 'select_lr_on_seed'",
        ),
        (  # (fourth trial) a typo in tune: nothing tuned, every run reported
            "name: s\nmodels: [gla]\nbase: {steps: 2}\ngrid: {lr: [0.001]}\ntune: [nope]\n",
            "'tune' names ['nope'], which are not grid keys (grid: ['lr'])",
        ),
        (  # (fourth trial) accuracy of a text run: an empty report
            "name: s\nmodels: [gla]\nbase: {steps: 2}\ngrid: {lr: [0.001]}\n",
            "metric 'val_acc' is measured on a task's supervised positions, and this run trains on text",
        ),
    ):
        f = tmp_path / "s.yaml"
        f.write_text(text)
        assert main(["sweep", str(f), "--list", "--db", str(tmp_path / "s.sqlite")]) == 2
        err = capsys.readouterr().err
        assert msg in err and "TrainConfig fields" not in err


def test_warnings_read_as_one_line_like_the_errors(run, tmp_path, capsys):
    """Python's format (path:line: UserWarning: ... and the source line) printed the message
    twice; under ``mnemo`` a warning is one line naming the command."""
    import shutil
    import sys
    import warnings

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    ckpt = mine / (mine / "latest").read_text().strip()
    (ckpt / "manifest.json").unlink()

    def show(message, category, filename, lineno, file=None, line=None):  # Python's default route
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        assert main(["train", "--out", str(mine), "--resume", "--no-progress"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert lines and all(x.startswith("mnemo train: warning: ") for x in lines), lines
    assert not any(".py:" in x for x in lines)


def test_the_divergence_advice_fits_the_precision():
    from mnemo.train.trainer import TrainingDiverged

    assert "--precision fp32" not in str(TrainingDiverged(3, "loss", math.nan, None))
    assert "--precision fp32" in str(TrainingDiverged(3, "loss", math.nan, None, precision="bf16"))


def test_values_are_refused_by_their_kind_in_any_spelling(tmp_path, capsys):
    """``--lr -inf`` (a space, no ``=``) used to be "expected one argument"; the tokenizer's range
    said 2 where 258 is the least it takes; huge counts that would run for days are bounded."""
    for argv, msg in (
        (["train", "--lr", "-inf"], "argument --lr: expected a finite number > 0, got '-inf'"),
        (["train", "--lr", "-1e9"], "argument --lr: expected a finite number > 0, got '-1e9'"),
        (
            [
                "tokenizer",
                "train",
                "--data",
                "tinyshakespeare",
                "--vocab-size",
                "100",
                "--out",
                str(tmp_path),
            ],
            "argument --vocab-size: expected an int in [258, 16777216], got '100'",
        ),
        (["generate", "--checkpoint", ".", "--max-new-tokens", "1e12"], "argument --max-new-tokens"),
        (["generate", "--checkpoint", ".", "--max-new-tokens", "10000000"], "in [0, 1000000]"),
        (["bench", "--repeats", "100000"], "argument --repeats: expected an int in [1, 1000]"),
        (["harness", "--checkpoint", ".", "--tasks", "x", "--limit", "1e20"], "argument --limit"),
        (["harness", "--checkpoint", ".", "--tasks", "x", "--num-fewshot", "5000"], "in [0, 1000]"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (argv, err)


def test_generation_that_cannot_fit_is_refused_before_decoding(run, capsys, monkeypatch):
    import mnemo.train.memory_estimate as me

    monkeypatch.setattr(me, "available_memory", lambda device: (10 * 2**20, "a test's 10 MiB"))
    assert main(["generate", "--checkpoint", str(run), "--max-new-tokens", "1000000"]) == 2
    err = capsys.readouterr().err
    assert (
        "--max-new-tokens: 1,000,00" in err and "a test's 10 MiB" in err and "lower --max-new-tokens" in err
    )


def test_probe_reads_a_jsonl_field_it_is_told(run, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"body": "to be or not to be, that is the question"}\n' * 20)
    argv = ["probe", "spectrum", "--checkpoint", str(run), "--tokens", "16", "--data", str(data)]
    argv += ["--out", str(tmp_path / "p")]
    assert main(argv) == 2
    assert "choose one with --text-field" in capsys.readouterr().err
    assert main([*argv, "--text-field", "body"]) == 0
    # an irrelevant half-life at least the context would give negative shares: refused up front
    assert main([*argv[:6], "--irrelevant-half-life", "1e20"]) == 2
    assert "--irrelevant-half-life (1e+20 tokens) must be shorter than the context, --tokens 16" in (
        capsys.readouterr().err
    )


def test_unknown_mixer_options_are_named_not_a_traceback(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_overrides: {mixer_options: {attention: {bogus: 3}}}\n")
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert (
        "ModelConfig.mixer_options['attention']: expected options of the 'attention' mixer (n_heads," in err
    )
    assert "got 'bogus'" in err and err.count("\n") == 1 and not (tmp_path / "never").exists()


def test_counts_that_would_never_finish_are_refused(tmp_path, capsys):
    """A typo's 10^20 steps or evaluation batches, or 10,000 layers, used to run silently until
    killed."""
    for argv, msg in (
        (["train", "--steps", HUGE], "argument --steps: expected an int in [1, 1000000000]"),
        (["train", "--eval-batches", HUGE], "argument --eval-batches: expected an int in [1, 100000]"),
        (["train", "--n-layers", "10000"], "argument --n-layers: expected an int in [1, 1024]"),
    ):
        assert main(argv) == 2
        assert msg in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 100000000000\n")
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "never")]) == 2
    assert "TrainConfig.steps: expected a positive int <= 1,000,000,000" in capsys.readouterr().err


def test_resume_refuses_a_log_line_it_did_not_write_and_keeps_the_log(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    log = mine / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": "x", "val_loss": "nan"}\n')
    before = _tree(mine)
    assert _resume(mine, 6) == 2
    err = capsys.readouterr().err
    assert (
        "metrics.jsonl, line 3: expected a JSON object with an int 'step'" in err and "Traceback" not in err
    )
    assert _tree(mine) == before
    log.write_text(log.read_text().replace('{"step": "x", "val_loss": "nan"}\n', '{"step": 4, "torn'))
    with pytest.warns(UserWarning, match="its last line is not JSON"):
        assert _resume(mine, 6) == 0  # a torn last line (a crash mid-write) leaves the log, said and kept
    assert (mine / "kept" / "metrics.jsonl.torn").read_text() == '{"step": 4, "torn\n'


# ------------------------------------------------------------------------------------------------
# the fourth trial's findings (713 commands)


def test_overwrite_keeps_what_a_checkpoint_does_not_list(run, tmp_path, capsys):
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    ckpt = mine / (mine / "latest").read_text().strip()
    (ckpt / "my_analysis.txt").write_text("mine")
    (mine / "ckpt-mine").mkdir()
    (mine / "ckpt-mine" / "notes.txt").write_text("mine too")
    argv = ["train", *TINY, "--steps", "2", "--eval-interval", "2", "--out", str(mine), "--overwrite"]
    with pytest.warns(UserWarning, match="were kept in"):
        assert main(argv) == 0
    assert (mine / "kept" / ckpt.name / "my_analysis.txt").read_text() == "mine"
    assert (mine / "ckpt-mine" / "notes.txt").read_text() == "mine too"


def test_a_sweep_that_names_its_metric_runs(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: s\nmodels: [gla]\nbase: {steps: 2}\ngrid: {lr: [0.001]}\nmetric: val_loss\n")
    assert main(["sweep", str(f), "--list", "--db", str(tmp_path / "s.sqlite")]) == 0


def test_text_options_on_a_task_run_are_refused(task_run, tmp_path, capsys):
    for extra in (
        ["--data", "tinyshakespeare"],
        ["--tokenizer", "byte"],
        ["--text-field", "body"],
        ["--carry-state"],
    ):
        assert main(["train", *TASK, "--steps", "2", *extra, "--out", str(tmp_path / "never")]) == 2
        assert f"{extra[0]}: text options; a --task run draws its sequences from the task" in (
            capsys.readouterr().err
        )
    before = _tree(task_run)
    assert main(["train", "--out", str(task_run), "--resume", "--data", "tinyshakespeare"]) == 2
    assert "--data: text options" in capsys.readouterr().err
    assert _tree(task_run) == before and not (tmp_path / "never").exists()


def test_the_harness_and_the_ablation_say_what_a_checkpoint_is(task_run, capsys):
    from mnemo.interp.interventions import induction_ablation
    from mnemo.models import LanguageModel, build_config

    assert main(["harness", "--checkpoint", str(task_run), "--tasks", "x"]) == 2
    err = capsys.readouterr().err
    assert "trained on the task 'mqar', whose tokens are ids, not text" in err or "needs lm-eval" in err
    model = LanguageModel(build_config("mamba2", vocab_size=16, d_model=16, n_layers=1))
    with pytest.raises(ValueError, match=r"has 1 head\(s\) with an attention map .*needs at least 2"):
        induction_ablation(model, 1, draws=1, length=4, batch=1)


def test_the_yaml_hint_only_says_what_is_true(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text('steps: "4"\n')
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "got '4' (a string: write the number without quotes)" in err and "YAML 1.1" not in err


def test_mixer_options_of_any_shape_are_refused_in_one_line(tmp_path, capsys):
    """(fifth trial) a string, a number or a list where the options go, an unknown option of a
    mixer given as a partial (gla), and a value its constructor cannot take (n_heads 0). (A small
    text: the default corpus's encoding, read before the model is built, took most of the time.)"""
    data = tmp_path / "t.txt"
    data.write_text("a small text to train on. " * 100)
    for text, msg in (
        ('model: gla\nmodel_overrides: {mixer_options: "x"}\n', "expected a mapping {mixer name: {option:"),
        ("model: gla\nmodel_overrides: {mixer_options: 5}\n", "expected a mapping {mixer name: {option:"),
        ("model: gla\nmodel_overrides: {mixer_options: {gla: [1, 2]}}\n", "got {'gla': [1, 2]}"),
        ("model: gla\nmodel_overrides: {mixer_options: {gla: {bogus_opt: 3}}}\n", "got 'bogus_opt'"),
        (
            "model: transformer\nmodel_overrides: {mixer_options: {attention: {n_heads: 0}}}\n",
            "ModelConfig.mixer_options['attention'] = {'n_heads': 0}: n_heads: expected an int >= 1, got 0",
        ),
        # (sixth list) a value of the wrong kind is named by its option and its default, once
        (
            "model: gla\nmodel_overrides: {mixer_options: {gla: {expand_k: abc}}}\n",
            "mixer_options['gla']['expand_k']: expected a number (the default is 0.5), got 'abc'",
        ),
        (
            "model: transformer\nmodel_overrides: {mixer_options: {attention: {rope: 1}}}\n",
            "mixer_options['attention']['rope']: expected true or false (the default is True), got 1",
        ),
    ):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        argv = ["train", "--config", str(cfg), *TINY, "--data", str(data), "--out", str(tmp_path / "never")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "never").exists()


def test_sixth_list_findings(run, tmp_path, capsys):
    """Options that nothing reads are refused, not ignored; a damaged latest checkpoint is said once."""
    out = tmp_path / "never"
    for argv, said in (
        (["train", *TINY, "--circuit-length", "8"], "circuit_length (8) is read only by the circuit tracker"),
        (["eval", "--checkpoint", str(run), "--text-field", "body"], "'tinyshakespeare' is plain text"),
        (["eval", "--checkpoint", str(run), "--data", "/dev/null"], "neither a regular file nor a folder"),
        (
            ["bench", "--suite", "decode", "--lengths", "64"],
            "--lengths is read by --suite ops, not by --suite decode",
        ),
        (["bench", "--json", str(tmp_path / "notes.txt")], "ending in .json"),
    ):
        assert main([*argv, *(["--out", str(out)] if argv[0] == "train" else [])]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert not out.exists()
    sweep = tmp_path / "s.db"
    sweep.write_bytes(b"SQLite format 3\x00\xdf\xff")
    assert main(["sweep", str(sweep)]) == 2
    assert "is not UTF-8 text (a YAML or JSON file of sweep keys" in capsys.readouterr().err
    # a copy of the run whose latest checkpoint is cut short: one warning, then the resume goes on
    shutil.copytree(run, tmp_path / "r")
    latest = tmp_path / "r" / (tmp_path / "r" / "latest").read_text().strip() / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:100])
    assert _resume(tmp_path / "r", 6) == 0
    said = capsys.readouterr()
    assert (said.out + said.err).count("damaged checkpoint skipped") == 1


def test_sixth_trial_findings(run, tmp_path, capsys):
    """(sixth trial) config fields of the wrong kind are named, not tracebacks; outputs that exist are
    not replaced without --overwrite; a run that lost its `latest` is neither started over nor lost."""
    data = tmp_path / "t.txt"  # (a small text: the default corpus's encoding comes before the model)
    data.write_text("a small text to train on. " * 100)
    for overrides, said in (
        ("{vocab_size: 5}", "vocab_size is not a model override"),
        ("{init_std: .nan}", "ModelConfig.init_std: expected a finite number > 0, got nan"),
        ("{layers: 3}", "ModelConfig.layers: expected a list of mixer names or None, got 3"),
        ("{tie_embeddings: 'no'}", "ModelConfig.tie_embeddings: expected true or false, got 'no'"),
        ("{norm_eps: -1}", "ModelConfig.norm_eps: expected a finite number > 0, got -1"),
    ):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"model_overrides: {overrides}\n")
        argv = ["train", "--config", str(cfg), *TINY, "--data", str(data), "--out", str(tmp_path / "never")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "data"}')
    for argv in (
        ["verify", "--quick", "--ops", "linear_identity", "--json", str(mine)],
        ["bench", "--ops", "gla_scalar", "--lengths", "16", "--repeats", "1", "--json", str(mine)],
    ):
        assert main(argv) == 2
        assert "exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert mine.read_text() == '{"my": "data"}'
    lost = tmp_path / "lost"
    shutil.copytree(run, lost)
    (lost / "latest").unlink()
    before = _tree(lost)
    assert main(["train", *TINY, "--steps", "2", "--out", str(lost)]) == 2
    assert "holds a run without its `latest` pointer" in capsys.readouterr().err
    assert _tree(lost) == before
    assert _resume(lost, 6) == 0  # from the newest intact checkpoint
    assert (lost / "latest").read_text().strip() == "ckpt-000006"


def test_seventh_list_findings(run, task_run, tmp_path, capsys):
    """(the list left by the sixth trial) values that were taken silently are refused in one line,
    and nothing of a run is replaced or mixed: save_pretrained into a run, a tokenizer into a run,
    --overwrite's old probes, duplicate or contradicting options."""
    from mnemo.models import LanguageModel, build_config

    model = LanguageModel(build_config("gla", vocab_size=16, d_model=16, n_layers=1))
    ckpt = run / (run / "latest").read_text().strip()
    before = _tree(run)
    for target in (run, ckpt):
        with pytest.raises(ValueError, match="belongs to a training run"):
            model.save_pretrained(target)
    assert _tree(run) == before
    for argv, said in (
        (["train", *TASK, "--task-option", "num_pairs=3"], "--task-option num_pairs given twice"),
        (["train", *TASK, "--eval-lengths", "32,32"], "TrainConfig.eval_lengths: expected distinct lengths"),
        (["train", *TASK, "--sample-tokens", "20"], "--sample-tokens: text options"),
        (
            ["tokenizer", "train", "--data", "tinyshakespeare", "--vocab-size", "300", "--out", str(run)],
            "is a training run's folder",
        ),
        (["train", "--d-model", "200000", "--out", str(tmp_path / "huge")], "choose a smaller model"),
        (
            ["harness", "--checkpoint", str(run), "--tasks", "x", "--limit", "1.5"],
            "--limit: expected a fraction",
        ),
    ):
        assert main([*argv, "--no-progress"] if argv[0] == "train" else argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert _tree(run) == before
    # --init-from a run of another width: the differing field, not a screen of tensor shapes
    argv = ["train", *TINY, "--d-model", "32", "--steps", "1", "--init-from", str(run)]
    assert main([*argv, "--out", str(tmp_path / "wider")]) == 2
    err = capsys.readouterr().err
    assert (
        "do not fit model 'transformer'" in err
        and "d_model 16 there, 32 here" in err
        and err.count("\n") == 1
    )
    # --overwrite: the old run's probes and TensorBoard events move aside, they are not deleted or mixed
    again = tmp_path / "again"
    shutil.copytree(run, again)
    (again / "probes").mkdir()
    (again / "probes" / "circuits.json").write_text("{}")
    assert main(["train", *TINY, "--steps", "2", "--out", str(again), "--overwrite"]) == 0
    assert "the old run's probes/ moved to" in capsys.readouterr().err
    assert not (again / "probes").exists()
    assert (again / "kept" / "overwritten-1" / "probes" / "circuits.json").read_text() == "{}"
    # a JSON Lines corpus: the bad line is named with its file and number
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.jsonl").write_text('{"text": "fine"}\n')
    (docs / "b.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    (docs / "c.jsonl").write_text('{"text": "fine"}\n\nnot json\n')
    for name, said in (
        ("b.jsonl", "b.jsonl line 2: not valid UTF-8"),
        ("c.jsonl", "c.jsonl line 3: not JSON"),
    ):
        assert main(["train", *TINY, "--data", str(docs / name), "--out", str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    # the report's threshold is checked against the metric's range
    db = tmp_path / "s.db"
    from mnemo.sweep.db import SweepDB

    SweepDB(db).close()
    assert main(["report", str(db), "--threshold", "2"]) == 2
    assert "val_acc is an accuracy in [0, 1]" in capsys.readouterr().err


def test_bench_tables_say_slower_and_leave_missing_cells_blank():
    from mnemo.bench.ops import _cell, _times

    assert _times(3.0) == "3.0x faster" and _times(0.25) == "4.0x slower"
    assert _cell(float("nan"), 6) == "     -" and _cell(12.345, 6) == "  12.3"


def test_a_converted_config_that_contradicts_itself_is_refused(tmp_path):
    from mnemo.hf.convert import _check_fields, find_architecture

    with pytest.raises(
        ValueError, match="architectures names MambaForCausalLM .* but model_type is 'mamba2'"
    ):
        find_architecture({"architectures": ["MambaForCausalLM"], "model_type": "mamba2"})
    for field, value, said in (
        ("tie_word_embeddings", "yes", "expected true or false, got 'yes'"),
        ("rms_norm", False, "false (LayerNorm) is not supported"),
        ("time_step_floor", -1, "expected a number >= 0, got -1"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            _check_fields(tmp_path / "config.json", {field: value})
    _check_fields(
        tmp_path / "config.json", {"tie_word_embeddings": True, "rms_norm": True, "time_step_floor": 1e-4}
    )


def test_a_metrics_log_that_is_not_utf8_is_named_by_line(run, tmp_path, capsys):
    """A line of metrics.jsonl that is not UTF-8 is named with its file and line number (not a
    codec's byte offset); a torn last line (a crash inside a multi-byte character) is set aside on
    resume like any torn line."""
    import json

    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    good = (bad / "metrics.jsonl").read_bytes()
    (bad / "metrics.jsonl").write_bytes(b'{"step": 1, "note": "\xff"}\n' + good)
    assert main(["probe", "plot-training", str(bad), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl, line 1: not valid UTF-8" in err and err.count("\n") == 1, err
    (bad / "metrics.jsonl").write_bytes(good + '{"step": 5, "x": "é'.encode()[:-1])
    with pytest.warns(UserWarning, match="its last line is not JSON"):
        assert _resume(bad, 6) == 0
    assert (bad / "kept" / "metrics.jsonl.torn").read_text().startswith('{"step": 5, "x": "')
    steps = [json.loads(x)["step"] for x in (bad / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]


def test_seventh_trial_findings(run, tmp_path, capsys, monkeypatch):
    """(seventh trial, 252 commands) outputs that exist are replaced only with --overwrite,
    whether --out was given or defaulted; --overwrite keeps files that only look like
    checkpoints; a forced backend that cannot serve is one line; messages name the flag given."""
    from mnemo.models import LanguageModel

    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "circuits.png").write_text("mine")
    argv = [
        "probe",
        "circuits",
        "--checkpoint",
        str(run),
        "--length",
        "4",
        "--batch",
        "1",
        "--out",
        str(figs),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "circuits.png exists; pass --overwrite" in err and err.count("\n") == 1
    assert (figs / "circuits.png").read_text() == "mine"
    assert main([*argv, "--overwrite"]) == 0 and (figs / "circuits.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    plotted = tmp_path / "plotted"
    shutil.copytree(run, plotted)
    (plotted / "training.png").write_text("mine")
    assert main(["probe", "plot-training", str(plotted)]) == 2
    err = capsys.readouterr().err
    assert "the default output: " in err and "training.png exists; pass --overwrite" in err, err
    assert (plotted / "training.png").read_text() == "mine"
    # --overwrite discards checkpoint folders only: a file named ckpt-… stays
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    (mixed / "ckpt-000099.txt").write_text("notes")
    (mixed / "ckpt-notes").write_text("more notes")
    assert main(["train", *TINY, "--steps", "2", "--out", str(mixed), "--overwrite"]) == 0
    assert (mixed / "ckpt-000099.txt").read_text() == "notes" and (mixed / "ckpt-notes").is_file()
    capsys.readouterr()
    # a forced backend that cannot serve the call: one line, exit 2
    monkeypatch.setenv("MNEMO_BACKEND", "fla")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gla = tmp_path / "gla"
    assert main(["train", *TINY, "--model", "gla", "--steps", "1", "--out", str(gla)]) == 2
    err = capsys.readouterr().err
    assert "backend 'fla' cannot serve this call" in err and err.count("\n") == 1 and "Traceback" not in err
    monkeypatch.delenv("MNEMO_BACKEND")
    # the flag the user gave is the one named
    assert main(["eval", "--checkpoint", str(run), "--length", "100000000"]) == 2
    err = capsys.readouterr().err
    assert "a longer file or a smaller --length)" in err and "--seq-len" not in err, err
    assert main(["train", *TINY, "--steps", "1", "--out", "/proc/mnemo_never"]) == 2
    assert "--out: /proc/mnemo_never cannot be created" in capsys.readouterr().err
    with pytest.raises(NotADirectoryError, match="is a file; expected a checkpoint folder"):
        LanguageModel.from_pretrained(run / "metrics.jsonl")
    lists = tmp_path / "lists.jsonl"
    lists.write_text("[1, 2, 3]\n")
    assert main(["train", *TINY, "--data", str(lists), "--out", str(tmp_path / "never")]) == 2
    assert "lists.jsonl line 1: a JSON list, expected one object per line" in capsys.readouterr().err


def test_a_changed_sweep_is_not_pooled_as_seeds():
    """Two runs at the same cell, learning rate and seed are two configurations (the sweep file
    changed under the same name), not two seeds: the report keeps the newest and counts the rest."""
    from mnemo.sweep.report import cell_stats, newest_runs

    def row(run_id, steps, acc):
        return {
            "run_id": run_id,
            "label": "gla",
            "model": "gla",
            "cell": {"label": "gla"},
            "tuned": {"lr": 0.01},
            "seed": 0,
            "config": {"steps": steps, "seq_len": 16},
            "status": "done",
            "metrics": {"val_acc": acc, "val_loss": 1.0},
            "state_size_bytes": 1,
            "n_params": 1,
            "wall_time_s": 1.0,
        }

    rows = [row("a", 2, 0.1), row("b", 3, 0.3)]
    kept, superseded = newest_runs(rows)
    assert [r["run_id"] for r in kept] == ["b"] and superseded == {'{"label": "gla"}': 1}
    (c,) = cell_stats(rows)
    assert c["n"] == 1 and c["values"] == [0.3] and c["n_superseded"] == 1


def _python(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter that imports this checkout of mnemo."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )


def test_an_interrupt_while_the_command_module_imports_is_one_line():
    """(left by the seventh trial) Ctrl-C while the console script imports ``mnemo.cli`` printed
    Python's traceback: that import ran mnemo.argtypes and the train command before ``main`` and
    its handler. Now ``import mnemo.cli`` imports nothing but itself (and ``mnemo``); every other
    import is made inside ``main``, so an interrupt there is one line and exit status 130. (What
    no package can reach: the interpreter's own start-up and the console script's ``import re``.)"""
    loaded = _python(
        """
        import sys
        before = set(sys.modules)
        import mnemo.cli
        print(sorted(set(sys.modules) - before))
        """
    )
    assert loaded.returncode == 0 and loaded.stdout.strip() == "['mnemo', 'mnemo.cli']", loaded
    # an interrupt while the libraries load, as the console script runs it (its import, then main)
    interrupted = _python(
        """
        import sys

        class Interrupt:  # Ctrl-C while these modules load
            def find_spec(self, name, path=None, target=None):
                if name in ("argparse", "mnemo.argtypes", "mnemo.commands.train", "torch"):
                    raise KeyboardInterrupt

        sys.meta_path.insert(0, Interrupt())
        from mnemo.cli import main
        sys.exit(main(["models"]))
        """
    )
    assert interrupted.returncode == 130, interrupted
    assert interrupted.stderr.strip() == "mnemo: interrupted before any work began; nothing was written"
    assert "Traceback" not in interrupted.stderr
    from mnemo.cli import add_config_flags, config_flag_fields  # still re-exported

    assert callable(add_config_flags) and "lr" in [f.name for f in config_flag_fields()]


def test_a_failed_run_leaves_no_lock_and_no_folder_it_made(tmp_path, capsys):
    """(left by the seventh trial) a run that failed after taking its folder left ``.lock`` there:
    a folder holding only that file, which other commands then took for a run (``tokenizer train
    --out`` and ``save_pretrained`` refuse a run's folder). Releasing the lock removes the file; a
    folder the run made and never wrote to is removed too; one that existed stays, empty."""
    from mnemo.train.run_folder import lock_run_folder

    data = tmp_path / "t.txt"  # (a small text: the default corpus's encoding took most of the time)
    data.write_text("a small text to train on. " * 100)
    tiny = [*TINY, "--data", str(data)]
    diverge = ["train", *tiny, "--steps", "2", "--lr", "1e30", "--warmup-steps", "0"]
    made = tmp_path / "made"
    assert main([*diverge, "--out", str(made)]) == 1
    assert "no checkpoint was written yet" in capsys.readouterr().err
    assert not made.exists()
    given = tmp_path / "given"
    given.mkdir()
    (given / "notes.txt").write_text("mine")
    assert main([*diverge, "--out", str(given)]) == 1
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]
    capsys.readouterr()
    # a finished run and --overwrite leave no lock either; the folder is then free for the next run
    done = tmp_path / "done"
    assert main(["train", *tiny, "--steps", "2", "--out", str(done)]) == 0
    assert not (done / ".lock").exists()
    assert main(["train", *tiny, "--steps", "2", "--out", str(done), "--overwrite"]) == 0
    assert not (done / ".lock").exists() and (done / "latest").is_file()
    capsys.readouterr()
    # the lock is still one holder at a time, and a released lock file is not taken over by a
    # process that opened it before it went
    lock = lock_run_folder(done)
    stale = open(done / ".lock", "a+")
    refused = []

    def other_holder():  # another thread, like another process (the same thread takes it again)
        try:
            lock_run_folder(done)
        except ValueError as e:
            refused.append(str(e))

    worker = threading.Thread(target=other_holder)
    worker.start()
    worker.join()
    assert len(refused) == 1 and re.search(r"is in use by another training process \(pid \d+\)", refused[0])
    lock.close()
    assert not (done / ".lock").exists()
    again = lock_run_folder(done)
    assert not os.path.samestat(os.fstat(stale.fileno()), os.stat(done / ".lock"))
    stale.close()
    again.close()


def test_pack_documents_on_a_single_document_is_refused(run, tmp_path, capsys):
    """(left by the seventh trial: a warning) ``--pack-documents`` promises that no state crosses a
    document boundary; on a plain text file (one document) it would do nothing while the run
    records it as on. A researcher giving it most likely thinks the text holds documents (e.g.
    separated by blank lines), so the run would not be what they think: refused before the work,
    as every option that nothing reads is (``--text-field`` on plain text), naming the flag and
    how to give documents. A run saved with it earlier is resumed with the old warning."""
    text = tmp_path / "stories.txt"
    text.write_text("Once upon a time.\n\nAnother story here.\n\n" * 200)
    out = tmp_path / "packed"
    for data in (str(text), "tinyshakespeare"):
        argv = ["train", *TINY, "--steps", "2", "--data", data, "--pack-documents", "--out", str(out)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--pack-documents" in err and "is a single document" in err, err
        assert "drop --pack-documents, or give the documents as JSONL/Parquet records" in err
        assert not out.exists()
    # two files are two documents: packing means something there, and runs
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("first document " * 100)
    (docs / "b.txt").write_text("second document " * 100)
    argv = ["train", *TINY, "--steps", "2", "--data", str(docs), "--pack-documents", "--out", str(out)]
    assert main(argv) == 0


def _standard_sweep(**change) -> dict:
    """A sweep file (as a mapping) that meets the recipe standard, for ``SweepSpec.from_dict``."""
    d = {
        "name": "std",
        "metric": "val_acc",
        "recipe": "standard",
        "base": {"task": "mqar", "seq_len": 32, "steps": 2},
        "models": ["deltanet", "gated_deltanet"],
        "grid": {"lr": [1.0e-3, 3.0e-3, 1.0e-2]},
        "tune": ["lr"],
        "seeds": 4,
        "select_lr_on_seed": 0,
        "claims": [{"name": "gating helps", "better": "gated_deltanet", "than": "deltanet"}],
    }
    d.update(change)
    return d


def test_eighth_trial_sweep_files(tmp_path):
    """(eighth trial) a standard sweep's learning rates are checked where they are given: a model
    entry's own ``grid.lr`` escaped the standard (3x passed), and a NaN, negative or YAML 1.1
    string learning rate was counted out and blamed on the number of values; a per-model
    ``seed`` axis beside ``seeds`` said 'identical runs'; a repeated claim was judged twice."""
    from mnemo.sweep.spec import SweepSpec

    SweepSpec.from_dict(_standard_sweep(), "std.yaml").runs()  # the standard itself passes
    narrow = [{"label": "a", "model": "deltanet", "grid": {"lr": [1.0e-3, 2.0e-3, 3.0e-3]}}, "gated_deltanet"]
    claims = [{"better": "a", "than": "gated_deltanet"}]
    with pytest.raises(ValueError, match=r"'models\[a\].grid.lr' spans 3x \(0.001 … 0.003\); the standard"):
        SweepSpec.from_dict(_standard_sweep(models=narrow, claims=claims), "std.yaml")
    for bad, said in (
        (math.nan, "holds nan, which is not a positive finite learning rate"),
        (-1e-3, "holds -0.001, which is not a positive finite learning rate"),
        ("1e-3", "holds '1e-3', which is not a positive finite learning rate .a string: YAML 1.1 reads"),
    ):
        with pytest.raises(ValueError, match=said):
            SweepSpec.from_dict(_standard_sweep(grid={"lr": [bad, 1.0e-3, 1.0e-2]}), "std.yaml")
    seeded = [{"label": "a", "model": "deltanet", "grid": {"seed": [5, 6]}}, "gated_deltanet"]
    with pytest.raises(ValueError, match="model 'a': give the seeds either as 'seeds' or as a grid axis"):
        SweepSpec.from_dict(_standard_sweep(models=seeded, claims=claims), "std.yaml").runs()
    twice = _standard_sweep()["claims"] * 2
    with pytest.raises(ValueError, match=r"claims\[1\] repeats claims\[0\]"):
        SweepSpec.from_dict(_standard_sweep(claims=twice), "std.yaml")


def test_a_new_sweep_database_needs_a_database_suffix(tmp_path, capsys):
    """(trial 13) ``sweep --db swdir`` made an SQLite file named ``swdir`` (meant as a folder); a
    new database now needs a suffix, and nothing is made or trained before the refusal."""
    f = tmp_path / "s.yaml"
    f.write_text(
        "name: s\nmodels: [gla]\nmetric: val_loss\ngrid: {lr: [0.001]}\n"
        "base: {steps: 1, seq_len: 16, batch_size: 2, eval_batches: 1, sample_tokens: 0, "
        "warmup_steps: 0, model_overrides: {d_model: 16, n_layers: 1}}\n"
    )
    argv = ["sweep", str(f), "--out", str(tmp_path / "runs"), "--no-progress"]
    assert main([*argv, "--db", str(tmp_path / "swdir")]) == 2
    err = capsys.readouterr().err
    assert (
        "--db: a new sweep database is one SQLite file named with a suffix" in err and "swdir.sqlite" in err
    )
    assert not (tmp_path / "swdir").exists() and not (tmp_path / "runs").exists()
    f.write_text(f.read_text() + f"db: {tmp_path / 'fromfile'}\n")
    assert main(argv) == 2
    assert f"{f}: db: a new sweep database" in capsys.readouterr().err
    assert main([*argv, "--db", str(tmp_path / "swdir"), "--list"]) == 0  # listing creates nothing
    assert not (tmp_path / "swdir").exists()


def test_eighth_trial_report_uses_the_sweeps_metric(tmp_path, capsys):
    """(eighth trial) ``mnemo report`` of a ``metric: val_loss`` sweep reported ``val_acc`` (its
    flag's default): a table of 'done' without values, no paired seed, a claim 'not testable'.
    The report now uses the sweep file's metric, and a metric no run measured is refused before
    anything is written."""
    f = tmp_path / "loss.yaml"
    f.write_text(
        "name: loss\nmodels: [gla]\nmetric: val_loss\ngrid: {lr: [0.001]}\n"
        "base: {steps: 1, seq_len: 16, batch_size: 2, eval_batches: 1, sample_tokens: 0, "
        "warmup_steps: 0, model_overrides: {d_model: 16, n_layers: 1}}\n"
    )
    db, out = tmp_path / "loss.sqlite", tmp_path / "report"
    argv = ["sweep", str(f), "--db", str(db), "--out", str(tmp_path / "runs"), "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["report", str(db), "--out", str(out), "--no-plots", "--metric", "val_acc"]) == 2
    err = capsys.readouterr().err
    assert "metric 'val_acc' (--metric): no finished run of sweep 'loss'" in err and err.count("\n") == 1
    assert "they measured: val_bpc, val_loss" in err and not out.exists()
    assert main(["report", str(db), "--out", str(out), "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert "| gla |" in text and "`val_loss`" in text and "val_acc" not in text
    # a plot of an earlier report that this one (--no-plots) did not rewrite is said, not passed over
    (out / "loss_acc_vs_state.png").write_bytes(b"an earlier plot")
    assert main(["report", str(db), "--out", str(out), "--no-plots", "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert (
        "loss_acc_vs_state.png is left from an earlier report (this one did not write it: --no-plots)" in err
    )


def test_eighth_trial_commands(run, tmp_path, capsys, monkeypatch):
    """(eighth trial) ``--optimizer m3_paper`` took ``--warmup-steps`` (and a config's weight
    decay, clip, min lr) and ignored them; an unknown ``MNEMO_BACKEND`` was said only at the
    first op call (after the data and model loaded) and never by commands without ops;
    ``--pack-documents`` on a model whose CMS learns from the task loss failed at the first step
    naming ``cu_seqlens``, and ``eval --pack-documents on`` of one document measured nothing new;
    huge bench shapes were a traceback (the allocation); a model named twice was timed twice."""
    out = tmp_path / "m3"
    assert (
        main(
            [
                "train",
                *TINY,
                "--steps",
                "1",
                "--optimizer",
                "m3_paper",
                "--warmup-steps",
                "5",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "warmup_steps (--warmup-steps): not read with optimizer m3_paper" in err and not out.exists()
    cfg = tmp_path / "m3.yaml"
    cfg.write_text("optimizer: m3_paper\nweight_decay: 0.05\n")
    assert main(["train", *TINY, "--steps", "1", "--config", str(cfg), "--out", str(out)]) == 2
    assert "weight_decay: not read with optimizer m3_paper" in capsys.readouterr().err
    monkeypatch.setenv("MNEMO_BACKEND", "nosuch")
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert "MNEMO_BACKEND must be one of auto, torch, native, fla, mamba_ssm, got 'nosuch'" in err
    monkeypatch.delenv("MNEMO_BACKEND")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("first document " * 50)
    (docs / "b.txt").write_text("second document " * 50)
    hope = ["train", *TINY, "--steps", "1", "--model", "hope", "--data", str(docs), "--pack-documents"]
    assert main([*hope, "--out", str(tmp_path / "hope")]) == 2
    err = capsys.readouterr().err
    assert "pack_documents (--pack-documents): not with model 'hope'" in err and "cu_seqlens" not in err
    assert main(["eval", "--checkpoint", str(run), "--pack-documents", "on"]) == 2
    assert "--pack-documents on: data 'tinyshakespeare' is a single document" in capsys.readouterr().err
    for suite, extra in (("roofline", []), ("models", ["--peers", "none", "--gen-batches", "none"])):
        argv = ["bench", "--suite", suite, "--models", "gla", "--d-model", "16", "--n-layers", "1"]
        assert main([*argv, "--model-shapes", "100000000x1000", "--repeats", "1", *extra]) == 2
        err = capsys.readouterr().err
        assert (
            "--model-shapes: 100000000x1000 (tokens x rows) needs at least" in err and "Traceback" not in err
        )
    assert main(["bench", "--suite", "roofline", "--models", "gla,gla", "--model-shapes", "32x1"]) == 2
    assert "--models: 'gla' given twice; give each name once" in capsys.readouterr().err


def test_eighth_trial_library_values():
    """(eighth trial) ``forward(ids, targets=...)`` with a target outside the vocabulary raised
    torch's 'index 25 is out of bounds' (an IndexError for HOPE), a float ``ignore_index`` was
    truncated silently; ``mlp_options={"order": ...}`` on a HOPE preset dropped its CMS levels
    (the default chain replaced the preset's three task-objective levels without a word);
    ``ops.backends("nosuch")`` was torch's device-string error."""
    import torch

    from mnemo import ops
    from mnemo.models import LanguageModel, build_config

    model = LanguageModel(build_config("gla", vocab_size=20, d_model=16, n_layers=1))
    ids = torch.randint(0, 20, (2, 8))
    for bad in (25, -5):
        with pytest.raises(
            ValueError, match=rf"targets must be class ids in \[0, vocab_size = 20\) .* \(e.g. {bad}\)"
        ):
            model(ids, targets=torch.full_like(ids, bad))
    loss, _ = model(ids, targets=torch.full_like(ids, -100))  # every target ignored: 0, legal
    assert float(loss.detach()) == 0.0
    with pytest.raises(TypeError, match="ignore_index must be an int .* got float 1.5"):
        model(ids, targets=ids, ignore_index=1.5)
    with pytest.raises(TypeError, match="targets must be a torch.Tensor of class ids, got list"):
        model(ids, targets=ids.tolist())
    hope = LanguageModel(build_config("hope", vocab_size=20, d_model=16, n_layers=1))
    with pytest.raises(ValueError, match="targets must be class ids"):
        hope(ids, targets=torch.full_like(ids, 30))
    preset = build_config("hope", vocab_size=20, d_model=16, n_layers=1)
    ordered = build_config(
        "hope", vocab_size=20, d_model=16, n_layers=1, mlp_options={"order": "slowest_first"}
    )
    assert ordered.mlp_options == {**preset.mlp_options, "order": "slowest_first"}
    assert build_config("hope", vocab_size=20, d_model=16, n_layers=1, mlp="swiglu").mlp_options == {}
    with pytest.raises(
        ValueError, match="device must be a torch.device or a name such as 'cpu'.*got 'nosuch'"
    ):
        ops.backends("nosuch")


def test_output_cut_by_its_reader_is_quiet(capsys, monkeypatch):
    """(eighth trial) ``mnemo models | head -1`` said 'mnemo models: error: Broken pipe' (exit 2):
    the reader leaving is no error of the command. Now quiet, exit status 141 (as a process that
    SIGPIPE ends), and nothing on stderr, the flush at the interpreter's exit included. (Here this
    process's stdout is swapped for a pipe whose reader is gone, unbuffered as Python makes stdout
    under PYTHONUNBUFFERED, as the subprocess this test used to start had it, and flushed as the
    exit would.)"""
    r, w = os.pipe()
    os.close(r)  # the reader is gone
    cut = io.TextIOWrapper(io.FileIO(w, "w"), write_through=True)
    monkeypatch.setattr(sys, "stdout", cut)
    try:
        assert main(["models"]) == 141
        cut.flush()  # what Python does at exit: it said 'Exception ignored ... BrokenPipeError'
    finally:
        monkeypatch.undo()
        cut.close()
    assert capsys.readouterr().err == ""


def test_an_empty_config_file_is_refused_not_trained_with_defaults(tmp_path, capsys):
    """Hostile trial 9, finding 7: `train --config` of a 0-byte file trained with every default.
    Now exit 2 naming the file; an explicit `{}` still means the defaults."""
    for text in ("", "# only a comment\n"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        out = tmp_path / "run"
        assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"config file '{cfg}' is empty" in err and "Traceback" not in err, err
        assert not out.exists(), "nothing trained"
    from mnemo.train import load_config_file

    cfg.write_text("{}\n")
    assert load_config_file(cfg) == {}


def test_overwrite_discards_the_old_run_only_once_the_new_one_is_built(run, tmp_path, capsys):
    """Hostile trial 10, finding 1: `train --overwrite` deleted the old run's checkpoints, then
    failed on a bad --data/--model/--tokenizer/--d-model: the old run was gone and nothing replaced
    it. Now the data, tokenizer, model and weights load first; the folder is untouched on failure."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    before = _tree(mine)
    base = ["train", *TINY, "--steps", "2", "--out", str(mine), "--overwrite"]
    for bad in (
        ["--data", str(tmp_path / "nonexist.txt")],
        ["--model", "bogus"],
        ["--tokenizer", str(tmp_path / "no-tokenizer.json")],
        ["--d-model", "3"],
    ):
        assert main([*base, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error:" in err, (bad, err)
        assert _tree(mine) == before, f"{bad}: the old run was changed"
    assert main([*base, "--eval-interval", "2"]) == 0  # a good command still starts over
    assert (mine / "ckpt-000002").is_dir() and not (mine / "ckpt-000004").exists()


def test_overwrite_refuses_an_input_inside_the_run_it_discards(run, tmp_path, capsys):
    """Hostile trial 10, finding 2: `--init-from RUN --out RUN --overwrite` (or a tokenizer read
    from the run's checkpoint) discarded its own input. Now refused up front, naming the flag."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / "ckpt-000004" / "my-tokenizer.json").write_text("{}")
    before = _tree(mine)
    base = ["train", *TINY, "--steps", "2", "--out", str(mine), "--overwrite"]
    for flag, value in (
        ("--init-from", mine),
        ("--init-from", mine / "ckpt-000004"),
        ("--tokenizer", mine / "ckpt-000004" / "my-tokenizer.json"),
    ):
        assert main([*base, flag, str(value)]) == 2
        err = capsys.readouterr().err
        assert f"{flag}: {value} is part of the run in {mine}, which --overwrite discards" in err, err
        assert _tree(mine) == before
    other = tmp_path / "other"
    shutil.copytree(run, other)  # from another run: allowed
    assert main([*base, "--init-from", str(other)]) == 0
    assert _tree(other) == _tree(run)


def test_an_interrupt_before_any_checkpoint_says_nothing_was_saved(run, tmp_path, capsys, monkeypatch):
    """Hostile trial 10, findings 3 and 7: Ctrl-C just after --overwrite's deletion said "the last
    checkpoint is intact" over an empty folder, and SIGTERM exited 130. Now an interrupt while the
    run is set up leaves the folder as it was (and says so); one before the first step says
    nothing was saved; a SIGTERM exits 143 (128 + 15), a SIGINT 130."""
    import mnemo.train.trainer as trainer_module
    from mnemo.train.interrupts import DeferredInterrupts

    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    before = _tree(mine)
    argv = ["train", *TINY, "--steps", "2", "--out", str(mine), "--overwrite"]

    def interrupt_while_building(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(trainer_module.Trainer, "__init__", interrupt_while_building)
        assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"the run was still being set up: {mine} is as it was" in err and "intact" not in err, err
    assert _tree(mine) == before

    for signal_name, status in (("SIGTERM", 143), ("SIGINT", 130)):

        class StopAtOnce(DeferredInterrupts):
            name = signal_name

            def __enter__(self):
                super().__enter__()
                self.requested = self.name  # as if the signal came before the first step
                return self

        fresh = tmp_path / f"fresh-{signal_name}"
        with monkeypatch.context() as m:
            m.setattr(trainer_module, "DeferredInterrupts", StopAtOnce)
            assert main(["train", *TINY, "--steps", "2", "--out", str(fresh)]) == status
        err = capsys.readouterr().err
        assert f"interrupted ({signal_name} at step 0, before any checkpoint was written)" in err, err
        assert "nothing was trained or saved" in err and "--resume" not in err, err
        assert not list(fresh.glob("ckpt-*"))


def test_a_tiny_temperature_is_the_greedy_limit_not_a_traceback(run, capsys):
    """Hostile trial 10, finding 5: `generate --temperature 1e-40` raised torch's "probability tensor
    contains inf/nan" (logits / 1e-40 overflow). The shift by the row maximum keeps the
    distribution: a tiny temperature draws the top token (ties shared), a usual one draws as
    softmax(logits / T) does."""
    import torch

    from mnemo.models.lm import sample_next

    assert (
        main(["generate", "--checkpoint", str(run), "--temperature", "1e-40", "--max-new-tokens", "4"]) == 0
    )
    assert "Traceback" not in capsys.readouterr().err
    logits = torch.tensor([[3.0, -1.0, 2.5, 0.0], [1.0, 1.0, -5.0, 0.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits * 1e6, 1e-40, None, g) for _ in range(200)])
    assert (draws[:, 0] == 0).all() and set(draws[:, 1].tolist()) == {0, 1}  # the tie is shared
    for t in (0.5, 1.0, 3.0):  # the same draws as the unshifted formula, from the same seed
        a = sample_next(logits.repeat(64, 1), t, None, torch.Generator().manual_seed(1))
        b = torch.multinomial(
            (logits.repeat(64, 1) / t).softmax(-1), 1, generator=torch.Generator().manual_seed(1)
        )
        assert torch.equal(a, b[:, 0])


def test_a_latest_that_is_a_folder_is_not_called_missing(run, tmp_path, capsys):
    """Hostile trial 10, finding 7: a `latest` made a folder was reported "missing"."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / "latest").unlink()
    (mine / "latest").mkdir()
    assert main(["eval", "--checkpoint", str(mine), "--max-batches", "1"]) == 0
    err = capsys.readouterr().err
    assert f"{mine / 'latest'} is not a file (a folder, say) — using {mine / 'ckpt-000004'}" in err, err


def test_verify_list_json_and_empty_patterns(tmp_path, capsys):
    """Hostile trial 10, finding 9: `verify --list --json F` wrote nothing, and `--ops ','` (no
    pattern at all) checked every op. Now the listing is written as JSON, and an empty pattern
    list is refused naming the flag."""
    out = tmp_path / "list.json"
    assert main(["verify", "--list", "--third-party", "none", "--ops", "gla*", "--json", str(out)]) == 0
    printed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln and not ln.startswith("#")]
    listed = json.loads(out.read_text())
    assert [r["spec"] for r in listed] == printed[: len(listed)] and listed
    assert {r["group"] for r in listed} == {"mnemo"} and all(r["spec"].startswith("gla") for r in listed)
    for flag in ("--ops", "--checks"):
        for empty in (",", " , "):
            assert main(["verify", "--list", flag, empty]) == 2
            err = capsys.readouterr().err
            assert f"{flag}: expected comma-separated names or patterns, got {empty!r}" in err, err


def test_a_sweep_name_may_not_be_dot_or_dot_dot(tmp_path):
    """Hostile trial 10, finding 8: `name: ..` made runs/sweeps/../ the sweep's folder (runs/)."""
    from mnemo.sweep.spec import SweepSpec

    for bad in (".", ".."):
        f = tmp_path / "s.yaml"
        f.write_text(f"name: '{bad}'\nmodels: [gla]\ngrid: {{lr: [1e-3]}}\n")
        with pytest.raises(
            ValueError,
            match=re.escape(f"other than '.' and '..' (it names folders: runs/sweeps/NAME/), got {bad!r}"),
        ):
            SweepSpec.load(f)


def test_a_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(run, tmp_path, capsys):
    """Hostile trial 10, finding 4: `--resume` with `latest` pointed back at an older checkpoint
    silently replaced the newer one, and never said which checkpoint it resumed. Now it names the
    checkpoint and step, and the later checkpoints move to kept/superseded-N/ intact."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    newer = _tree(mine / "ckpt-000004")
    (mine / "latest").write_text("ckpt-000002\n")
    kept = mine / "kept" / "superseded-1" / "ckpt-000004"
    said = f"the run's later checkpoints (ckpt-000004) moved to {kept.parent}, not replaced"
    with pytest.warns(UserWarning, match=re.escape(said)):
        assert main(["train", "--out", str(mine), "--resume", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert f"resume: from {mine / 'ckpt-000002'} (step 2)" in out.out, out.out
    assert _tree(kept) == newer  # the other history, whole
    assert (mine / "latest").read_text() == "ckpt-000004\n" and _tree(mine / "ckpt-000004") != newer
    # a plain resume of the newest checkpoint moves nothing
    assert (
        main(
            ["train", "--out", str(mine), "--resume", "--steps", "6", "--reschedule", "hold", "--no-progress"]
        )
        == 0
    )
    assert not (mine / "kept" / "superseded-2").exists()


def test_tenth_trial_messages(run, tmp_path, capsys):
    """Hostile trial 10, finding 7: messages that named the wrong thing. `eval --data` of a short
    file did not say that only its last 10% (the validation split) is read; a JSON file that is no
    tokenizer said "unknown tokenizer kind None"; `--d-model 3` (4 heads) said "rotary embeddings
    need an even head_dim, got 0"."""
    short = tmp_path / "short.txt"
    short.write_text("hello world, a short file\n" * 4)
    assert main(["eval", "--checkpoint", str(run), "--data", str(short)]) == 2
    err = capsys.readouterr().err
    assert f"this is the validation split, the last 10% of {str(short)!r} (--full reads all of it)" in err, (
        err
    )
    assert (
        main(["eval", "--checkpoint", str(run), "--data", str(short), "--full"]) == 0
    )  # 104 tokens: 6 windows
    capsys.readouterr()
    tok = tmp_path / "tok.json"
    tok.write_text('{"foo": 1}')
    assert main(["train", *TINY, "--tokenizer", str(tok), "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"corrupt tokenizer file {tok}: a JSON object with neither 'kind'" in err and "None" not in err, (
        err
    )
    assert (
        main(["train", "--d-model", "3", "--steps", "1", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    )
    err = capsys.readouterr().err
    assert "d_model: 3 is smaller than n_heads = 4, so each head would have head_dim" in err, err
    assert not (tmp_path / "r").exists()


def test_an_output_folder_named_like_a_file_or_a_run_is_refused(run, tmp_path, capsys):
    """Hostile trial 10, finding 9: `probe ablate --out x.png` made a folder named x.png, and
    `continual`/`probe --out` accepted a training run's own folder (their files mixed with the
    run's). Both are refused before any work, naming the flag; an existing folder named x.png is
    still a folder to write into."""
    png = tmp_path / "scores.png"
    for argv in (
        ["probe", "ablate", "--checkpoint", str(run), "--out", str(png)],
        ["probe", "circuits", "--checkpoint", str(run), "--out", str(png)],
        ["continual", "--out", str(tmp_path / "results.json")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "--out" in err and "(a file name: this is the folder the files go into" in err, err
        assert not png.exists()
    for argv in (
        ["probe", "circuits", "--checkpoint", str(run), "--out", str(run)],
        ["continual", "--out", str(run)],
    ):
        assert main(argv) == 2, argv
        assert "(a training run's folder: what this writes would mix" in capsys.readouterr().err
    png.mkdir()
    assert kinds.OutDir()(str(png)) == str(png)


def test_a_signal_the_process_started_ignoring_stays_ignored():
    """Hostile trial 10, finding 6: a Ctrl-C (SIGINT) sent early to a training started in a
    shell script's background job was ignored, one sent later stopped it: POSIX shells start such
    a job with SIGINT ignored, and the trainer installed its handler over that during training
    only. Now an ignored signal stays ignored throughout (SIGTERM still stops it); a handled one
    is deferred as before, and the old handlers come back on exit."""
    import signal

    from mnemo.train.interrupts import DeferredInterrupts

    olds = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with DeferredInterrupts() as d:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert d.requested is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert d.requested == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with DeferredInterrupts() as d:
            os.kill(os.getpid(), signal.SIGINT)
            assert d.requested == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, h in olds.items():
            signal.signal(s, h)


def test_an_overwrite_whose_new_run_fails_before_a_checkpoint_keeps_the_old_run(run, tmp_path, capsys):
    """Hostile trial 11, finding 1: `train --overwrite --lr 1e30` diverged at step 2, before any
    checkpoint, and left the folder empty: the old run was deleted for nothing. The old run now
    moves aside while the new one trains and comes back whole when the new one writes no
    checkpoint; once it has one, the old run is discarded (and nothing is left aside)."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    before = _tree(mine)
    argv = ["train", *TINY, "--steps", "4", "--out", str(mine), "--overwrite", "--warmup-steps", "1"]
    assert main([*argv, "--lr", "1e30"]) == 1
    err = capsys.readouterr().err
    assert "training stopped at step" in err and f"the old run in {mine} is back as it was" in err, err
    assert _tree(mine) == before and not list(mine.glob(".overwritten-*"))
    assert main([*argv, "--eval-interval", "2"]) == 0
    assert not list(mine.glob(".overwritten-*")) and (mine / "latest").read_text() == "ckpt-000004\n"
    assert _tree(mine / "ckpt-000004") != _tree(run / "ckpt-000004")


def test_a_temperature_below_the_dtypes_range_is_greedy():
    """Hostile trial 11, finding 2: 1e-46 (below float32's smallest subnormal: it rounds to 0)
    still raised "probability tensor contains inf/nan". Below the dtype's smallest normal number
    the draw is the argmax."""
    import torch

    from mnemo.models.lm import sample_next

    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 0.0, 2.9]])
    for t in (1e-39, 1e-46, 5e-324):
        assert sample_next(logits, t, None, torch.Generator()).tolist() == [1, 0]
        assert sample_next(logits, t, 2, torch.Generator()).tolist() == [1, 0]


def test_a_damaged_newest_checkpoint_set_aside_leaves_latest_naming_the_resumed_one(run, tmp_path, capsys):
    """Hostile trial 11: `--resume` past a damaged newest checkpoint resumed the older one and
    moved the damaged one to kept/superseded-N, but `latest` still named it: a run that stopped
    before its next checkpoint (here: already at --steps) left `latest` dangling. Now `latest`
    names the checkpoint the run resumed from, and the warning says so."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    w = mine / "ckpt-000004" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-7])  # torn: fails its manifest
    said = "moved to " + str(mine / "kept" / "superseded-1") + ", not replaced"
    with pytest.warns(UserWarning, match=re.escape(said) + r".*latest now names ckpt-000002"):
        assert _resume(mine, 2) == 0
    assert (mine / "latest").read_text() == "ckpt-000002\n"
    assert (mine / "kept" / "superseded-1" / "ckpt-000004").is_dir()
    assert "already trained to step 2 (raise --steps to continue)" in capsys.readouterr().out


def test_resume_with_fewer_steps_than_trained_says_so(run, tmp_path, capsys):
    """Hostile trial 11: `--resume --steps 2` on a run at step 4 said only "already trained to
    step 4", as if --steps had not been read. Now the message names the lower --steps and that the
    run is not cut back; its checkpoints stay."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    before = _tree(mine / "ckpt-000004")
    assert _resume(mine, 2) == 0
    out = capsys.readouterr().out
    assert (
        "already trained to step 4, past --steps 2: nothing to do (the run is not cut back; raise "
        "--steps above 4 to continue)" in out
    ), out
    assert _tree(mine / "ckpt-000004") == before and (mine / "latest").read_text() == "ckpt-000004\n"


def test_train_out_inside_another_run_is_refused(run, tmp_path, capsys):
    """Hostile trial 11: `train --out RUN/kept` trained a run inside another run's folder, where
    that run's --overwrite would discard it. Refused before any work, naming the run."""
    for inside in (run / "kept", run / "kept" / "x", run / "sub"):
        assert main(["train", *TINY, "--steps", "1", "--out", str(inside)]) == 2
        err = capsys.readouterr().err
        assert (
            f"--out: expected a run folder to write, got {str(inside)!r} (inside the training run {run},"
            in err
        )
        assert not inside.exists()


@pytest.mark.parametrize("second", [[], ["--overwrite"]])
def test_a_second_training_cannot_start_in_a_folder_whose_run_is_being_set_up(
    tmp_path, monkeypatch, capsys, second
):
    """Hostile trial 12, data loss 1: `train --out cf` checked the folder, then loaded its data (8 s
    of a large corpus) before taking the folder's lock; a second `train --out cf` (or `--overwrite`)
    ran whole in between, and the first then trained into its run (latest replaced, its
    checkpoint rotated away on resume). Now the command takes the folder first: the second is
    refused while the first is still being set up, and the first run is whole."""
    import mnemo.train as train_pkg

    out = tmp_path / "cf"
    real, second_status = train_pkg.Trainer, []

    def while_setting_up(*a, **k):  # the second command, started while the first builds its run
        if second_status:  # (the second command's own Trainer, if it gets that far)
            return real(*a, **k)
        second_status.append(None)
        t = threading.Thread(
            target=lambda: second_status.append(
                main(["train", *TINY, "--steps", "3", "--warmup-steps", "1", "--out", str(out), *second])
            )
        )
        t.start()
        t.join()
        return real(*a, **k)

    monkeypatch.setattr(train_pkg, "Trainer", while_setting_up)
    assert main(["train", *TINY, "--steps", "2", "--warmup-steps", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert second_status == [None, 2], err
    assert f"run folder {out} is in use by another training process (pid {os.getpid()})" in err
    assert (out / "latest").read_text() == "ckpt-000002\n" and not (out / "ckpt-000003").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2]


def test_a_tokenizer_that_does_not_fit_the_model_is_named(run, tmp_path, capsys):
    """(trial 13) a checkpoint whose tokenizer.json was replaced by a larger one failed with
    "input_ids must lie in [0, vocab_size)"; the commands that read text with it now say which
    tokenizer does not fit which model, before any work."""
    import shutil

    from mnemo.data.tokenizer import build_tokenizer, save_tokenizer

    ckpt = tmp_path / "cv1"
    shutil.copytree(run / (run / "latest").read_text().strip(), ckpt)
    (ckpt / "manifest.json").unlink()  # a converted checkpoint has none to catch the edit
    tok = build_tokenizer("byte")
    save_tokenizer(tok, ckpt)
    for argv in (
        ["generate", "--checkpoint", str(ckpt), "--prompt", "ab", "--max-new-tokens", "2"],
        ["eval", "--checkpoint", str(ckpt), "--max-batches", "1"],
        ["probe", "spectrum", "--checkpoint", str(ckpt), "--tokens", "16", "--out", str(tmp_path / "p")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"--checkpoint {ckpt}: its tokenizer has {tok.vocab_size} ids but the model reads" in err, err
        assert "must lie in" not in err


def test_an_export_exported_again_keeps_its_tokenizer(tmp_path, capsys):
    """Hostile trial 12, data loss 2: `mnemo export exp1 exp2` of an exported folder wrote exp2
    without mnemo's tokenizer (exp1 holds it as mnemo_tokenizer.json), `convert exp2` then made
    a checkpoint that `generate` refused, and both said only "wrote". Now the tokenizer travels,
    and a source without any tokenizer is said in a warning."""
    rm = tmp_path / "rm"
    assert (
        main(["train", *TINY, "--model", "mamba", "--steps", "2", "--warmup-steps", "1", "--out", str(rm)])
        == 0
    )
    with pytest.warns(UserWarning, match="mnemo's own char/byte tokenizer"):
        assert main(["export", str(rm), str(tmp_path / "exp1")]) == 0
    assert main(["export", str(tmp_path / "exp1"), str(tmp_path / "exp2")]) == 0
    tok = (rm / "ckpt-000002" / "tokenizer.json").read_bytes()
    assert (tmp_path / "exp2" / "mnemo_tokenizer.json").read_bytes() == tok
    assert main(["convert", str(tmp_path / "exp2"), str(tmp_path / "conv")]) == 0
    assert (tmp_path / "conv" / "tokenizer.json").read_bytes() == tok
    capsys.readouterr()
    assert (
        main(["generate", "--checkpoint", str(tmp_path / "conv"), "--prompt", "KI", "--max-new-tokens", "3"])
        == 0
    )
    assert capsys.readouterr().out.startswith("KI")
    # no tokenizer in the source: the export and the conversion say so
    (tmp_path / "exp2" / "mnemo_tokenizer.json").unlink()
    with pytest.warns(UserWarning, match=r"exp2 holds no tokenizer .* so .*exp3 has none"):
        assert main(["export", str(tmp_path / "exp2"), str(tmp_path / "exp3")]) == 0
    with pytest.warns(UserWarning, match=r"exp3 holds no tokenizer .* so .*conv3 has none"):
        assert main(["convert", str(tmp_path / "exp3"), str(tmp_path / "conv3")]) == 0


def test_sweep_out_inside_a_training_run_is_refused(run, tmp_path, capsys):
    """Hostile trial 12: `sweep --out RUN/probes` put a sweep's runs inside a training run's folder
    (whose --overwrite would discard them); and the refusal of --out inside a checkpoint suggested
    `RUN/probes`, which `train` then refused. Both now name what to choose."""
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmodels: [gla]\nmetric: val_loss\ngrid: {lr: [1e-3]}\n")
    assert main(["sweep", str(spec), "--out", str(run / "probes")]) == 2
    assert f"(inside the training run {run}," in capsys.readouterr().err
    assert main(["train", *TINY, "--out", str(run / "ckpt-000004" / "x")]) == 2
    err = capsys.readouterr().err
    assert (
        f"(inside the checkpoint {run / 'ckpt-000004'}, which training rotates away: choose a folder " in err
    )
    assert "probes" not in err and not (run / "probes").exists()


def test_a_checkpoint_without_manifest_is_warned_about_once(run, tmp_path, capsys):
    """Hostile trial 12: eval of a checkpoint whose manifest.json was deleted printed the
    "loading it unverified" warning twice (the checkpoint is resolved twice); once per command now,
    and again by the next command."""
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    (mine / "ckpt-000004" / "manifest.json").unlink()
    for _ in range(2):
        assert main(["eval", "--checkpoint", str(mine), "--max-batches", "1"]) == 0
        assert capsys.readouterr().err.count("has no manifest.json") == 1


def test_an_interrupted_generate_prints_what_it_made(run, monkeypatch, capsys):
    """Hostile trial 12: Ctrl-C during `generate --max-new-tokens 100000` printed only "mnemo:
    interrupted" after minutes of decoding (the text is printed at the end). Now the text made
    before the interrupt is printed, and the message says how many tokens it holds; greedy, it is
    the start of the uninterrupted generation."""
    import mnemo.models.lm as lm

    argv = ["generate", "--checkpoint", str(run), "--prompt", "KING:", "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "12"]) == 0
    full = capsys.readouterr().out.rstrip("\n")
    real, calls = lm.sample_next, []

    def interrupted_at_the_sixth(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(lm, "sample_next", interrupted_at_the_sixth)
    assert main([*argv, "--max-new-tokens", "100000"]) == 130
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == full[: len("KING:") + 5], (out.out, full)
    assert "the text above holds the 5 of 100,000 new tokens made before it" in out.err, out.err


def test_generate_on_token_sees_each_new_token_as_returned():
    """LanguageModel.generate(on_token=...): called once per new token with the [B] ids the result
    holds; refused with attention_mask (its groups decode one after another)."""
    import torch

    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("gla", vocab_size=32, d_model=16, n_layers=1))
    seen = []
    g = torch.Generator().manual_seed(3)
    out = model.generate(torch.randint(0, 32, (2, 5)), 7, generator=g, on_token=seen.append)
    assert len(seen) == 7 and torch.equal(torch.stack(seen, 1), out[:, 5:])
    with pytest.raises(ValueError, match="on_token: not supported with attention_mask"):
        model.generate(torch.ones(1, 3, dtype=torch.long), 2, attention_mask=torch.ones(1, 3), on_token=print)


def test_a_path_that_leaves_a_run_through_dot_dot_is_judged_where_it_leads(run, tmp_path, monkeypatch):
    """Hostile trial 14: `export rm rm/ckpt-000002/../../rm2x` was refused as "inside the
    checkpoint" (the path's text was read, not where it leads). A path is now judged where it
    resolves: out of the run is allowed, into its checkpoint still refused."""
    monkeypatch.chdir(run.parent)
    name = run.name
    out = kinds.OutDir("a folder", not_inside_run=True)
    escaped = f"{name}/ckpt-000004/../../{name}-exported"
    assert out(escaped) == escaped
    assert kinds.OutPath("a path")(escaped) == escaped
    for into in (f"{name}/x/../ckpt-000004/y", f"{name}-other/../{name}/ckpt-000004"):
        with pytest.raises(argparse.ArgumentTypeError, match="inside the checkpoint"):
            out(into)
    with pytest.raises(argparse.ArgumentTypeError, match="inside the training run"):
        out(f"{name}-other/../{name}/probes")


def test_a_new_run_in_a_folder_of_other_files_says_so_and_leaves_them(tmp_path, capsys):
    """Hostile trial 14: `train --out user --overwrite` into a folder of unrelated files trained
    beside them without a word. It still trains (a folder holding the run's own config file is a
    common layout) but says what is there, that it is left alone, and that --overwrite has no run
    to discard; the config file itself is not news."""
    short = ["--steps", "2", "--eval-interval", "2", "--warmup-steps", "0"]
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine\n")
    (user / "c.yaml").write_text("model: gla\n")
    assert (
        main(["train", *TINY, *short, "--out", str(user), "--overwrite", "--config", str(user / "c.yaml")])
        == 0
    )
    err = capsys.readouterr().err
    assert f"warning: --out {user} already holds files that are not a run's (notes.txt): the run's " in err
    assert "; --overwrite has no earlier run there to discard" in err
    assert (user / "notes.txt").read_text() == "mine\n" and (user / "latest").is_file()
    # a run folder resumed or overwritten is not warned about
    assert main(["train", *TINY, *short, "--out", str(user), "--overwrite"]) == 0
    assert "already holds files" not in capsys.readouterr().err
    # a fresh folder says nothing
    assert main(["train", *TINY, *short, "--out", str(tmp_path / "new")]) == 0
    assert "already holds files" not in capsys.readouterr().err


def test_a_path_flag_with_a_tilde_is_the_path_its_checks_looked_at(tmp_path, monkeypatch):
    """A shell leaves ``--out=~/x`` and a quoted ``'~/x'`` alone: each path kind checks the home
    folder's path and hands the command that same path, not the text (a folder named ``~``)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "d").mkdir()
    assert kinds.ExistingFile()("~/f.txt") == str(tmp_path / "f.txt")
    assert kinds.ExistingDir()("~/d") == str(tmp_path / "d")
    assert kinds.OutDir()("~/new") == str(tmp_path / "new")
    assert kinds.OutFile()("~/new.json") == str(tmp_path / "new.json")
    assert kinds.OutDir()("runs/x") == "runs/x"  # no tilde: the text as given
    with pytest.raises(argparse.ArgumentTypeError, match="no such user's home folder"):
        kinds.OutDir()("~nosuchuser_mnemo/x")
