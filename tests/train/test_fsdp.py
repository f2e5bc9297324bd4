"""``mnemo train --fsdp`` (FSDP2, ``fully_shard``) on 2 gloo processes equals the single-process run
(losses at every evaluation, final weights) for a hybrid of gated DeltaNet and attention with
gradient accumulation; its sharded (DCP) checkpoints carry a manifest over every shard, resume on
ONE process to the same losses as the uninterrupted run, and convert to the single-file format
(``consolidate_checkpoint`` and ``mnemo convert --from-dcp``).

Tolerance: float32; FSDP reduce-scatters (averages) the two processes' gradient halves, a different
summation order than one process's backward, so the runs agree to float32 rounding amplified by a
few AdamW steps (measured ≤ 1e-6 relative; asserted 1e-5 as the DDP and context-parallel tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mnemo.train import TrainConfig, Trainer
from tests.helpers import free_port, join_as_torchrun, spawn

RTOL = 1e-5


def _cfg(**kw) -> TrainConfig:
    base = dict(
        model="gated_deltanet_hybrid",
        model_overrides={"d_model": 16, "n_layers": 2, "layers": ["gated_deltanet", "attention"]},
        seq_len=16,
        batch_size=4,
        grad_accum=2,
        steps=4,
        eval_interval=2,
        eval_batches=1,
        warmup_steps=2,
        sample_tokens=0,
        fsdp=True,
    )
    base.update(kw)
    return TrainConfig(**base)


def _worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    from mnemo.train.distributed import cleanup

    out = Path(out)
    try:
        tr = Trainer(_cfg(), out / "whole", progress=False)
        assert tr.fsdp and tr.ddp is None
        assert type(tr.model.embed.weight).__name__ == "DTensor"  # really sharded
        tr.fit()  # sharded checkpoints at steps 2 and 4
    finally:
        cleanup()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    spawn(_worker, (2, free_port(), str(out)), 2, start_method="forkserver")
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    Trainer(_cfg(fsdp=False), out, progress=False).fit()
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(got: Path, want: Path):
    g, w = _metrics(got), _metrics(want)
    assert [r["step"] for r in g] == [r["step"] for r in w] == [2, 4]
    for a, b in zip(g, w):
        for k in ("train_loss", "val_loss"):
            assert a[k] == pytest.approx(b[k], rel=RTOL), (a["step"], k)
    diff = max(abs(a[k] - b[k]) for a, b in zip(g, w) for k in ("train_loss", "val_loss"))
    print(f"max |loss diff| {diff:.1e}")


def _assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=RTOL, atol=RTOL, msg=f"weights {n}")
    print(f"max |weight diff| {max((a[n] - b[n]).abs().max().item() for n in b):.1e}")


def test_two_sharded_processes_equal_one(spawned, reference):
    _assert_same_run(spawned / "whole", reference)


def test_sharded_checkpoint_layout_and_manifest(spawned):
    from mnemo.train.checkpoint import verify_checkpoint
    from mnemo.train.sharded import is_sharded

    ckpt = spawned / "whole" / "ckpt-000004"
    assert is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(files)
    assert verify_checkpoint(ckpt) == []
    assert not list((spawned / "whole").glob(".tmp-*"))


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(spawned, tmp_path):
    from mnemo.train import resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(spawned / "whole", run)
    shard = run / "ckpt-000004" / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])
    notes = []
    assert resolve_checkpoint(run, warn=notes.append) == run / "ckpt-000002"
    assert "__1_0.distcp" in notes[0] and "truncated" in notes[0]


def test_sharded_checkpoint_resumes_on_one_process(spawned, reference, tmp_path):
    run = tmp_path / "cut"  # the run as if it had stopped after step 2
    shutil.copytree(spawned / "whole", run)
    shutil.rmtree(run / "ckpt-000004")
    (run / "latest").write_text("ckpt-000002\n")
    tr = Trainer(None, run, resume=True, progress=False)  # saved with 2 processes, resumed by 1
    assert tr.step == 2 and not tr.fsdp
    tr.fit()
    _assert_same_run(run, reference)
    _assert_same_weights(
        load_file(str(run / "ckpt-000004" / "model.safetensors")),
        load_file(str(reference / "ckpt-000004" / "model.safetensors")),
    )


def test_consolidation_to_a_single_file_checkpoint(spawned, reference, tmp_path, capsys):
    from mnemo.cli import main
    from mnemo.train.checkpoint import load_trainer_state
    from mnemo.train.sharded import consolidate_checkpoint

    ckpt = consolidate_checkpoint(spawned / "whole", tmp_path / "single")
    assert ckpt == tmp_path / "single" / "ckpt-000004"
    _assert_same_weights(
        load_file(str(ckpt / "model.safetensors")),
        load_file(str(reference / "ckpt-000004" / "model.safetensors")),
    )
    got, want = load_trainer_state(ckpt), load_trainer_state(reference / "ckpt-000004")
    assert got["step"] == want["step"] == 4 and "sharded" not in got
    for i, s in want["optimizer"]["state"].items():  # AdamW moments, in parameter order
        torch.testing.assert_close(
            got["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], rtol=1e-4, atol=1e-7
        )
    # the CLI path, on the step-2 checkpoint; the result resumes as an ordinary run
    assert main(["convert", "--from-dcp", str(spawned / "whole" / "ckpt-000002"), str(tmp_path / "cli")]) == 0
    assert "wrote single-file checkpoint" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(spawned / "whole")]) == 2  # eval reads one file: refused
    assert "is a sharded checkpoint of `mnemo train --fsdp`; write a single-file" in capsys.readouterr().err
    tr = Trainer(None, tmp_path / "cli", resume=True, progress=False)
    assert tr.step == 2
    with pytest.raises(ValueError, match="is not a sharded \\(FSDP\\) checkpoint"):
        consolidate_checkpoint(reference, tmp_path / "x")


def test_fsdp_flag_is_validated():
    with pytest.raises(ValueError, match="TrainConfig.fsdp: expected true or false"):
        _cfg(fsdp="yes").validate()
    with pytest.raises(ValueError, match="TrainConfig.fsdp: expected false with context_parallel"):
        _cfg(context_parallel=True).validate()
    with pytest.raises(ValueError, match="TrainConfig.fsdp: expected false with optimizer 'm3'"):
        _cfg(optimizer="m3").validate()


def test_a_consolidated_checkpoint_resumes_data_parallel(spawned, tmp_path):
    """The single-file checkpoint is no longer a sharded run's: its saved ``fsdp`` is off, so a
    resume under torchrun runs data-parallel (no flag of ``mnemo train --resume`` turns a saved
    ``--fsdp`` off, and a sharded resume of a single-file checkpoint is refused)."""
    from mnemo.train.sharded import consolidate_checkpoint
    from mnemo.train.strategy import DataParallel, make_strategy

    ckpt = consolidate_checkpoint(spawned / "whole", tmp_path / "single")
    saved = json.loads((ckpt / "train_config.json").read_text())
    original = json.loads((spawned / "whole" / "ckpt-000004" / "train_config.json").read_text())
    assert original["fsdp"] is True and saved == {**original, "fsdp": False}
    cfg = TrainConfig.from_dict(saved)
    assert isinstance(make_strategy(cfg, torch.device("cpu"), 0, 2), DataParallel)
