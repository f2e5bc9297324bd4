"""Regressions of a new-user trial (46d): what a second Ctrl-C says, ``--overwrite`` and the old run's
derived files, a probe folder read as a run, ``probe ablate``'s flag name, Titans on an empty
sequence."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from mnemo.cli import main
from mnemo.train import Trainer
from mnemo.train import checkpoint as ckpt_mod

TINY = "--model gla --d-model 16 --n-layers 1 --seq-len 16 --batch-size 2 --eval-batches 1 --sample-tokens 0"
TINY = [*TINY.split(), "--warmup-steps", "1", "--no-progress"]


@pytest.fixture
def sigint_raises(request):
    """SIGINT as an interactive shell delivers it (``KeyboardInterrupt`` outside training)."""
    olds = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    }
    request.addfinalizer(lambda: [signal.signal(s, h) for s, h in olds.items()])


def _second_interrupt_during_save(monkeypatch, first_after_step: int) -> None:
    """The first SIGINT after step ``first_after_step`` (a stop is requested: the trainer saves that
    step), the second one while that checkpoint is being written (it stops at once)."""
    real_step, real_manifest = Trainer.train_step, ckpt_mod.write_manifest

    def step_then_signal(self):
        loss = real_step(self)
        if self.step == first_after_step:
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    def manifest_then_signal(ckpt_dir):
        if Path(ckpt_dir).name.startswith(f".tmp-{ckpt_mod.ckpt_name(first_after_step)}"):
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises: asked twice
        real_manifest(ckpt_dir)

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(ckpt_mod, "write_manifest", manifest_then_signal)


def test_a_second_interrupt_before_any_checkpoint_says_nothing_was_saved(
    tmp_path, capsys, monkeypatch, sigint_raises
):
    """It said 'the last checkpoint is intact: continue with --resume' with no run folder at all."""
    _second_interrupt_during_save(monkeypatch, first_after_step=1)
    out = tmp_path / "run"
    flags = ["--steps", "6", "--eval-interval", "6", "--checkpoint-interval", "3"]
    assert main(["train", *TINY, *flags, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"mnemo: interrupted; no checkpoint was saved in {out}: run the command again to start"
    )
    assert "--resume" not in err
    assert not out.exists()  # (the folder the command made, left empty, is removed)


def test_a_second_interrupt_names_the_older_checkpoint_that_holds_the_run(
    tmp_path, capsys, monkeypatch, sigint_raises
):
    """Saved at step 3, interrupted twice while step 4 was being saved: the step-3 checkpoint is what
    ``--resume`` continues from, and the message names it."""
    _second_interrupt_during_save(monkeypatch, first_after_step=4)
    out = tmp_path / "run"
    flags = ["--steps", "6", "--eval-interval", "6", "--checkpoint-interval", "3"]
    assert main(["train", *TINY, *flags, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"mnemo: interrupted; {out}'s newest checkpoint is ckpt-000003: continue with --resume --out {out}"
    )
    assert (out / "latest").read_text().strip() == "ckpt-000003"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".tmp", "ckpt"))) == ["ckpt-000003"]


def test_overwrite_sets_aside_every_derived_file_of_the_old_run(tmp_path, capsys):
    """``--overwrite`` moved ``probes/`` and ``tb/`` aside but left the old run's ``training.png``,
    which then refused the new run's ``mnemo probe plot-training`` ('exists; pass --overwrite')."""
    out = tmp_path / "run"
    run = ["train", *TINY, "--steps", "2", "--out", str(out)]
    assert main(run) == 0
    assert main(["probe", "plot-training", str(out)]) == 0
    assert main(["probe", "circuits", "--checkpoint", str(out), "--length", "8"]) == 0
    old_plot = (out / "training.png").read_bytes()
    capsys.readouterr()
    assert main([*run, "--overwrite", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    kept = out / "kept" / "overwritten-1"
    assert f"warning: --overwrite: the old run's probes/, training.png moved to {kept}" in err
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-000002", "kept", "latest", "metrics.jsonl"]
    assert sorted(p.name for p in kept.iterdir()) == ["probes", "training.png"]
    assert (kept / "training.png").read_bytes() == old_plot
    assert sorted(p.name for p in (kept / "probes" / "ckpt-000002").iterdir()) == [
        "circuits.json",
        "circuits.png",
    ]
    assert main(["probe", "plot-training", str(out)]) == 0  # the new run's default output is free
    assert capsys.readouterr().out.strip() == f"wrote {out / 'training.png'}"


def _fake_run(run: Path, steps) -> None:
    """A run folder of tiny checkpoints (config, weights, manifest) at ``steps``, ``latest`` the last."""

    def write(step):
        def files(tmp: Path):
            (tmp / "config.json").write_text(f'{{"step": {step}}}')
            (tmp / "model.safetensors").write_bytes(b"w" * (10 + step))

        return files

    for step in steps:
        ckpt_mod.save_checkpoint(run, step, write(step), keep=len(steps))


def test_a_probe_output_folder_is_not_taken_for_a_run_with_a_checkpoint(tmp_path, capsys):
    """``RUN/probes`` (whose ``ckpt-000002/`` holds ``mnemo probe``'s JSON and figures) was read as a
    run folder whose ``latest`` was lost: a warning called ``probes/ckpt-000002`` 'the run's newest
    intact checkpoint', then loading it failed."""
    run = tmp_path / "run"
    _fake_run(run, [2])
    probes = run / "probes" / "ckpt-000002"
    probes.mkdir(parents=True)
    (probes / "circuits.json").write_text("{}")
    warned: list[str] = []
    with pytest.raises(FileNotFoundError) as info:
        ckpt_mod.resolve_checkpoint(run / "probes", warn=warned.append)
    assert str(info.value) == (
        f"no checkpoint in {str(run / 'probes')!r}: expected config.json + model.safetensors there, or a "
        "'latest' file naming a checkpoint directory (a run directory written by `mnemo train`); its "
        "ckpt-000002 holds none of a checkpoint's files (config.json, model.safetensors, manifest.json, "
        "...): not a checkpoint (`mnemo probe` "
        "writes its outputs of a run's checkpoint into RUN/probes/ckpt-NNNNNN/; the run folder here is "
        f"{run})"
    )
    assert warned == []
    assert ckpt_mod.resolve_checkpoint(run, warn=warned.append) == run / "ckpt-000002"
    for command in (["eval"], ["generate", "--prompt", "a"], ["probe", "circuits"]):
        assert main([*command, "--checkpoint", str(run / "probes")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "warning" not in err, err
        assert err.startswith(
            f"mnemo {' '.join(command[:2] if command[0] == 'probe' else command[:1])}: "
            f"error: no checkpoint in {str(run / 'probes')!r}"
        )


def test_a_checkpoint_folder_without_config_or_weights_is_skipped_for_the_previous_one(tmp_path):
    """A ``ckpt-NNNNNN`` folder holding neither config nor weights (no manifest to say what is
    missing) is not intact: ``latest`` naming it, or the newest when ``latest`` is lost, falls back to
    the previous checkpoint, with a warning, as a truncated checkpoint does."""
    run = tmp_path / "run"
    _fake_run(run, [2, 4])
    newest = run / "ckpt-000004"
    for f in newest.iterdir():
        f.unlink()
    (newest / "notes.txt").write_text("mine")
    warned: list[str] = []
    assert ckpt_mod.resolve_checkpoint(run, warn=warned.append) == run / "ckpt-000002"
    assert warned == [
        f"damaged checkpoint skipped: {run / 'latest'} points to 'ckpt-000004', which holds none of a "
        f"checkpoint's files — using {run / 'ckpt-000002'} instead"
    ]
    (run / "latest").unlink()
    warned.clear()
    assert ckpt_mod.resolve_checkpoint(run, warn=warned.append) == run / "ckpt-000002"
    assert ckpt_mod.resolve_checkpoint(run, verify=False) == run / "ckpt-000002"
    assert warned == [
        f"{run / 'latest'} is missing — using {run / 'ckpt-000002'}, the run's newest intact checkpoint"
    ]


def test_probe_ablate_names_the_flag_not_the_python_argument(tmp_path, capsys):
    """``--top-induction 9`` on a model of 4 heads said 'k: expected an int in 1 … 3' (the Python
    API's argument, which the command line has no flag of); Python still names ``k``."""
    import torch

    from mnemo.interp.interventions import induction_ablation
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("gla", vocab_size=64, d_model=32, n_layers=1)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    flags = ["--length", "8", "--batch", "2", "--draws", "1"]
    assert (
        main(["probe", "ablate", "--checkpoint", str(tmp_path / "ckpt"), "--top-induction", "9", *flags]) == 2
    )
    assert capsys.readouterr().err == (
        "mnemo probe ablate: error: --top-induction: expected an int in 1 … 3 (fewer than the 4 heads with "
        "a map, so that K random heads are a control and not the same heads), got 9\n"
    )
    with pytest.raises(ValueError) as info:
        induction_ablation(model, 9, draws=1, length=8, batch=2)
    assert str(info.value) == (
        "k: expected an int in 1 … 3 (fewer than the 4 heads with a map, so that K random heads are a "
        "control and not the same heads), got 9"
    )
    assert not (tmp_path / "ckpt" / "probes").exists()  # nothing written


@pytest.mark.parametrize("name", ["titans_lmm", "titans_mac", "titans_mag", "titans_mal"])
def test_titans_maps_of_an_empty_sequence_are_empty(name):
    """0 tokens: ``start must be an int in [0, 0], got 4`` (the persistent prefix, which a 0-token call
    does not write, counted as written) or, for MAC (whose memory runs per segment, none here), a
    ``KeyError`` of a hook name; now ``[B, H, 0, 0]`` maps as the other mixers give, and one token's
    map is still ``[B, H, 1, 1]`` (the prefix written with it, not attributed)."""
    import torch

    from mnemo.interp import capture_maps
    from mnemo.interp.maps import mixing
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config(name, vocab_size=32, d_model=16, n_layers=2)).eval()
    heads = model.blocks[0].mixer.map_heads
    for T in (0, 1):
        maps = capture_maps(model, torch.zeros(2, T, dtype=torch.long))
        assert {i: tuple(m.shape) for i, m in maps.items()} == {0: (2, heads, T, T), 1: (2, heads, T, T)}
        assert all(bool(torch.isfinite(m).all()) for m in maps.values())
    empty = mixing(model.blocks[0].mixer, torch.zeros(3, 0, 16))
    assert tuple(empty.maps.shape) == (3, heads, 0, 0)


def test_capture_maps_of_a_mixer_that_records_nothing_on_0_tokens_names_input_ids(monkeypatch):
    """A mixer whose hooks do not fire on 0 tokens (HOPE's self-modifying memory did so until helper
    47b, here given that behaviour back): a ``KeyError`` of an internal hook name; now a
    ``ValueError`` naming ``input_ids`` and what it needs."""
    import torch

    from mnemo.interp import capture_maps
    from mnemo.models import LanguageModel, build_config

    model = LanguageModel(build_config("hope_reconstruction", vocab_size=64, d_model=32, n_layers=1)).eval()
    mixer = model.blocks[0].mixer
    forward = mixer.forward

    def silent_on_0_tokens(x, state=None, **kw):  # returns before its hook points on 0 tokens
        if x.shape[1] == 0:
            return x.new_zeros(x.shape[0], 0, mixer.d_model), (
                state if state is not None else mixer.initial_state(x.shape[0])
            )
        return forward(x, state, **kw)

    monkeypatch.setattr(mixer, "forward", silent_on_0_tokens)
    with pytest.raises(ValueError) as info:
        capture_maps(model, torch.zeros(1, 0, dtype=torch.long))
    assert str(info.value) == (
        "input_ids: 0 tokens (shape [1, 0]); layer 0's mixer SelfModifyingTitans records no hook_q, hook_k, "
        "hook_v, hook_g, hook_beta on them, so it has no map: expected T >= 1 tokens"
    )


# ------------------------------------------------------------------------------------------------
# review 46 of the fixes above


def test_a_checkpoint_that_lost_config_and_weights_is_damaged_not_foreign(tmp_path):
    """A checkpoint left with its manifest (config and weights lost) and no ``latest``: a damaged
    checkpoint of the run (as before the probe-folder fix), not a probe's output folder: refused as
    corrupt when verified, returned unverified (the first version of the fix called it "not a
    checkpoint" and ``mnemo train`` then said "run the command again to start", which it refuses)."""
    run = tmp_path / "run"
    _fake_run(run, [2])
    for name in ("config.json", "model.safetensors"):
        (run / "ckpt-000002" / name).unlink()
    (run / "latest").unlink()
    assert (run / "ckpt-000002" / "manifest.json").is_file()
    with pytest.raises(ckpt_mod.CorruptCheckpointError):
        ckpt_mod.resolve_checkpoint(run)
    assert ckpt_mod.resolve_checkpoint(run, verify=False) == run / "ckpt-000002"
    from mnemo.commands.train import _interrupted_then

    assert _interrupted_then(run) == (
        f"; {run}'s newest checkpoint is ckpt-000002: continue with --resume --out {run}"
    )


def test_an_interrupted_overwrite_says_the_old_run_is_back(tmp_path, capsys, monkeypatch):
    """``--overwrite``, interrupted (without a message of its own) before the new run saved: the old
    run is restored, and the line says so instead of naming the old run's checkpoint to resume."""
    out = tmp_path / "run"
    flags = ["--steps", "2", "--eval-interval", "2", "--out", str(out)]
    assert main(["train", *TINY, *flags]) == 0
    capsys.readouterr()

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", interrupted)
    assert main(["train", *TINY, *flags, "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"mnemo: interrupted; the old run in {out} is back as it was: run the command again to start over"
    )
    assert (out / "latest").read_text().strip() == "ckpt-000002"


def test_the_counters_are_made_dynamic_only_where_torch_has_the_setting():
    """torch before 2.7 has no ``torch.compiler.config.dynamic_sources`` (2.4 is the oldest mnemo
    accepts): the compiled step's context is then a no-op instead of an ``AttributeError``, which is
    no compile error and would not have fallen back to eager. Where it has it, the counters' pattern
    is added to a user's own for the call and the user's setting is back after it."""
    import types

    import torch

    from mnemo.models.lm import _COUNTERS, _counters_dynamic

    with _counters_dynamic(types.SimpleNamespace()):  # an older torch's config: nothing to patch
        pass
    cfg = torch.compiler.config
    with cfg.patch(dynamic_sources="L['mine']"):
        with _counters_dynamic():
            assert cfg.dynamic_sources == f"L['mine'],{_COUNTERS}"
        assert cfg.dynamic_sources == "L['mine']"
    mine = cfg.dynamic_sources
    with _counters_dynamic():
        assert cfg.dynamic_sources == (f"{mine},{_COUNTERS}" if mine else _COUNTERS)
    assert cfg.dynamic_sources == mine


def test_capture_maps_of_tokens_still_needs_every_hook(monkeypatch):
    """Only a 0-token call may leave a mixer's hook without a value: with tokens, a hook that did not
    fire is an error (a ``KeyError`` naming it), not a map built without it (``NeuralMemory`` reads
    its forgetting gate ``hook_g`` with ``acts.get``: the first version of the 0-token fix built
    ``titans_lmm``'s map without the gate)."""
    import torch

    from mnemo.interp import capture_maps
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("titans_lmm", vocab_size=32, d_model=16, n_layers=1)).eval()
    real = model.run_with_cache

    def without_g(*a, **k):
        out, cache = real(*a, **k)
        return out, {n: v for n, v in cache.items() if not n.endswith("mixer.hook_g")}

    monkeypatch.setattr(model, "run_with_cache", without_g)
    with pytest.raises(KeyError, match="hook_g"):
        capture_maps(model, torch.randint(0, 32, (1, 5)))
