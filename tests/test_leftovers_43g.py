"""Session 43, area G: follow-ups found by this session's helpers (each test fails before its fix)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mnemo.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "Mamba"], "--models: unknown model(s) ['Mamba']; registered: "),
        (["--models", "gla,Mamba"], "--models: unknown model(s) ['Mamba']; registered: "),
        (["--peers", "mamba"], "--peers: unknown peer(s) ['mamba']; choose from "),
        (["--model-shapes", "1024"], "--model-shapes: expected TxB[,TxB...] such as 1024x8, got '1024'"),
        (["--gen-tokens", "1"], "--gen-tokens: expected >= 2 (first token + at least one step), got 1"),
    ],
)
def test_bench_all_refuses_a_later_suites_argument_before_any_suite_runs(monkeypatch, capsys, argv, message):
    """``mnemo bench --suite all --models Mamba`` ran the ops and peers suites (minutes) before the
    decode suite refused the name, and their rows (in a temporary folder) were lost with the error.
    Refused now before the first suite starts, with the message the single suite gives."""
    from mnemo.commands import bench
    from mnemo.models import model_names

    ran = []
    monkeypatch.setattr(bench, "_run_suite", lambda a: ran.append(a.suite) or 0)
    assert main(["bench", "--suite", "all", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert ran == []  # no suite started
    if argv[0] == "--models":  # the registry's own names, listed as the decode suite lists them
        assert "Mamba" not in model_names() and ", ".join(model_names()) in err


def test_bench_all_uses_the_single_suites_message_for_an_unknown_model(monkeypatch, capsys):
    """The early check says what ``--suite decode`` itself says (the suite that refused it before)."""
    from mnemo.bench import decode

    with pytest.raises(ValueError) as single:
        decode.main(SimpleNamespace(models="Mamba", ops=None))
    from mnemo.commands import bench

    monkeypatch.setattr(bench, "_run_suite", lambda a: 0)
    assert main(["bench", "--suite", "all", "--models", "Mamba"]) == 2
    assert str(single.value) in capsys.readouterr().err


def test_resume_with_an_optimizer_state_of_other_groups_names_the_checkpoint_and_the_way_out(tmp_path):
    """An optimizer state whose groups do not fit (torch's bare ValueError "loaded state dict has a
    different number of parameter groups") reached the user naming nothing. Now the error names
    the checkpoint, the saved and the model's group sizes, and ``--init-from`` (weights only)."""
    from mnemo.train import TrainConfig, Trainer
    from mnemo.train.checkpoint import STATE_NAME, write_manifest

    cfg = TrainConfig(
        model="gla",
        model_overrides={"d_model": 16, "n_layers": 1},
        seq_len=16,
        batch_size=2,
        steps=1,
        eval_interval=1,
        eval_batches=1,
        warmup_steps=0,
        sample_tokens=0,
    )
    run = tmp_path / "run"
    Trainer(cfg, run, progress=False).fit()
    ckpt = run / "ckpt-000001"
    state = torch.load(ckpt / STATE_NAME, map_location="cpu", weights_only=False)
    groups = state["optimizer"]["param_groups"]
    mine = [len(g["params"]) for g in groups]
    assert len(groups) >= 2
    del groups[-1]  # one group too few
    torch.save(state, ckpt / STATE_NAME)
    write_manifest(ckpt)  # (an intact file: only its contents misfit)
    with pytest.raises(ValueError) as info:
        Trainer(cfg, run, resume=True, progress=False)
    msg = str(info.value)
    assert f"checkpoint {ckpt}" in msg
    assert f"hold {mine[:-1]} parameters" in msg and f"puts {mine} in them" in msg
    assert f"--init-from {ckpt}" in msg
    assert "different number of parameter groups" in msg  # torch's own words kept


@pytest.mark.parametrize("inside", [False, True])
def test_consolidate_checkpoint_into_a_file_names_out(tmp_path, inside):
    """``consolidate_checkpoint(src, out)`` with ``out`` a file (or under one) raised a raw
    ``FileExistsError`` ("[Errno 17] File exists"); now a ValueError naming OUT and the file."""
    from mnemo.train.sharded import consolidate_checkpoint

    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    out = file / "run" if inside else file
    with pytest.raises(ValueError, match="OUT: .* is a file, not a folder") as info:
        consolidate_checkpoint(tmp_path / "no_such_run", out)
    assert str(out) in str(info.value) and str(file) in str(info.value)
    assert file.read_text() == "keep me"
