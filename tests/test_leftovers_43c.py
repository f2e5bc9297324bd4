"""Leftovers of session 42's reviews, area C (checkpoints and the CLI's file commands).

1. ``mnemo convert --from-dcp SRC OUT`` into a folder holding only what a run that never saved a
   checkpoint leaves (``metrics.jsonl``; ``.lock``, held while that run is alive) wrote its
   checkpoint there: the other run's log became the log of the consolidated run (a ``--resume``
   appends to it), and a live run's first checkpoints rotated the consolidated one out. Now, as
   ``mnemo train`` treats such a folder: its ``metrics.jsonl`` is refused, a ``.lock`` held by a
   live process is refused (naming the pid), a stale ``.lock`` is taken over.
2. ``mnemo verify -v`` printed each row as a one-row table, its columns sized by that row's names:
   the lines of two ops (or checks) with names of different lengths did not line up.
3. A single-file checkpoint of a hybrid model from before both optimizer-state changes (Mamba-1's
   ``A_log`` in the decayed group, and a TTT memory without ``inner_norm_weight/bias``) did not
   resume: each change alone is handled (``match_saved_groups``, ``load_with_fresh``), but the
   first did not allow for the parameters the checkpoint lacks, and torch's bare "loaded state dict
   contains a parameter group that doesn't match the size of optimizer's group" reached the user.
"""

from __future__ import annotations

import fcntl
import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.train import test_review7_distributed as _review7

sharded_run = _review7.sharded_run  # (the fixture: a run whose checkpoint holds DCP shards)


# ----------------------------------------------------------------------------------------------
# 1. consolidating into the folder of a run that wrote no checkpoint
# ----------------------------------------------------------------------------------------------


def _files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_consolidating_into_the_log_of_a_run_without_checkpoints_is_refused(sharded_run, tmp_path):
    """``mnemo train`` refuses a folder holding only the ``metrics.jsonl`` of a run that wrote no
    checkpoint (its records would mix with the new run's); ``--from-dcp`` wrote ckpt-000001 and
    ``latest`` beside it, making that log the consolidated run's."""
    from mnemo.train.sharded import consolidate_checkpoint

    run, _ = sharded_run
    out = tmp_path / "unfinished"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 2, "train_loss": 3.0}\n')
    before = _files(out)
    with pytest.raises(ValueError) as e:
        consolidate_checkpoint(run, out)
    msg = " ".join(str(e.value).split())
    assert str(out) in msg and "metrics.jsonl" in msg and "wrote no checkpoint" in msg, msg
    assert _files(out) == before  # nothing written, nothing moved (the lock it took is gone)


def test_consolidating_into_a_folder_a_live_run_holds_is_refused_and_a_stale_lock_is_not(
    sharded_run, tmp_path
):
    """A ``.lock`` held by a live process (a run before its first checkpoint) is refused, naming the
    folder and the pid (that run's checkpoints would rotate the consolidated one out); a ``.lock``
    nobody holds (a killed run's) is taken over, as ``mnemo train`` does, and removed afterwards."""
    from mnemo.train.sharded import consolidate_checkpoint

    run, _ = sharded_run
    live, stale = tmp_path / "live", tmp_path / "stale"
    live.mkdir()
    stale.mkdir()
    (stale / ".lock").write_text("999999\n")
    with open(live / ".lock", "a+") as held:  # (another open file: flock refuses it to this process too)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        with pytest.raises(ValueError) as e:
            consolidate_checkpoint(run, live)
        msg = " ".join(str(e.value).split())
        assert str(live) in msg and "pid 4242" in msg, msg
        assert sorted(p.name for p in live.iterdir()) == [".lock"]
    ckpt = consolidate_checkpoint(run, stale)
    assert ckpt == stale / "ckpt-000001" and (stale / "latest").read_text().strip() == "ckpt-000001"
    assert not (stale / ".lock").exists()


# ----------------------------------------------------------------------------------------------
# 2. mnemo verify -v: the row lines line up
# ----------------------------------------------------------------------------------------------


def test_verify_verbose_lines_have_the_same_columns(capsys):
    """Rows of ``ssd`` and ``selective_scan_grouped_gated`` (op names of 3 and 28 characters) and of
    checks ``empty[recurrent]`` / ``empty[chunk]``: in every ``-v`` line the check
    name starts at the same column, the result ends at the same column and the line (right-justified
    error and tolerance) ends at the same column. Before: ``ssd  empty[recurrent]    pass`` against
    ``selective_scan_grouped_gated  empty[recurrent]    pass``."""
    from mnemo.commands import verify

    argv = ["--third-party", "none", "--ops", "ssd,selective_scan_grouped_gated", "--quick", "-v"]
    assert verify.main([*argv, "--checks", "empty*"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.split("\n==", 1)[0].splitlines() if x.strip()]
    ops = {x.split()[0] for x in lines}
    checks = {x.split()[1] for x in lines}
    assert {"ssd", "selective_scan_grouped_gated"} <= ops and {"empty[recurrent]", "empty[chunk]"} <= checks
    assert all(x.split()[2] == "pass" for x in lines), lines
    check_at = {x.index(x.split()[1], len(x.split()[0])) for x in lines}
    result_end = {re.search(r"\bpass\b", x).end() for x in lines}
    assert len(check_at) == 1 and len(result_end) == 1 and len({len(x) for x in lines}) == 1, lines
    # the check column starts after the longest op name and two spaces, as in the summary table
    assert check_at == {len("selective_scan_grouped_gated") + 2}


# ----------------------------------------------------------------------------------------------
# 3. a hybrid model's checkpoint from before both optimizer-state changes
# ----------------------------------------------------------------------------------------------


def test_a_hybrid_checkpoint_from_before_both_group_changes_resumes(tmp_path):
    """A Mamba-1 + TTT-Linear model whose checkpoint was written with Mamba-1's ``A_log`` in the
    decayed group and without the TTT memory's ``inner_norm_weight/bias``: the saved parameters
    take their saved AdamW moments (one step with gradient 1: ``exp_avg = 1 − β₁ = 0.1``,
    ``exp_avg_sq = 1 − β₂``), ``A_log`` stays in the decayed group (as it was trained), and the two
    parameters the checkpoint lacks start without optimizer state. Before: torch's ValueError "a
    parameter group that doesn't match the size of optimizer's group", naming nothing."""
    from safetensors.torch import load_file, save_file, save_model

    from mnemo.models import LanguageModel, ModelConfig
    from mnemo.models.lm import WEIGHTS_NAME
    from mnemo.train import TrainConfig
    from mnemo.train.build import load_checkpoint
    from mnemo.train.optim import _param_groups, make_optimizer

    torch.manual_seed(0)
    mcfg = ModelConfig(
        vocab_size=32,
        d_model=16,
        n_layers=2,
        layers=["mamba", "neural_memory"],
        mixer_options={"neural_memory": {"n_heads": 2, "spec": "ttt_linear"}},
    )
    model = LanguageModel(mcfg)
    names = {id(p): n for n, p in model.named_parameters()}
    absent = {n for n in names.values() if "inner_norm" in n}
    assert len(absent) == 2 and "blocks.0.mixer.A_log" in names.values()
    # the old run: the grouping before no_weight_decay, without the inner norm's parameters
    grouping = _param_groups(model, set())
    old = [[p for p in ps if names[id(p)] not in absent] for ps, _, _ in grouping]
    groups = [{"params": ps, "weight_decay": 0.1 if d else 0.0} for ps, (_, d, _) in zip(old, grouping)]
    old_opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    for ps in old:
        for p in ps:
            p.grad = torch.ones_like(p)
    with torch.no_grad():
        old_opt.step()
    for ps in old:
        for p in ps:
            p.grad = None
    ckpt = tmp_path / "ckpt-000001"
    ckpt.mkdir()
    save_model(model, str(ckpt / WEIGHTS_NAME))
    weights = load_file(str(ckpt / WEIGHTS_NAME))
    save_file({k: v for k, v in weights.items() if k not in absent}, str(ckpt / WEIGHTS_NAME))

    optimizer = make_optimizer(model, TrainConfig(weight_decay=0.1, beta1=0.9, beta2=0.95))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        load_checkpoint(model, optimizer, ckpt, {"optimizer": old_opt.state_dict()}, "cpu", False)
    for n, p in model.named_parameters():
        if n in absent:
            assert p not in optimizer.state, n  # fresh optimizer state
            continue
        st = optimizer.state[p]
        torch.testing.assert_close(st["exp_avg"], torch.full_like(p, 1 - 0.9), rtol=0, atol=1e-7)
        torch.testing.assert_close(st["exp_avg_sq"], torch.full_like(p, 1 - 0.95), rtol=0, atol=1e-7)
    a_log = dict(model.named_parameters())["blocks.0.mixer.A_log"]
    (group,) = [g for g in optimizer.param_groups if any(p is a_log for p in g["params"])]
    assert group["weight_decay"] == 0.1  # decayed, as the checkpoint's run trained it
    assert not any(p is a_log for p in make_optimizer(model, TrainConfig()).param_groups[0]["params"])
    text = " ".join(str(w.message) for w in said)
    assert "A_log" in text and "inner_norm_weight" in text, text  # both changes said


# ----------------------------------------------------------------------------------------------
# 4. (not a defect) the neural memory's checkpointed materialised read chooses no backend
# ----------------------------------------------------------------------------------------------


def test_the_materialised_reads_recompute_chooses_no_backend(monkeypatch):
    """(guard) ``mnemo.memory.chunk`` recomputes its blocks of per-token weights in the backward
    pass (``torch.utils.checkpoint``) without :func:`mnemo.ops.dispatch.recompute_as_chosen`: it
    needs none while the recomputed code (``retention_map``, ``memory_apply``: pure torch) asks no
    backend choice: the dispatch table's ``select``, ``current_backend`` and the C kernels'
    ``enabled``, ``usable`` are called neither in the forward under ``use_backend("torch")`` nor in the blocks
    recomputed after it. Should one come to ask, pass ``recompute_as_chosen`` as models/lm.py does."""
    import torch.nn.functional as F

    import mnemo.memory.chunk as eng
    import mnemo.ops._native as native
    from mnemo.memory import init_state, neural_memory, preset
    from mnemo.ops import dispatch

    B, T, H, K = 2, 12, 2, 4
    monkeypatch.setattr(eng, "_MATERIALIZE_BUDGET", 2 * B * H * 8 * 4)  # ~2 tokens per block
    asked, ran, phase = [], [], ["forward"]
    choices = [(dispatch, "select"), (dispatch, "current_backend")]
    choices += [(native, n) for n in ("enabled", "usable", "usable_opaque")]
    for mod, name in choices:
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name: (asked.append((_n, phase[0])), _o(*a))[1])
    checkpoint = torch.utils.checkpoint.checkpoint

    def counted(fn, *args, **kw):
        return checkpoint(lambda *a: (ran.append(phase[0]), fn(*a))[1], *args, **kw)

    monkeypatch.setattr(eng.torch.utils.checkpoint, "checkpoint", counted)
    spec = preset("memora", chunk_size=5, expansion=2.0)  # (KL retention: a materialised read)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    theta = torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.5 + 0.1
    decay = F.logsigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64) + 2)
    weights = [
        0.3 * torch.randn(B, H, i, o, generator=g, dtype=torch.float64) for i, o in spec.layer_dims(K, K)
    ]
    with dispatch.use_backend("torch"):
        o, _ = neural_memory(
            spec, q, k, v, theta, g=decay, initial_state=init_state(spec, weights), use_closed_form=False
        )
    phase[0] = "backward"
    o.square().sum().backward()
    assert ran.count("forward") == ran.count("backward") >= 2  # each block recomputed
    assert asked == []
